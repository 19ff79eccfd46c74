"""`overnight check --url URL`: which limit holds the batch, and what to change.

Reads the server's /metrics over a window and applies the operator's rules, first match first:

    idle          nothing ran                               send load, then check again
    kv_pool       KV usage near 1 (or full with preemptions,  FP8 KV cache, or a shorter max_model_len
                  or admission holding requests back to
                  keep room for the running ones' growth)
                  with requests waiting
    max_num_seqs  running at max_num_seqs, cache free,      raise max_num_seqs
                  requests waiting
    preemptions   preemptions rose in the window            the pool is too small for max_num_seqs:
                                                            lower it, or give the pool more memory
    light_load    nothing waits                             the load is too small to fill the engine
    token_budget  requests wait with seats and cache free   admission is paced by the per-step token
                                                            budget: raise max_num_batched_tokens

The same rules give batch jobs a periodic line in their log (start_check_log).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import threading
import time
import weakref
from dataclasses import asdict, dataclass

from overnight.bench.knee import KV_FULL, MIN_WAITING, at_ceiling
from overnight.bench.metrics_reader import WindowMetrics

log = logging.getLogger("overnight")

# Planned admission holding requests back in this share of a window's steps makes the pool the limit.
PLAN_DEFERRED_SHARE = 0.25


@dataclass(frozen=True)
class Finding:
    limit: str  # idle | kv_pool | max_num_seqs | preemptions | light_load | token_budget
    summary: str  # what the window showed
    advice: str  # what to change


def diagnose(m: WindowMetrics) -> list[Finding]:
    """Every rule that holds, the one that holds the batch first."""
    seats = m.max_num_seqs
    # Preemption happens only when a running request finds no free block: the pool ran out even if
    # evictions keep the mean usage down (a thrashing pool frees and refills its blocks).
    kv_full = m.mean_kv_usage >= KV_FULL or (m.preemptions > 0 and m.max_kv_usage >= KV_FULL)
    # Planned admission (engine/admission.py) keeps the room the running requests will grow into: the
    # pool holds the batch back while its usage is still low, in every step it defers a request.
    deferred = m.kv_deferrals or 0.0
    kv_planned_full = deferred > 0 and (m.steps is None or deferred >= PLAN_DEFERRED_SHARE * m.steps)
    kv_full = kv_full or kv_planned_full
    queued = m.mean_waiting >= MIN_WAITING
    at_seats = seats is not None and at_ceiling(m.mean_running, seats)
    out: list[Finding] = []
    if m.mean_running < 0.5 and not queued:
        return [Finding("idle", "no request ran during the window", "send load, then check again")]
    if kv_full and queued:
        out.append(
            Finding(
                "kv_pool",
                f"the KV cache is {m.mean_kv_usage:.0%} full on average (at most {m.max_kv_usage:.0%}, "
                f"{m.preemptions:.0f} preemptions{held_back(m)}) while {m.mean_waiting:.1f} requests wait",
                "make room in the pool: --kv-cache-dtype fp8 (half the bytes per token), a shorter "
                "--max-model-len, or more memory for it (--gpu-memory-utilization)",
            )
        )
    if queued and not kv_full and (at_seats or seats is None):
        ceiling = (
            f"max_num_seqs ({seats})" if seats is not None else "its ceiling (max_num_seqs, not exposed)"
        )
        out.append(
            Finding(
                "max_num_seqs",
                f"running sits at {ceiling} with {1 - m.mean_kv_usage:.0%} of the KV cache free while "
                f"{m.mean_waiting:.1f} requests wait",
                f"raise max_num_seqs, e.g. --max-num-seqs {suggest_max_num_seqs(m)}",
            )
        )
    if m.preemptions > 0:
        fit = max(int(m.mean_running * 0.9), 1)
        out.append(
            Finding(
                "preemptions",
                f"{m.preemptions:.0f} preemptions in {m.duration_s:.0f} s: requests are evicted and recomputed",
                f"the pool is too small for max_num_seqs: lower it to about {fit} (--max-num-seqs), or give the "
                "pool more memory (--kv-cache-dtype fp8, --gpu-memory-utilization)",
            )
        )
    if out:
        return out
    if not queued:
        of = f" of max_num_seqs {seats}" if seats is not None else ""
        return [
            Finding(
                "light_load",
                f"nothing waits: {m.mean_running:.1f} requests run{of}, KV cache {m.mean_kv_usage:.0%} full",
                "the load is too small to fill the engine: send more requests at once "
                "(more clients, or run-batch --max-in-flight)",
            )
        ]
    return [
        Finding(
            "token_budget",
            f"{m.mean_waiting:.1f} requests wait with seats and cache free ({m.mean_running:.1f} running, "
            f"KV {m.mean_kv_usage:.0%})",
            "admission is paced by the per-step token budget: raise --max-num-batched-tokens",
        )
    ]


def held_back(m: WindowMetrics) -> str:
    if not m.kv_deferrals:
        return ""
    of = f" of {m.steps:.0f}" if m.steps is not None else ""
    return f"; admission kept room for the running requests' growth in {m.kv_deferrals:.0f}{of} steps"


def suggest_max_num_seqs(m: WindowMetrics) -> int:
    """What the pool holds at today's sequence sizes (90% of it), but no more than the queue needs."""
    seats = m.max_num_seqs or max(int(round(m.mean_running)), 1)
    pool_fit = int(0.9 * m.mean_running / m.mean_kv_usage) if m.mean_kv_usage > 0 else 4 * seats
    return max(seats + 1, min(pool_fit, seats + math.ceil(m.mean_waiting)))


