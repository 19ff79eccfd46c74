"""A whole run's steps by kind, for bench/profile_gpu.py --timeline and bench/profile_vllm.py --timeline:
each step's mix (tokens scheduled, requests, tokens of context its attention reads) and wall, no
profiler, so both engines' runs split the same way (decode-only steps by batch size, steps with prefill
by their prompt tokens). The context is what a decode step's wall follows once the KV pool is full: at
equal requests, two engines' steps compare only at equal context."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple


class Mix(NamedTuple):
    """One planned step: tokens scheduled, requests, and the tokens of context their attention reads
    (each request's computed tokens once the step has run)."""

    tokens: int
    requests: int
    context: int = 0


Row = tuple[Mix, float]  # (mix, seconds) of one step


def planned_mix(total_tokens: int, scheduled: Iterable[str], requests: Mapping[str, object]) -> Mix:
    """A step's mix as a scheduler plans it. Both engines' schedulers count a request's scheduled tokens
    as computed when they plan the step (num_computed_tokens, already advanced), so the sum over the
    scheduled requests is the context the step attends."""
    ids = list(scheduled)
    context = sum(getattr(requests.get(r), "num_computed_tokens", 0) for r in ids)
    return Mix(total_tokens, len(ids), context)


def run_to_end(engine, planned: Callable[[], int] | None = None) -> tuple[list[float], list[int], float]:
    """Step an engine (ours or vLLM's: has_unfinished_requests(), step()) until its requests are done:
    (each step() call's wall, planned() after each call (the steps planned so far), the run's wall),
    the device drained at the end."""
    import torch

    walls, counts = [], []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t0)
        counts.append(planned() if planned else len(walls))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return walls, counts, time.perf_counter() - start


def walls_by_plan(walls: list[float], planned_after: list[int], launches_ahead: bool) -> list[float]:
    """Each planned step's wall. A call's wall goes to the step it waited for: the latest step planned
    by its end, except that a call which planned a step while another was in flight (launches_ahead:
    our CUDA runner, vLLM's async scheduling) waited for the one before. Ours plans one step a call;
    vLLM's calls may plan none. Returns one wall per planned step."""
    per_step = [0.0] * (planned_after[-1] if planned_after else 0)
    before = 0
    for wall, planned in zip(walls, planned_after):
        ahead = launches_ahead and planned > before
        target = planned - (2 if ahead else 1)
        if target >= 0:
            per_step[target] += wall
        before = planned
    return per_step


class Kind(NamedTuple):
    name: str
    steps: int
    seconds: float
    extra_tokens: int  # tokens past one a request (prefill), summed
    context: int  # tokens of context attended, summed


def step_kinds(rows: list[Row]) -> list[Kind]:
    """(mix, seconds) a step -> totals by kind, most seconds first. Decode-only steps (a token a request)
    by 64 requests; steps carrying prefill by powers of two of their extra tokens."""
    kinds: dict[str, list[Row]] = {}
    for mix, dt in rows:
        if mix.tokens == mix.requests:
            lo = mix.requests // 64 * 64
            kind = f"decode {lo}-{lo + 63} requests"
        else:
            lo = 1 << (mix.tokens - mix.requests).bit_length() - 1
            kind = f"prefill {lo}-{2 * lo - 1} tokens"
        kinds.setdefault(kind, []).append((mix, dt))
    table = [
        Kind(
            k,
            len(v),
            sum(dt for _, dt in v),
            sum(m.tokens - m.requests for m, _ in v),
            sum(m.context for m, _ in v),
        )
        for k, v in kinds.items()
    ]
    return sorted(table, key=lambda kind: -kind.seconds)


def write_csv(path: str, rows: list[Row]) -> None:
    with open(path, "w") as f:
        f.write("step,tokens,requests,context,wall_ms\n")
        for i, (mix, dt) in enumerate(rows):
            f.write(f"{i},{mix.tokens},{mix.requests},{mix.context},{1e3 * dt:.3f}\n")


def print_window(mixes: list[Mix]) -> None:
    """A profiled window's mean mix (both engines' --steps forms)."""
    n = max(len(mixes), 1)
    print(
        f"steps: {len(mixes)}, tokens/step {sum(m.tokens for m in mixes) / n:.0f}, "
        f"requests/step {sum(m.requests for m in mixes) / n:.0f}, "
        f"context/step {sum(m.context for m in mixes) / n:,.0f} tokens"
    )


def print_step_kinds(rows: list[Row]) -> None:
    for k in step_kinds(rows):
        print(
            f"{k.name:>24}: {k.steps:5d} steps, {k.seconds:7.2f} s, {1e3 * k.seconds / k.steps:6.1f} ms/step, "
            f"{k.context / k.steps:9,.0f} tokens of context a step, {k.extra_tokens} tokens past one a request"
        )
