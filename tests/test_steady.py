"""The steady-state rules of a sweep level and the clients' stagger, on synthetic clocks (no sleeping):
a closed loop of clients against a simulated saturated server shows waves when the clients start
together and a steady state when they start as the load generator staggers them."""

from __future__ import annotations

import pytest

from overnight.bench import steady
from overnight.bench.client import RequestRecord
from overnight.bench.level import judge_window, window_timeline
from overnight.bench.load import (
    LoadSpec,
    Prompts,
    Workload,
    first_answer_len,
    output_len_bounds,
    split,
    start_offset,
)
from overnight.bench.metrics_reader import Snapshot

# -- the verdict on a window ------------------------------------------------------------------------


def test_a_steady_window_passes():
    v = steady.judge(
        [1000.0, 1010.0, 990.0, 1000.0], 2.5, prompt_tokens=8000.0, expected_ratio=3.0, mean_prompt_len=512
    )
    assert v.steady and v.ratio_ok and v.spread_ok and v.reason == ""
    assert v.total_per_output == 3.0 and v.sub_output_tok_s == [400.0, 404.0, 396.0, 400.0]


def test_the_old_1024_client_window_is_a_transient():
    # The first server sweep on the H200: 3,166 output and 39,006 total tok/s over 8 s at 1024 clients
    out = 3166 * 8
    v = steady.judge(
        [out / 4] * 4, 2.0, prompt_tokens=(39006 - 3166) * 8, expected_ratio=3.0, mean_prompt_len=512
    )
    assert not v.steady and not v.ratio_ok and v.total_per_output == pytest.approx(12.3, abs=0.05)
    assert "total/output 12.32" in v.reason


def test_a_drifting_output_rate_is_not_steady():
    v = steady.judge(
        [800.0, 900.0, 1000.0, 1100.0], 1.0, prompt_tokens=7600.0, expected_ratio=3.0, mean_prompt_len=512
    )
    assert v.ratio_ok and not v.spread_ok and not v.steady and v.spread == pytest.approx(0.158, abs=1e-3)


def test_allowances_cover_a_window_of_few_tokens_and_few_prompts():
    # one client on a slow CPU: 5 tokens a sub-window, one off by a token; two prompts of 16 in the window
    v = steady.judge([5.0, 4.0, 5.0, 6.0], 2.0, prompt_tokens=32.0, expected_ratio=2.0, mean_prompt_len=16)
    assert v.steady
    # the same relative deviation with thousands of tokens is a real drift
    v = steady.judge(
        [5000.0, 4000.0, 5000.0, 6000.0], 2.0, prompt_tokens=20000.0, expected_ratio=2.0, mean_prompt_len=16
    )
    assert not v.steady and v.ratio_ok
    # 4 clients on a slow CPU: a step brings 4 tokens, a sub-window ~4 steps; one step more or less
    # is not a drift, though the same counts one token a step would be
    few_steps = [18.0, 14.0, 18.0, 22.0]
    assert steady.judge(few_steps, 3.5, 72 * 16 / 12, 28 / 12, 16, tokens_per_step=4).steady
    assert not steady.judge(few_steps, 3.5, 72 * 16 / 12, 28 / 12, 16, tokens_per_step=1).steady
    # a window holding one prompt too many against 40 output tokens is within one prompt's worth
    assert steady.judge([10.0] * 4, 1.0, 3 * 16.0, 2.0, 16).ratio_ok  # 2.2 against 2.0 +- 0.5
    assert not steady.judge([10.0] * 4, 1.0, 6 * 16.0, 2.0, 16).ratio_ok  # 3.4: more than a prompt off


def test_no_output_is_not_steady_and_an_unknown_ratio_is_not_judged():
    assert not steady.judge([0.0] * 4, 1.0, 0.0, 3.0, 512).steady
    v = steady.judge([100.0] * 4, 1.0, 123456.0, None, 512)
    assert v.steady and v.ratio_ok and v.expected_total_per_output is None


def test_an_open_loop_that_falls_behind_its_arrivals_is_not_steady():
    ok = steady.judge([100.0] * 4, 1.0, 800.0, 3.0, 512)
    assert steady.keeps_up(ok, requests_s=9.8, rate=10.0, window_s=60.0).steady
    late = steady.keeps_up(ok, requests_s=8.0, rate=10.0, window_s=60.0)
    assert not late.steady and "queue grows" in late.reason
    # 2 req/s over 5 s is 10 arrivals, +-3 by chance: 1.6 req/s is within that
    assert steady.keeps_up(ok, requests_s=1.6, rate=2.0, window_s=5.0).steady