def describe(m: WindowMetrics) -> str:
    seats = f" / max_num_seqs {m.max_num_seqs}" if m.max_num_seqs is not None else ""
    rate = f", generation {m.generation_tok_s:.1f} tok/s" if m.generation_tok_s is not None else ""
    # A row cap computes fewer than the running requests in those steps (a whole int4 GEMM tile's rows)
    capped = f", {m.row_capped:.0f} decode steps at a row cap" if m.row_capped else ""
    return (
        f"running {m.mean_running:.1f}{seats}, waiting {m.mean_waiting:.1f}, KV usage "
        f"{m.mean_kv_usage:.0%} (max {m.max_kv_usage:.0%}), preemptions +{m.preemptions:.0f}{rate}{capped}"
    )


# -- the command --------------------------------------------------------------------------------------


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "check",
        help="which limit holds a running server's batch, and what to change",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--window-s", type=float, default=10.0, help="seconds of metrics to judge")
    p.add_argument("--interval-s", type=float, default=0.25, help="seconds between scrapes")
    p.add_argument("--api-key", default=None)
    p.add_argument("--json", action="store_true", help="print the window and findings as one JSON line")


def check_url(
    url: str, window_s: float, interval_s: float = 0.25, api_key: str | None = None
) -> tuple[WindowMetrics, list[Finding]]:
    import asyncio

    import httpx

    from overnight.bench.metrics_reader import poll, summarize
    from overnight.bench.reach import auth_headers, check_status, get, unreachable

    url = url.rstrip("/")
    get(url, "/metrics", api_key)  # a server that is down or wants a key: one line, before the window

    async def window() -> WindowMetrics:
        async with httpx.AsyncClient(timeout=30.0, headers=auth_headers(api_key)) as client:
            return summarize(await poll(client, url, time.monotonic() + window_s, interval_s))

    try:
        m = asyncio.run(window())
    except httpx.HTTPStatusError as e:
        check_status(url, "/metrics", e.response, api_key)
        raise
    except httpx.HTTPError as e:  # it went away during the window
        raise unreachable(url, e) from None
    return m, diagnose(m)


