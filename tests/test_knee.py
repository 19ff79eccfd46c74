"""The knee rules on synthetic series: growth, plateau, fall, noise; and the reason growth stopped."""

from __future__ import annotations

import random

import pytest

from overnight.bench.knee import (
    LevelPoint,
    best_index,
    knee_index,
    refine_between,
    stop_reason,
    verdict,
    why_stopped,
)

LEVELS = [1, 2, 4, 8, 16, 32, 64, 128]


def first_stop(series: list[float], min_gain: float = 0.05) -> tuple[int, str] | None:
    """(index of the level after which the sweep stops, why), replaying the rule level by level."""
    for k in range(1, len(series) + 1):
        reason = stop_reason(series[:k], min_gain)
        if reason is not None:
            return k - 1, reason
    return None


def test_pure_growth_never_stops_and_the_knee_is_the_last_level():
    series = [10.0 * 1.8**i for i in range(len(LEVELS))]
    assert first_stop(series) is None
    assert knee_index(series, 0.05) == len(series) - 1
    v = verdict([LevelPoint(x, t) for x, t in zip(LEVELS, series, strict=False)], 0.05)
    assert v.stopped == "end" and v.reason == "still_growing" and v.knee_x == 128 and v.best_x == 128


def test_plateau_stops_after_two_steps_of_little_growth():
    series = [10, 19, 35, 60, 62, 63.5, 64, 64]
    # 60 -> 62 -> 63.5 is +5.8% over two steps (goes on); 62 -> 63.5 -> 64 is +3.2% (stops at 64)
    assert first_stop(series) == (6, "plateau")
    # The knee: the smallest level no later level beats by 5%: 62 * 1.05 = 65.1 >= 64
    assert knee_index(series, 0.05) == 4
    assert LEVELS[knee_index(series, 0.05)] == 16


def test_a_fall_stops_at_once_and_the_knee_is_the_peak():
    # the seed's L4 run: 13.5 tok/s at 1 user ... 273.9 at 32, then 241.4 at 64
    series = [13.5, 26.0, 50.1, 95.3, 170.2, 273.9, 241.4]
    assert first_stop(series) == (6, "fell")
    assert knee_index(series, 0.05) == 5
    assert best_index(series) == 5


def test_noise_on_a_plateau_does_not_move_the_knee_past_the_plateau():
    rng = random.Random(0)
    for _ in range(200):
        growth = [10, 20, 39, 70, 100]
        plateau = [100 * (1 + rng.uniform(-0.02, 0.02)) for _ in range(3)]
        series = growth + plateau
        stop = first_stop(series)
        assert stop is not None and stop[0] in (5, 6)  # stops on the plateau's first or second level
        knee = knee_index(series[: stop[0] + 1], 0.05)
        assert knee in (3, 4, 5)  # 70 * 1.05 < 100, so never before level 8 ... at most one noisy step on
        assert LEVELS[knee] in (8, 16, 32)


def test_small_noise_during_real_growth_does_not_stop_the_sweep():
    rng = random.Random(1)
    for _ in range(200):
        series = [10.0 * 1.6**i * (1 + rng.uniform(-0.03, 0.03)) for i in range(6)]
        assert first_stop(series) is None


def test_min_gain_moves_the_stop():
    series = [10, 19, 35, 38, 40]  # +14% over the last two steps
    assert first_stop(series, 0.05) is None
    assert first_stop(series, 0.20) == (4, "plateau")


def test_refine_between():
    assert refine_between(32, 64) == 48
    assert refine_between(64, 32) == 48
    assert refine_between(2, 4) == 3
    assert refine_between(1, 2) is None


def points(series, **kw):
    return [
        LevelPoint(x, t, **{k: v[i] for k, v in kw.items()})
        for i, (x, t) in enumerate(zip(LEVELS, series, strict=False))
    ]


FALL = [10, 19, 35, 60, 100, 90]


def test_reason_pool_full():
    pts = points(
        FALL,
        mean_kv_usage=[0.01, 0.02, 0.05, 0.2, 0.7, 0.97],
        mean_waiting=[0, 0, 0, 0, 0, 9.0],
        mean_running=[1, 2, 4, 8, 16, 20],
        max_num_seqs=[256] * 6,
    )
    v = verdict(pts, 0.05)
    assert (v.knee_x, v.best_x, v.stopped, v.reason) == (16, 16, "fell", "pool_full")
    assert "FP8" in v.detail


def test_reason_max_num_seqs():
    pts = points(
        FALL,
        mean_kv_usage=[0.01, 0.02, 0.05, 0.1, 0.15, 0.16],
        mean_waiting=[0, 0, 0, 0, 0, 16],
        mean_running=[1, 2, 4, 8, 16, 16],
        max_num_seqs=[16] * 6,
    )
    assert why_stopped(pts, 4)[0] == "max_num_seqs"


