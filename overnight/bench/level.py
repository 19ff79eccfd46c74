"""One level of a sweep: run the load, find the end of the warm-up, and read the measured window
(client-side rates and latencies, the server's /metrics, the GPU's clocks)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import time

import httpx

from overnight.bench.gpu_info import ClockSampler
from overnight.bench.load import (
    Control,
    LoadSpec,
    PromptT,
    RequestRecord,
    Workload,
    auto_processes,
    run_async,
    run_load,
    send_one,
)
from overnight.bench.metrics_reader import poll, scrape_sync, summarize

log = logging.getLogger("overnight.bench")

DEFAULT_VOCAB = 32000  # random ids below this are valid for any current model
STOP_GRACE_S = 0.25  # the load runs on a little past the window, so the last scrape still sees it


def workload_from_args(args: argparse.Namespace, info: dict) -> Workload:
    dataset = load_dataset(args.dataset) if args.dataset else None
    vocab = args.vocab_size
    if vocab is None and not args.url:
        from overnight.loader.resolve import resolve_source  # reads the config only, no weights

        vocab = resolve_source(args.model, args.load_format).arch.vocab_size
    vocab = vocab or DEFAULT_VOCAB
    limit = info.get("max_model_len")
    if dataset is None and limit and args.input_len + args.output_len > int(limit):
        raise SystemExit(
            f"--input-len {args.input_len} + --output-len {args.output_len} exceeds the "
            f"server's max_model_len {limit}"
        )
    return Workload(
        input_len=args.input_len,
        output_len=args.output_len,
        seed=args.seed,
        vocab_high=max(vocab - 1000, 200),  # clear of the added tokens at the end of the vocabulary
        dataset=dataset,
    )


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


def probe_token_timing(url: str, model: str, workload: Workload, api_key: str | None) -> str:
    """'text' when the server's chunks carry text token by token, else 'logprobs' (a server without a
    tokenizer streams no text, so only logprobs show when each token arrived)."""
    spec = LoadSpec(url, model, workload, concurrency=1, api_key=api_key)

    async def probe() -> RequestRecord:
        rec = RequestRecord(start=time.monotonic())
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        async with httpx.AsyncClient(base_url=url, timeout=300.0, headers=headers) as client:
            await send_one(client, spec, list(range(200, 208)), 8, rec)
        return rec

    rec = asyncio.run(probe())
    if rec.error:
        raise RuntimeError(f"the server refused a probe request: {rec.error}")
    assert rec.end is not None
    shown = sum(n for t, n in zip(rec.chunk_times, rec.chunk_tokens, strict=True) if t < rec.end)
    return "text" if shown >= 4 else "logprobs"


def measure_level(
    args: argparse.Namespace, url: str, model: str, workload: Workload, x: float, rate_mode: bool, timing: str
) -> dict[str, object]:
    spec = LoadSpec(
        url=url,
        model=model,
        workload=workload,
        concurrency=args.max_concurrency if rate_mode else int(x),
        request_rate=x if rate_mode else None,
        arrival=args.arrival,
        burstiness=args.burstiness,
        token_timing=timing,
        api_key=args.api_key,
        level=f"{x:g}",
    )
    processes = args.client_processes or auto_processes(spec, os.cpu_count() or 2)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None

    async def controller(control: Control) -> tuple[float, float, list, dict]:
        t0 = control.start_time()
        # Closed loop: warm until every worker has finished one request (its first answers are of
        # spread lengths, so by then the loop runs in its steady mix); never longer than --warmup-s.
        expected = spec.concurrency if not rate_mode else None
        while time.monotonic() < t0 + args.warmup_s:
            if expected is not None and control.num_first_done() >= expected:
                break
            await asyncio.sleep(0.02)
        w0 = time.monotonic()
        w1 = w0 + args.window_s
        control.set_stop(w1 + STOP_GRACE_S)
        with ClockSampler() as clocks:
            async with httpx.AsyncClient(timeout=30.0, headers=headers) as client:
                snaps = await poll(client, url, w1, args.metrics_interval_s)
        return w0 - t0, w1, snaps, clocks.samples.summary()

    records, (warmup, w1, snaps, clocks) = run_async(run_load(spec, processes, controller))
    w0 = w1 - args.window_s
    drain(url, headers)
    row: dict[str, object] = {
        "x": x,
        "concurrency": spec.concurrency,
        "request_rate": spec.request_rate,
        "warmup_s": round(warmup, 2),
        "window_s": args.window_s,
        "client_processes": processes,
    }
    row.update(window_stats(records, w0, w1))
    row.update(summarize(snaps).to_dict())
    row["gpu"] = clocks
    return row


def drain(url: str, headers: dict[str, str] | None, timeout_s: float = 120.0) -> None:
    """Wait until the server has let go of the cut requests, so the next level starts from empty."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        snap = scrape_sync(url, headers=headers)
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