def run(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    m, findings = check_url(args.url, args.window_s, args.interval_s, args.api_key)
    if args.json:
        print(json.dumps({"window": m.to_dict(), "findings": [asdict(f) for f in findings]}))
        return 0
    print(f"{args.url}: {m.duration_s:.1f} s, {m.num_samples} samples")
    print(f"  {describe(m)}")
    first, rest = findings[0], findings[1:]
    print(f"holds the batch: {first.limit}: {first.summary}")
    print(f"change: {first.advice}")
    for f in rest:
        print(f"also: {f.limit}: {f.summary}; {f.advice}")
    return 0


# -- the periodic line of batch jobs ------------------------------------------------------------------


class CheckLog:
    """The rules over the scheduler's own numbers, one verdict line every interval_s. Fed either as an
    engine observer (every step), or by start_check_log's thread (samples, no work on the engine's
    hot path)."""

    def __init__(
        self,
        max_num_seqs: int | None,
        interval_s: float = 60.0,
        logger: logging.Logger | None = None,
        quiet: tuple[str, ...] = (),
    ) -> None:
        self.max_num_seqs = max_num_seqs
        self.interval_s = interval_s
        self.log = logger or log
        self.quiet = quiet  # verdicts (Finding.limit) not worth a line for this caller
        self.lines: list[str] = []  # what was logged, for tests and summaries
        self._reset(time.monotonic(), None)

    def _reset(self, now: float, preemptions: int | None) -> None:
        self._t0 = now
        self._n = 0
        self._running = self._waiting = self._kv = self._kv_max = 0.0
        self._waited = 0
        self._generated: int | None = None
        self._preempt0 = preemptions

    def on_step(self, scheduler, iteration) -> None:  # StatsObserver: (SchedulerStats, IterationStats)
        self.add(scheduler, iteration.num_generation_tokens)

    def add(self, stats, generated: int | None = None) -> None:
        """One sample of SchedulerStats (and the tokens generated since the last, when known)."""
        if self._preempt0 is None:
            self._preempt0 = stats.num_preemptions_total
        self._n += 1
        self._running += stats.num_running
        self._waiting += stats.num_waiting
        self._waited += stats.num_waiting > 0
        kv = stats.kv_cache_usage if math.isfinite(stats.kv_cache_usage) else 0.0
        self._kv += kv
        self._kv_max = max(self._kv_max, kv)
        if generated is not None:
            self._generated = (self._generated or 0) + generated
        now = time.monotonic()
        if now - self._t0 >= self.interval_s:
            m = self.window(now, stats.num_preemptions_total)
            first = diagnose(m)[0]
            if first.limit not in self.quiet:
                line = f"check: {describe(m)} -> {first.limit}: {first.advice}"
                self.lines.append(line)
                self.log.info(line)
            self._reset(now, stats.num_preemptions_total)

    def window(self, now: float, preemptions_total: int) -> WindowMetrics:
        n = max(self._n, 1)
        return WindowMetrics(
            duration_s=now - self._t0,
            num_samples=self._n,
            mean_running=self._running / n,
            mean_waiting=self._waiting / n,
            mean_kv_usage=self._kv / n,
            max_kv_usage=self._kv_max,
            waiting_fraction=self._waited / n,
            preemptions=preemptions_total - (self._preempt0 or 0),
            generation_tokens=self._generated,
            max_num_seqs=self.max_num_seqs,
        )


def start_check_log(
    engine, interval_s: float = 60.0, sample_s: float = 0.5, quiet: tuple[str, ...] = ()
) -> CheckLog:
    """Log a check line every interval_s while `engine` lives, from a daemon thread that samples
    engine.stats() every sample_s. Reading the stats is a few lengths and counters (atomic under the
    GIL), so the engine's step does no extra work; the thread holds the engine weakly and ends once
    the engine is gone. Verdicts named in `quiet` are not logged."""
    check = CheckLog(engine.config.scheduler.max_num_seqs, interval_s, quiet=quiet)
    ref = weakref.ref(engine)

    def sample() -> None:
        while True:
            time.sleep(sample_s)
            e = ref()
            if e is None:
                return
            check.add(e.stats())
            del e

    threading.Thread(target=sample, name="overnight-check", daemon=True).start()
    return check