def test_reason_throttling_and_compute_bound():
    clocks = [1980, 1980, 1975, 1970, 1960, 1500]
    pts = points(
        FALL,
        mean_kv_usage=[0.1] * 6,
        mean_waiting=[0] * 6,
        mean_running=[1, 2, 4, 8, 16, 32],
        max_num_seqs=[256] * 6,
        sm_clock_mhz=clocks,
    )
    assert why_stopped(pts, 4)[0] == "throttling"
    steady = points(
        FALL,
        mean_kv_usage=[0.1] * 6,
        mean_waiting=[0] * 6,
        mean_running=[1, 2, 4, 8, 16, 32],
        max_num_seqs=[256] * 6,
        sm_clock_mhz=[1980] * 6,
    )
    assert why_stopped(steady, 4)[0] == "compute_bound"
    no_gpu = points(FALL, mean_kv_usage=[0.1] * 6, mean_waiting=[0] * 6, mean_running=[1, 2, 4, 8, 16, 32])
    assert why_stopped(no_gpu, 4)[0] == "compute_bound"


def test_verdict_sorts_a_late_refinement_level_into_place():
    pts = points(FALL)
    v = verdict(pts + [LevelPoint(24, 110.0)], 0.05, stopped="fell")
    assert v.best_x == 24 and v.best_output_tok_s == 110.0 and v.stopped == "fell"
    assert v.knee_x == 24
    # within min_gain of 16's 100 tok/s, a refined level does not move the knee
    assert verdict(pts + [LevelPoint(24, 104.0)], 0.05).knee_x == 16


@pytest.mark.parametrize("series", [[5.0], [5.0, 4.0]])
def test_short_series(series):
    v = verdict([LevelPoint(x, t) for x, t in zip(LEVELS, series, strict=False)], 0.05)
    assert v.best_x == 1


# On the H200, vLLM's server at 64 and 1,024 clients (512 in / 256 out): at 1,024 its scheduler
# ran 259 requests and queued none, the rest waited in its front end (TTFT p50 31 s).
FRONT = dict(mean_kv_usage=[0.05, 0.21], mean_waiting=[0.0, 0.0], mean_running=[58.8, 259.2])


def test_reason_front_end_where_the_server_holds_fewer_requests_than_the_clients():
    pts = [
        LevelPoint(64, 5677.0, clients=64, client_lag_ms=0.4, **{k: v[0] for k, v in FRONT.items()}),
        LevelPoint(1024, 6150.0, clients=1024, client_lag_ms=1.2, **{k: v[1] for k, v in FRONT.items()}),
    ]
    v = verdict(pts, 0.05)
    # Output still grew, but more clients would only wait in the front end: not "still_growing".
    assert (v.best_x, v.reason) == (1024, "front_end")
    assert "765 requests waited" in v.detail and "ran 259 and queued 0" in v.detail
    # The same gap with a client whose loop lagged: the load generator is to blame.
    lagging = [pts[0], LevelPoint(**{**pts[1].__dict__, "client_lag_ms": 45.0})]
    assert verdict(lagging, 0.05).reason == "client_bound"
    # Past the knee too, before the clock and compute verdicts.
    fell = [pts[0], LevelPoint(**{**pts[1].__dict__, "output_tok_s": 5000.0})]
    assert why_stopped(fell, 0)[0] == "front_end"


def test_no_gap_when_the_server_holds_the_clients_or_they_are_unknown():
    # Ours at 1,024 on the same machine: 982 running and 8 waiting of 1,024 is within the slack.
    ours = LevelPoint(1024, 9878.0, mean_running=982.1, mean_waiting=7.7, mean_kv_usage=0.8, clients=1024)
    below = LevelPoint(512, 10169.0, mean_running=492.3, mean_waiting=1.2, mean_kv_usage=0.4, clients=512)
    assert why_stopped([below, ours], 0)[0] == "compute_bound"
    # A fixed-rate level (no clients) or a server without /metrics gives no verdict on the gap.
    rate = LevelPoint(8.0, 100.0, mean_running=2.0, mean_waiting=0.0)
    no_metrics = LevelPoint(1024, 100.0, clients=1024)
    assert why_stopped([rate], 0)[0] == "still_growing"
    assert why_stopped([no_metrics], 0)[0] == "still_growing"
    # Two clients short of eight is a gap (25%); one is the moment between an answer and the next request.
    assert (
        why_stopped([LevelPoint(8, 1.0, mean_running=6.0, mean_waiting=0.0, clients=8)], 0)[0] == "front_end"
    )
    assert (
        why_stopped([LevelPoint(8, 1.0, mean_running=7.0, mean_waiting=0.0, clients=8)], 0)[0]
        == "still_growing"
    )


def test_a_gap_without_the_clients_lag_names_both_places():
    old = LevelPoint(1024, 6150.0, mean_running=259.2, mean_waiting=0.0, clients=1024)  # no lag recorded
    reason, detail = why_stopped([old], 0)
    assert reason == "front_end" and "kept up" not in detail and "not recorded" in detail
