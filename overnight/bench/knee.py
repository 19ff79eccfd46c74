"""Where raising the concurrency stops paying: the stopping rule, the knee, and why growth stopped.

Pure functions over the levels measured so far, so the rules are tested on synthetic series. Only
levels measured in their steady state (steady.py) count: an unsteady level's figures depend on when
its window fell, so it is reported (Verdict.unsteady_x) and left out of every rule below.

    stop rule   after level k: output tok/s fell below level k-1's, or grew less than min_gain over
                the last two steps (T_k < (1 + min_gain) * T_{k-2})
    knee        the smallest level from which no larger level gains min_gain or more:
                T_i * (1 + min_gain) >= max(T_j for j > i)
    best        the level with the most output tok/s
    reason      read from the levels past the knee, first match wins:
                pool_full      KV usage near 1 (or preemptions) with requests waiting
                max_num_seqs   running at max_num_seqs with free cache
                client_bound   clients' requests neither running nor waiting on the server, and the
                               load generator's loop lagging: the client, not the server, held them
                front_end      the same gap with a client that kept up: the requests wait in the
                               server's front end (HTTP, tokenization, its queue to the engine)
                throttling     the SM clock dropped against the fastest level before
                compute_bound  none of these
                still_growing  no level past the knee (growth never stopped), unless the last level
                               shows one of the gaps above (more clients would only queue there)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

KV_FULL = 0.9  # KV usage from which the pool counts as full
SEATS_SLACK = 0.05  # running within 5% (or one request) of max_num_seqs counts as at the ceiling
MIN_WAITING = 0.5  # mean waiting requests from which requests count as queued
THROTTLE_DROP = 0.10  # SM clock drop against the best earlier level that counts as throttling
# A closed loop keeps every client's request in flight but for the moment between an answer and the next
# request, so the server should hold about as many, running or waiting. More than this share missing (and
# at least MIN_MISSING requests) counts as a gap. Healthy levels on the H200 miss 4-8% (at 64 clients, a
# request of 3 s; on the CPU 22% at 4 clients, hence the floor); the front end that held requests
# back missed 44-75% (vLLM 0.26's server at 512 and 1,024 clients).
MISSING_SHARE = 0.20
MIN_MISSING = 2.0
CLIENT_LAG_MS = 20.0  # the load generator's mean loop lag from which it counts as behind

REASONS = (
    "pool_full",
    "max_num_seqs",
    "client_bound",
    "front_end",
    "throttling",
    "compute_bound",
    "still_growing",
)


@dataclass(frozen=True)
class LevelPoint:
    """What the verdict needs of one measured level (None: not known, e.g. no GPU)."""

    x: float  # the concurrency, or the request rate of a fixed-rate run
    output_tok_s: float
    mean_kv_usage: float | None = None
    mean_waiting: float | None = None
    mean_running: float | None = None
    max_num_seqs: int | None = None
    sm_clock_mhz: float | None = None
    preemptions: float | None = None  # during the window
    power_w: float | None = None
    steady: bool = True  # measured in its steady state
    clients: int | None = None  # a closed loop's clients (None: a fixed-rate level)
    client_lag_ms: float | None = None  # the load generator's mean loop lag in the window


@dataclass(frozen=True)
class Verdict:
    best_x: float
    best_output_tok_s: float
    knee_x: float
    knee_output_tok_s: float
    stopped: str  # "fell" | "plateau" | "end" (the last level was reached)
    reason: str  # one of REASONS
    detail: str
    unsteady_x: list[float]  # levels left out: not in a steady state

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def at_ceiling(mean_running: float, max_num_seqs: int) -> bool:
    """Running sits at max_num_seqs: within 5% of it, or within one request, since each finish leaves
    a seat empty for a step (a large share of the time when there are few seats)."""
    return max_num_seqs - mean_running <= max(1.0, SEATS_SLACK * max_num_seqs)


def missing(p: LevelPoint) -> float | None:
    """Clients whose request the server held neither running nor waiting (None: not known)."""
    if not p.clients or p.mean_running is None or p.mean_waiting is None:
        return None
    gap = p.clients - p.mean_running - p.mean_waiting
    return gap if gap >= max(MIN_MISSING, MISSING_SHARE * p.clients) else None


def gap_reason(p: LevelPoint) -> tuple[str, str] | None:
    """client_bound or front_end at this level, with its detail; None where the server held them all."""
    gap = missing(p)
    if gap is None:
        return None
    held = f"at {_x(p.x)} clients the server ran {p.mean_running:.0f} and queued {p.mean_waiting:.0f}"
    if p.client_lag_ms is not None and p.client_lag_ms >= CLIENT_LAG_MS:
        return "client_bound", (
            f"{held}; the load generator's loop lagged {p.client_lag_ms:.0f} ms on average: it fell "
            "behind (--client-processes, or a machine of its own)"
        )
    if p.client_lag_ms is None:  # a sweep.json from before the lag was recorded
        return "front_end", (
            f"{held}: {gap:.0f} requests waited before its scheduler, in its front end (HTTP, "
            "tokenization, its queue to the engine) or in a client that fell behind (its loop lag was "
            "not recorded)"
        )
    return "front_end", (
        f"{held}; the client kept up (its loop lag {p.client_lag_ms:.1f} ms), so {gap:.0f} requests "
        "waited in the server's front end (HTTP, tokenization, its queue to the engine): more clients "
        "only wait there"
    )


def stop_reason(throughputs: list[float], min_gain: float) -> str | None:
    """'fell', 'plateau', or None to go on raising, judged on the levels measured so far."""
    t = throughputs
    if len(t) >= 2 and t[-1] < t[-2]:
        return "fell"
    if len(t) >= 3 and t[-1] < (1.0 + min_gain) * t[-3]:
        return "plateau"
    return None


def knee_index(throughputs: list[float], min_gain: float) -> int:
    best_after = float("-inf")
    knee = len(throughputs) - 1
    # Walk down from the top, keeping the most any larger level reached.
    for i in range(len(throughputs) - 1, -1, -1):
        if throughputs[i] * (1.0 + min_gain) >= best_after:
            knee = i
        best_after = max(best_after, throughputs[i])
    return knee


def best_index(throughputs: list[float]) -> int:
    return max(range(len(throughputs)), key=lambda i: throughputs[i])


def refine_between(a: float, b: float) -> int | None:
    """The level halfway between two measured concurrencies, or None when none lies between."""
    lo, hi = sorted((int(a), int(b)))
    mid = (lo + hi) // 2
    return mid if lo < mid < hi else None


def why_stopped(points: list[LevelPoint], knee: int) -> tuple[str, str]:
    """(reason, detail) from the levels past the knee, judged against the levels up to it."""
    past = points[knee + 1 :]
    if not past:
        if (gap := gap_reason(points[-1])) is not None:
            return gap
        return "still_growing", (
            f"output still grew at the last level ({_x(points[-1].x)}): measure higher levels"
        )
    for p in past:
        # Preemptions mean the pool ran out, even where evictions keep the mean usage down.
        full = (p.mean_kv_usage or 0.0) >= KV_FULL or (p.preemptions or 0) > 0
        if full and (p.mean_waiting or 0) >= MIN_WAITING:
            return "pool_full", (
                f"at {_x(p.x)} the KV pool is full (usage {p.mean_kv_usage or 0:.0%}, "
                f"{p.preemptions or 0:.0f} preemptions) with {p.mean_waiting:.1f} requests waiting: "
                "FP8 KV cache or a shorter max_model_len"
            )
    for p in past:
        if (
            p.max_num_seqs
            and p.mean_running is not None
            and at_ceiling(p.mean_running, p.max_num_seqs)
            and (p.mean_kv_usage is None or p.mean_kv_usage < KV_FULL)
        ):
            kv = f"{p.mean_kv_usage:.0%}" if p.mean_kv_usage is not None else "n/a"
            return "max_num_seqs", (
                f"at {_x(p.x)} running sits at max_num_seqs ({p.max_num_seqs}) with free cache "
                f"(usage {kv}): raise max_num_seqs"
            )
    for p in past:
        if (gap := gap_reason(p)) is not None:
            return gap
    clocks = [p.sm_clock_mhz for p in points[: knee + 1] if p.sm_clock_mhz is not None]
    if clocks:
        fastest = max(clocks)
        for p in past:
            if p.sm_clock_mhz is not None and p.sm_clock_mhz < (1.0 - THROTTLE_DROP) * fastest:
                power = f" at {p.power_w:.0f} W" if p.power_w is not None else ""
                return "throttling", (
                    f"at {_x(p.x)} the SM clock fell to {p.sm_clock_mhz:.0f} MHz{power} from {fastest:.0f} MHz: "
                    "the GPU throttles (power or heat)"
                )
    p = past[0]
    kv = f"{p.mean_kv_usage:.0%}" if p.mean_kv_usage is not None else "n/a"
    return "compute_bound", (
        f"past {_x(points[knee].x)} neither the pool (usage {kv}) nor max_num_seqs nor the clock limits: "
        "the device is busy; more concurrency only adds latency"
    )


def verdict(points: list[LevelPoint], min_gain: float, stopped: str | None = None) -> Verdict:
    """The verdict over the steady points, sorted by x (a refinement level comes in late). stopped:
    why the sweep stopped raising, when the caller knows; else the rule is replayed on the series."""
    unsteady = sorted(p.x for p in points if not p.steady)
    pts = sorted((p for p in points if p.steady), key=lambda p: p.x)
    if not pts:
        raise ValueError("no level measured in its steady state")
    t = [p.output_tok_s for p in pts]
    knee = knee_index(t, min_gain)
    best = best_index(t)
    reason, detail = why_stopped(pts, knee)
    if stopped is None:
        stopped = "end"
        for k in range(1, len(t) + 1):  # the rule as a sweep applies it, level by level
            s = stop_reason(t[:k], min_gain)
            if s is not None:
                stopped = s
                break
    return Verdict(
        best_x=pts[best].x,
        best_output_tok_s=t[best],
        knee_x=pts[knee].x,
        knee_output_tok_s=t[knee],
        stopped=stopped,
        reason=reason,
        detail=detail,
        unsteady_x=unsteady,
    )


def _x(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"