# -- warm-up and window lengths ---------------------------------------------------------------------


def test_lifetimes_ramp_warmup_and_window():
    assert steady.lifetime_from_rate(1024, 256, 9728.0) == pytest.approx(26.95, abs=0.01)
    assert steady.lifetime_from_rate(8, 256, 0.0) is None
    assert steady.ramp_seconds(27.0, cap_s=90.0) == 13.5 and steady.ramp_seconds(400.0, cap_s=90.0) == 90.0
    # below saturation the lifetime holds; once the request rate stops growing, Little's law
    assert steady.next_lifetime(1.5, 40.0, 8) == 1.5
    assert steady.next_lifetime(7.0, 38.0, 1024) == pytest.approx(26.95, abs=0.01)
    assert not steady.warmed_up(now=10.0, ramp_end=12.0, completions=600, clients=1024)  # still ramping
    assert not steady.warmed_up(now=13.0, ramp_end=12.0, completions=500, clients=1024)
    assert steady.warmed_up(now=13.0, ramp_end=12.0, completions=512, clients=1024)
    assert steady.window_seconds(27.0, min_s=10.0, max_s=300.0) == 54.0
    assert steady.window_seconds(1.3, min_s=10.0, max_s=300.0) == 10.0
    assert steady.window_seconds(400.0, min_s=10.0, max_s=300.0) == 300.0
    assert steady.window_seconds(None, min_s=10.0, max_s=300.0) == 10.0
    assert steady.window_seconds(27.0, 10.0, 300.0, lifetimes=3.0) == 81.0
    assert steady.sub_windows(0.0, 8.0) == [(0.0, 2.0), (2.0, 4.0), (4.0, 6.0), (6.0, 8.0)]


def test_judge_window_counts_records_into_sub_windows():
    def request(start: float, first: float, every: float, n: int, prompt: int = 4) -> RequestRecord:
        times = [first + i * every for i in range(n)]
        return RequestRecord(start, times, [1] * n, end=times[-1], prompt_tokens=prompt, output_tokens=n)

    # window [0, 8): two clients, each 4 tokens a second, a request of 4 in / 8 out every 2 s
    records = [request(t0 + c, t0 + c + 0.25, 0.25, 8) for c in (0.0, 0.125) for t0 in range(-2, 10, 2)]
    v = judge_window(records, 0.0, 8.0)
    assert v.sub_output_tok_s == [8.0, 8.0, 8.0, 8.0]
    assert v.expected_total_per_output == 1.5 and v.total_per_output == 1.5 and v.steady


def test_the_shortened_first_requests_do_not_set_the_expected_ratio():
    # 512 in / 256 out: the workload's ratio is 3.0; first answers cut to 16 tokens ran at 33.0 and, were
    # they counted, would raise the expectation above what a steady window measures
    def done(end: float, out: int, shortened: bool) -> RequestRecord:
        times = [end - 0.01 * (out - 1 - i) for i in range(out)]
        return RequestRecord(end - 3.0, times, [1] * out, end, 512, out, shortened=shortened)

    own = [done(1.0 + 0.5 * i, 256, False) for i in range(12)]
    firsts = [done(2.0 + i, 16, True) for i in range(3)]
    v = judge_window(own + firsts, 0.0, 8.0)
    assert v.expected_total_per_output == 3.0
    # a window in which only first requests finished still has an expectation: theirs
    assert judge_window(firsts, 0.0, 8.0).expected_total_per_output == 33.0


