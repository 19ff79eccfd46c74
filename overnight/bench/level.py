"""One level of a sweep: run the load (staggered clients), wait out the warm-up, measure windows until one
is steady, and read it: client-side rates and latencies, the steady-state verdict (steady.py), the
server's /metrics when it serves them, the GPU's clocks when the server runs on this machine."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import statistics
import time

import httpx

from overnight.bench import steady
from overnight.bench.client import RequestRecord, send_one
from overnight.bench.gpu_info import ClockSampler
from overnight.bench.load import (
    Control,
    LoadSpec,
    PromptT,
    Workload,
    auto_processes,
    output_len_bounds,
    run_async,
    run_load,
)
from overnight.bench.metrics_reader import Snapshot, poll, scrape_sync, summarize
from overnight.bench.target import Target

log = logging.getLogger("overnight.bench")

DEFAULT_VOCAB = 32000  # random ids below this are valid for any current model
STOP_GRACE_S = 0.25  # the load runs on a little past the window, so the last scrape still sees it
DRAIN_WITHOUT_METRICS_S = 5.0  # a server without /metrics gets this long to let go of cut requests
POLL_S = 0.1  # how often the controller reads the load's progress counters
TIMELINE_BIN_S = 0.5  # window_timeline: ~10 steps at saturation on the H200; a request lives 25+ bins


def workload_from_args(args: argparse.Namespace, info: dict) -> Workload:
    dataset = load_dataset(args.dataset) if args.dataset else None
    vocab = args.vocab_size
    if vocab is None and not args.url:
        from overnight.loader.resolve import resolve_source  # reads the config only, no weights

        vocab = resolve_source(args.model, args.load_format).arch.vocab_size
    vocab = vocab or DEFAULT_VOCAB
    limit = info.get("max_model_len")
    workload = Workload(
        input_len=args.input_len,
        output_len=args.output_len,
        seed=args.seed,
        vocab_high=max(vocab - 1000, 200),  # clear of the added tokens at the end of the vocabulary
        dataset=dataset,
        output_len_range=args.output_len_range,
    )
    longest = output_len_bounds(workload)[1]
    if dataset is None and limit and args.input_len + longest > int(limit):
        raise SystemExit(
            f"--input-len {args.input_len} + the longest answer {longest} (--output-len "
            f"{args.output_len}, --output-len-range {args.output_len_range}) exceeds the server's "
            f"max_model_len {limit}"
        )
    return workload


def load_dataset(path: str) -> tuple[tuple[PromptT, int | None], ...]:
    """JSONL lines of {"prompt": text or token ids, "output_len" (or "max_tokens"): N, optional}."""
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            prompt = row.get("prompt", row.get("prompt_token_ids"))
            if not isinstance(prompt, (str, list)) or not prompt:
                raise SystemExit(f'{path}:{n}: each line needs a non-empty "prompt" (text or token ids)')
            out.append((prompt, row.get("output_len", row.get("max_tokens"))))
    if not out:
        raise SystemExit(f"{path}: no prompts")
    return tuple(out)


def probe_token_timing(target: Target, workload: Workload) -> str:
    """'usage' when the server's chunks carry the usage so far (continuous_usage_stats), else 'text'
    when its chunks carry text token by token, else 'logprobs' (a server without a tokenizer streams
    no text, so only logprobs show when each token arrived)."""
    for timing in ("usage", "text"):
        rec = _probe(target, workload, timing)
        if rec.error and timing == "usage":
            continue  # a server that refuses the extension
        if rec.error:
            raise RuntimeError(f"the server refused a probe request: {rec.error}")
        assert rec.end is not None
        shown = sum(n for t, n in zip(rec.chunk_times, rec.chunk_tokens, strict=True) if t < rec.end)
        if shown >= 4 and (timing == "text" or len(rec.chunk_times) >= 2):
            return timing
    return "logprobs"


def probe_lifetime(target: Target, workload: Workload, timing: str) -> float:
    """Seconds one request of the workload's lengths takes alone: the first level's expected lifetime."""
    rec = _probe(target, workload, timing, full=True)
    if rec.error or rec.end is None:
        raise RuntimeError(f"the server refused a probe request: {rec.error}")
    return rec.end - rec.start


def _probe(target: Target, workload: Workload, timing: str, full: bool = False) -> RequestRecord:
    spec = LoadSpec(target.url, target.model, workload, concurrency=1, token_timing=timing)
    prompt: PromptT = list(range(200, 208))
    n_out = 8
    if full:
        prompt, n_out = _probe_prompt(workload)

    async def probe() -> RequestRecord:
        rec = RequestRecord(start=time.monotonic())
        async with httpx.AsyncClient(base_url=target.url, timeout=300.0, headers=target.headers) as client:
            await send_one(client, spec, prompt, n_out, rec)
        return rec

    return asyncio.run(probe())


def _probe_prompt(workload: Workload) -> tuple[PromptT, int]:
    if workload.dataset:
        prompt, n_out = workload.dataset[0]
        return prompt, n_out or workload.output_len
    ids = [
        workload.vocab_low + i % (workload.vocab_high - workload.vocab_low) for i in range(workload.input_len)
    ]
    return ids, workload.output_len


def mean_output_len(workload: Workload) -> float:
    if workload.dataset:
        return statistics.fmean(n or workload.output_len for _, n in workload.dataset)
    return float(workload.output_len)


def measure_level(
    args: argparse.Namespace,
    target: Target,
    workload: Workload,
    x: float,
    rate_mode: bool,
    timing: str,
    lifetime_hint_s: float,
) -> dict[str, object]:
    """lifetime_hint_s: the expected life of a request at this level (steady.next_lifetime), for the
    ramp; the window is sized from the lifetime measured during the warm-up."""
    clients = int(x) if not rate_mode else 0
    ramp_s = 0.0 if rate_mode else steady.ramp_seconds(lifetime_hint_s, args.warmup_s / 2)
    spec = LoadSpec(
        url=target.url,
        model=target.model,
        workload=workload,
        concurrency=args.max_concurrency if rate_mode else clients,
        request_rate=x if rate_mode else None,
        arrival=args.arrival,
        burstiness=args.burstiness,
        token_timing=timing,
        api_key=target.api_key,
        level=f"{x:g}",
        ramp_s=ramp_s,
    )
    processes = args.client_processes or auto_processes(spec, os.cpu_count() or 2)
    out_len = mean_output_len(workload)

    async def controller(control: Control) -> dict[str, object]:
        t0 = control.start_time()
        history: list[tuple[float, float]] = []  # (time, output tokens) during the warm-up
        first_done: float | None = None
        # The server's gauges during the warm-up too, for the timeline only (how a level settled).
        warm_snaps: list[Snapshot] = []
        scrapes = None
        if target.has_metrics:
            client = httpx.AsyncClient(timeout=30.0, headers=target.headers)
            until = t0 + args.warmup_s
            scrapes = asyncio.ensure_future(
                poll(client, target.url, until, args.metrics_interval_s, warm_snaps)
            )
        while True:  # the warm-up
            now = time.monotonic()
            out, _, done = control.totals()
            history.append((now, out))
            if done and first_done is None:
                first_done = now
            if now >= t0 + args.warmup_s:
                log.warning("level %g: the warm-up hit its cap of %.0f s", x, args.warmup_s)
                break
            if rate_mode:
                if first_done is not None and now - t0 >= 2 * (first_done - t0):
                    break
            elif steady.warmed_up(now, t0 + ramp_s, done, clients):
                break
            await asyncio.sleep(POLL_S)
        if scrapes is not None:
            scrapes.cancel()  # what it scraped stays in warm_snaps; a failed scrape only shortens it
            await asyncio.gather(scrapes, return_exceptions=True)
            await client.aclose()
        if rate_mode:
            lifetime = (first_done or time.monotonic()) - t0
        else:
            lifetime = steady.lifetime_from_rate(clients, out_len, _recent_rate(history))
        attempts = []
        for attempt in range(1, steady.MAX_WINDOWS + 1):
            length = steady.window_seconds(lifetime, args.window_s, args.max_window_s, args.window_lifetimes)
            attempts.append(await _window(control, target, args, length, clients))
            if attempts[-1]["live"].steady:
                break
            log.info("level %g, window %d not steady (%s)", x, attempt, attempts[-1]["live"].reason)
        control.set_stop(attempts[-1]["w1"] + STOP_GRACE_S)
        return {
            "t0": t0,
            "warmup_s": attempts[0]["w0"] - t0,
            "lifetime_s": lifetime,
            "windows": len(attempts),
            "timeline_snaps": warm_snaps + [snap for a in attempts for snap in a["snaps"]],
            **attempts[-1],
        }

    records, res = run_async(run_load(spec, processes, controller))
    w0, w1 = float(res["w0"]), float(res["w1"])
    drain(target)
    row: dict[str, object] = {
        "x": x,
        "concurrency": spec.concurrency,
        "request_rate": spec.request_rate,
        "ramp_s": round(ramp_s, 2),
        "warmup_s": round(float(res["warmup_s"]), 2),
        # when the measured window began: after the warm-up and any window judged unsteady before it
        "window_start_s": round(w0 - float(res["t0"]), 2),
        "lifetime_s": None if res["lifetime_s"] is None else round(float(res["lifetime_s"]), 2),
        "window_s": round(w1 - w0, 2),
        "windows": res["windows"],
        "client_processes": processes,
        "client_lag_ms": res["lag_ms"],  # the load generator's loop lag in the window: did it keep up?
    }
    row.update(window_stats(records, w0, w1))
    row["steady"] = judge_window(records, w0, w1, x if rate_mode else None, max(clients, 1)).to_dict()
    snaps: list[Snapshot] = res["snaps"]  # type: ignore[assignment]
    row["server_metrics"] = bool(snaps)
    if snaps:
        row.update(summarize(snaps).to_dict())
    # From the level's start, so how a band of clients formed shows in the ramp and warm-up (and in a
    # first window found unsteady); the bins are laid from the measured window's start backwards, so
    # that window is bins window_from_bin onwards.
    k = math.ceil((w0 - float(res["t0"])) / TIMELINE_BIN_S)
    timeline_snaps: list[Snapshot] = res["timeline_snaps"]  # type: ignore[assignment]
    row["timeline"] = {
        "window_from_bin": k,
        **window_timeline(records, timeline_snaps, w0 - k * TIMELINE_BIN_S, w1),
    }
    row["gpu"] = res["clocks"]
    return row


def _recent_rate(history: list[tuple[float, float]]) -> float:
    """Output tokens/s over the last quarter of the warm-up (at least its last second)."""
    if len(history) < 2:
        return 0.0
    t_end, n_end = history[-1]
    span = max((t_end - history[0][0]) / 4, 1.0)
    t_start, n_start = next(((t, n) for t, n in history if t >= t_end - span), history[0])
    return (n_end - n_start) / (t_end - t_start) if t_end > t_start else 0.0


async def _window(
    control: Control, target: Target, args: argparse.Namespace, length: float, clients: int
) -> dict:
    """One measured window: progress counters at each sub-window's edge (the live verdict), /metrics
    scrapes and GPU clocks throughout."""
    control.take_lag()  # the client's loop lag counts from the window's start
    w0 = time.monotonic()
    w1 = w0 + length
    edges = steady.sub_windows(w0, w1)
    counts = [control.totals()]
    with ClockSampler(enabled=target.local) as clocks:
        scrapes = None
        if target.has_metrics:
            client = httpx.AsyncClient(timeout=30.0, headers=target.headers)
            scrapes = asyncio.ensure_future(poll(client, target.url, w1, args.metrics_interval_s))
        try:
            for _, edge in edges:
                await asyncio.sleep(max(edge - time.monotonic(), 0.0))
                counts.append(control.totals())
            snaps = await scrapes if scrapes is not None else []
        finally:
            if scrapes is not None:
                scrapes.cancel()
                await client.aclose()
    lag_mean, lag_max = control.take_lag()
    outs = [b[0] - a[0] for a, b in zip(counts, counts[1:], strict=False)]
    prompt = counts[-1][1] - counts[0][1]
    expected = None  # the workload's ratio is judged from the records afterwards; live, use the ideal
    if args.input_len and args.output_len and not args.dataset:
        expected = (args.input_len + args.output_len) / args.output_len
    live = steady.judge(outs, length / len(edges), prompt, expected, args.input_len, max(clients, 1))
    lag_ms = {"mean": _ms(lag_mean), "max": _ms(lag_max)}
    return {
        "w0": w0,
        "w1": w1,
        "snaps": snaps,
        "clocks": clocks.samples.summary(),
        "live": live,
        "lag_ms": lag_ms,
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 2)


def drain(target: Target, timeout_s: float = 120.0) -> None:
    """Wait until the server has let go of the cut requests, so the next level starts from empty."""
    if not target.has_metrics:
        time.sleep(DRAIN_WITHOUT_METRICS_S)
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        snap = scrape_sync(target.url, headers=target.headers)
        if snap.running == 0 and snap.waiting == 0:
            return
        time.sleep(0.2)
    log.warning(
        "the server still holds requests %.0f s after the load stopped (other clients?): going on", timeout_s
    )


# -- what a window measured -------------------------------------------------------------------------


def percentiles(
    xs: list[float], qs: tuple[int, ...] = (50, 90, 99), scale: float = 1000.0
) -> dict[str, float | None]:
    """Linear-interpolated percentiles, times `scale` (seconds to ms by default); None when empty."""
    if not xs:
        return {f"p{q}": None for q in qs}
    v = sorted(xs)
    out = {}
    for q in qs:
        pos = (len(v) - 1) * q / 100
        lo = int(pos)
        hi = min(lo + 1, len(v) - 1)
        out[f"p{q}"] = round((v[lo] + (v[hi] - v[lo]) * (pos - lo)) * scale, 2)
    return out


def window_stats(records: list[RequestRecord], w0: float, w1: float) -> dict[str, object]:
    """Rates and latencies of what happened inside [w0, w1): tokens by their arrival, requests by
    their finish, TTFT by the first token, ITL by the later token of each gap."""
    span = w1 - w0
    out_tokens = prompt_tokens = finished = errors = 0
    ttft: list[float] = []
    tpot: list[float] = []
    itl: list[float] = []
    for r in records:
        times = r.chunk_times
        for i, (t, n) in enumerate(zip(times, r.chunk_tokens, strict=True)):
            if w0 <= t < w1:
                out_tokens += n
                if i:
                    itl.append(t - times[i - 1])
        if times and w0 <= times[0] < w1:
            ttft.append(times[0] - r.start)
            prompt_tokens += r.prompt_tokens  # the prefill finished in the window
        if r.error is not None and w0 <= r.start < w1:
            errors += 1
        if r.end is not None and r.error is None and w0 <= r.end < w1:
            finished += 1
            if r.output_tokens > 1 and times:
                tpot.append((r.end - times[0]) / (r.output_tokens - 1))
    return {
        "output_tok_s": round(out_tokens / span, 2),
        "total_tok_s": round((out_tokens + prompt_tokens) / span, 2),
        "requests_s": round(finished / span, 3),
        "completed": finished,
        "errors": errors,
        "output_tokens": out_tokens,
        "ttft_ms": percentiles(ttft),
        "tpot_ms": percentiles(tpot),
        "itl_ms": percentiles(itl),
    }


def window_timeline(
    records: list[RequestRecord], snaps: list[Snapshot], w0: float, w1: float, bin_s: float = TIMELINE_BIN_S
) -> dict[str, object]:
    """[w0, w1) in bins of bin_s: output tokens, requests sent, first tokens (admissions, seen from
    the client), requests finished, and the server's running / waiting gauges (the bin's last scrape;
    None where a bin had none: the gauges are scraped during the window only). A level found unsteady
    shows here how: clients moving in waves finish in bursts one request life apart; a stall shows as
    bins with no tokens at all."""
    n = max(int(math.ceil((w1 - w0) / bin_s - 1e-9)), 1)

    def slot(t: float) -> int | None:
        return int((t - w0) / bin_s) if w0 <= t < w1 else None

    series: dict[str, list] = {k: [0] * n for k in ("output_tokens", "sent", "first_tokens", "finished")}
    for r in records:
        if (i := slot(r.start)) is not None:
            series["sent"][i] += 1
        if r.end is not None and r.error is None and (i := slot(r.end)) is not None:
            series["finished"][i] += 1
        for j, (t, tokens) in enumerate(zip(r.chunk_times, r.chunk_tokens, strict=True)):
            if (i := slot(t)) is not None:
                series["output_tokens"][i] += tokens
                series["first_tokens"][i] += j == 0
    running: list[float | None] = [None] * n
    waiting: list[float | None] = [None] * n
    for snap in snaps:
        if (i := slot(snap.t)) is not None:
            running[i], waiting[i] = snap.running, snap.waiting
    return {"bin_s": bin_s, **series, "running": running, "waiting": waiting}


def judge_window(
    records: list[RequestRecord], w0: float, w1: float, rate: float | None = None, clients: int = 1
) -> steady.Steadiness:
    """The steady-state verdict from the records: output tokens per sub-window, prompt tokens credited
    in the window (as total_tok_s counts them) against the ratio the window's finished requests ran at
    (the workers' shortened first requests left out: at 512 and 1,024 clients on the H200 they still
    finish inside the window and raised the expected 3.00 of 512 in / 256 out to 3.11-3.14).
    rate: an open loop's arrival rate, which a steady server keeps up with; clients: a closed loop's
    (a step delivers a token to each)."""
    edges = steady.sub_windows(w0, w1)
    sub_out = [0.0] * len(edges)
    span = (w1 - w0) / len(edges)
    prompt = 0.0
    finished: list[RequestRecord] = []
    for r in records:
        for t, n in zip(r.chunk_times, r.chunk_tokens, strict=True):
            if w0 <= t < w1:
                sub_out[min(int((t - w0) / span), len(edges) - 1)] += n
        if r.chunk_times and w0 <= r.chunk_times[0] < w1:
            prompt += r.prompt_tokens
        if r.end is not None and r.error is None and w0 <= r.end < w1:
            finished.append(r)
    # The workload's own requests, unless only first ones finished (a window shorter than a lifetime).
    own = [r for r in finished if not r.shortened] or finished
    done_prompt = sum(r.prompt_tokens for r in own)
    done_out = sum(r.output_tokens for r in own)
    expected = (done_prompt + done_out) / done_out if done_out else None
    mean_prompt = done_prompt / len(own) if own else 0.0
    verdict = steady.judge(sub_out, span, prompt, expected, mean_prompt, clients)
    if rate is not None:
        verdict = steady.keeps_up(verdict, len(finished) / (w1 - w0), rate, w1 - w0)
    return verdict