def test_the_timeline_bins_a_window_and_shows_a_wave():
    # window [10, 12) in 0.5-s bins; three requests: one finishing in bin 0, one sent in bin 1 whose
    # tokens come in bins 1-2, one failed (sent in bin 3, not counted as finished); bin 3 has no token
    ok = RequestRecord(9.0, [9.5, 10.1, 10.2], [1, 2, 1], end=10.2, prompt_tokens=4, output_tokens=4)
    late = RequestRecord(10.6, [10.7, 11.2], [1, 3], end=None, prompt_tokens=4, output_tokens=4)
    failed = RequestRecord(11.6, end=11.7, error="HTTP 500")
    snaps = [Snapshot(10.2, {"num_requests_running": 3.0, "num_requests_waiting": 1.0})]
    snaps.append(Snapshot(11.9, {"num_requests_running": 2.0, "num_requests_waiting": 0.0}))
    tl = window_timeline([ok, late, failed], snaps, 10.0, 12.0, bin_s=0.5)
    assert tl["output_tokens"] == [3, 1, 3, 0]
    assert tl["sent"] == [0, 1, 0, 1]
    assert tl["first_tokens"] == [0, 1, 0, 0]
    assert tl["finished"] == [1, 0, 0, 0]
    assert tl["running"] == [3.0, None, None, 2.0] and tl["waiting"] == [1.0, None, None, 0.0]

    # clients that started together finish together: their finishes come in one bin per lifetime
    n, life = 8, 2.0
    wave = [
        RequestRecord(k * life, [k * life + 1.0], [1], end=k * life + 1.9, output_tokens=1)
        for k in range(4)
        for _ in range(n)
    ]
    finished = window_timeline(wave, [], 0.0, 8.0, bin_s=0.5)["finished"]
    assert finished == [0, 0, 0, n] * 4


# -- the stagger ------------------------------------------------------------------------------------


def test_workers_start_spread_over_the_ramp_in_every_process():
    spec = LoadSpec("http://x", "m", Workload(output_len=256), concurrency=8, ramp_s=4.0)
    assert [start_offset(spec, w) for w in range(8)] == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5]
    for part in split(spec, 3):  # each process's workers cover the whole ramp
        offsets = [start_offset(part, w) for w in part.workers]
        assert offsets[0] <= 1.0 and offsets[-1] >= 2.5
    lengths = [first_answer_len(spec, w, 256) for w in range(8)]
    assert all(1 <= n <= 256 for n in lengths) and len(set(lengths)) > 4
    assert lengths == [first_answer_len(spec, w, 256) for w in range(8)]  # the same on every run


def simulate(
    clients: int,
    in_len: int,
    out_len: int,
    starts: list[float],
    first_lens: list[int],
    until: float,
    next_len=None,
):
    """A saturated server on a synthetic clock: each step decodes one token for every running request
    and prefills the prompts that arrived (sampling their first token), taking 1 time unit plus 2 per
    512 prompt tokens. A client sends its next request as its last one finishes; next_len(client)
    gives that request's answer length (default out_len). Returns per step (end time, output tokens,
    prompt tokens credited with their first token, requests finished)."""
    remaining = [0] * clients  # tokens still to come; 0: idle
    lens = list(first_lens)
    ready_at = list(starts)  # when an idle client sends
    t = 0.0
    steps = []
    while t < until:
        arriving = [c for c in range(clients) if remaining[c] == 0 and ready_at[c] <= t]
        decoding = [c for c in range(clients) if remaining[c] > 0]
        t += 1.0 + 2.0 * len(arriving) * in_len / 512
        finished = 0
        for c in arriving:
            remaining[c] = lens[c]
            lens[c] = next_len(c) if next_len else out_len
        for c in decoding + arriving:
            remaining[c] -= 1
            if remaining[c] == 0:
                ready_at[c] = t
                finished += 1
        steps.append((t, len(decoding) + len(arriving), len(arriving) * in_len, finished))
    return steps


def measured_window(steps, clients: int, out_len: int, ramp_end: float) -> tuple[float, float]:
    """Where a sweep measures: warm-up by the rules (ramp over, half the clients came round), then a
    window of WINDOW_LIFETIMES lifetimes from the output rate of the warm-up's last quarter."""
    done = 0
    for i, (t, _, _, finished) in enumerate(steps):
        done += finished
        if steady.warmed_up(t, ramp_end, done, clients):
            recent = [s for s in steps[: i + 1] if s[0] >= t * 3 / 4]
            rate = sum(s[1] for s in recent[1:]) / (t - recent[0][0])
            life = steady.lifetime_from_rate(clients, out_len, rate)
            return t, t + steady.window_seconds(life, 0.0, 1e9)
    raise AssertionError("never warmed up")


def judge_steps(steps, w0: float, w1: float, expected: float, in_len: int) -> steady.Steadiness:
    edges = steady.sub_windows(w0, w1)
    sub = [float(sum(s[1] for s in steps if a <= s[0] < b)) for a, b in edges]
    prompt = float(sum(s[2] for s in steps if w0 <= s[0] < w1))
    return steady.judge(sub, (w1 - w0) / len(edges), prompt, expected, in_len)


def test_staggered_clients_reach_a_steady_state_where_clients_started_together_move_in_waves():
    n, in_len, out_len = 256, 512, 256
    expected = (in_len + out_len) / out_len
    # At saturation a request lives out_len steps of 1 + 2 units (one prompt arrives a step): 768.
    lifetime = out_len * 3.0
    spec = LoadSpec(
        "http://x", "m", Workload(in_len, out_len), concurrency=n, ramp_s=steady.ramp_seconds(lifetime, 1e9)
    )
    starts = [start_offset(spec, w) for w in range(n)]
    firsts = [first_answer_len(spec, w, out_len) for w in range(n)]
    spread = simulate(n, in_len, out_len, starts, firsts, until=10 * lifetime)
    together = simulate(n, in_len, out_len, [0.0] * n, [out_len] * n, until=10 * lifetime)

    w0, w1 = measured_window(spread, n, out_len, spec.ramp_s)
    assert w0 < 2 * lifetime and w1 - w0 == pytest.approx(2 * lifetime, rel=0.15)
    v = judge_steps(spread, w0, w1, expected, in_len)
    assert v.steady, v.reason
    for k in range(1, 8):  # and it stays steady, wherever a window of that length falls
        later = judge_steps(spread, w0 + k * lifetime / 3, w1 + k * lifetime / 3, expected, in_len)
        assert later.steady, (k, later.reason)

    # started together: all prompts prefill in one long step each lifetime, when no token comes out
    w0, w1 = measured_window(together, n, out_len, 0.0)
    verdicts = [
        judge_steps(together, w0 + k * lifetime / 3, w1 + k * lifetime / 3, expected, in_len)
        for k in range(3)
    ]
    assert not any(v.steady for v in verdicts)
    assert all(v.spread is not None and v.spread > 0.2 for v in verdicts)


# -- answers of varied length -----------------------------------------------------------------------


def test_answer_lengths_spread_around_the_mean_the_same_on_every_run():
    w = Workload(16, 256, seed=3, output_len_range=0.25)
    assert output_len_bounds(w) == (192, 320)
    lens = [Prompts(w, "w0").next()[1] for _ in range(1)] + [n for _, n in _take(Prompts(w, "w1"), 2000)]
    assert min(lens) >= 192 and max(lens) <= 320 and min(lens) < 200 and max(lens) > 312
    assert sum(lens) / len(lens) == pytest.approx(256, rel=0.02)
    assert _take(Prompts(w, "w1"), 50) == _take(Prompts(w, "w1"), 50)  # seeded per stream
    assert {n for _, n in _take(Prompts(Workload(16, 256), "w1"), 50)} == {256}  # range 0: exact
    assert output_len_bounds(Workload(16, 2, output_len_range=0.9)) == (1, 4)  # never below 1 token


def _take(prompts: Prompts, n: int) -> list:
    return [prompts.next() for _ in range(n)]


def test_a_spread_of_answer_lengths_dissolves_a_wave_that_equal_lengths_keep():
    """Clients bunched into one band (here: all started together) stay one band under answers of equal
    length (the test above) and drift apart under lengths drawn around the same mean."""
    n, in_len, out_len = 256, 512, 256
    expected = (in_len + out_len) / out_len
    lifetime = out_len * 3.0
    w = Workload(8, out_len, output_len_range=0.25)
    streams = [Prompts(w, f"w{c}") for c in range(n)]
    steps = simulate(
        n, in_len, out_len, [0.0] * n, [out_len] * n, 14 * lifetime, next_len=lambda c: streams[c].next()[1]
    )
    verdicts = [
        judge_steps(steps, w0, w0 + 2 * lifetime, expected, in_len)
        for w0 in (0.5 * lifetime, 9 * lifetime, 10 * lifetime, 11 * lifetime)
    ]
    assert not verdicts[0].steady  # still bunched at first
    assert all(v.steady for v in verdicts[1:]), [v.reason for v in verdicts]


def test_the_sweep_refuses_a_range_outside_0_1():
    from overnight.cli import main

    with pytest.raises(SystemExit, match="output-len-range must be in"):
        main(["bench", "sweep", "--url", "http://127.0.0.1:9", "--output-len-range", "1.5"])
