"""A whole run's steps by kind, for bench/profile_gpu.py --timeline and bench/profile_vllm.py --timeline:
each step's mix (tokens scheduled, requests) and wall, no profiler, so both engines' runs split the same
way (decode-only steps by batch size, steps with prefill by their prompt tokens)."""

from __future__ import annotations

import time
from collections.abc import Callable

Row = tuple[tuple[int, int], float]  # ((tokens, requests), seconds) of one step


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


def step_kinds(rows: list[Row]) -> list[tuple[str, int, float, int]]:
    """((tokens, requests), seconds) a step -> (kind, steps, seconds, tokens past one a request) by
    kind, most seconds first. Decode-only steps (a token a request) by 64 requests; steps carrying
    prefill by powers of two of their extra tokens."""
    kinds: dict[str, list[tuple[int, float]]] = {}
    for (tok, nreq), dt in rows:
        if tok == nreq:
            lo = nreq // 64 * 64
            kind = f"decode {lo}-{lo + 63} requests"
        else:
            lo = 1 << (tok - nreq).bit_length() - 1
            kind = f"prefill {lo}-{2 * lo - 1} tokens"
        kinds.setdefault(kind, []).append((tok - nreq, dt))
    table = [(k, len(v), sum(dt for _, dt in v), sum(x for x, _ in v)) for k, v in kinds.items()]
    return sorted(table, key=lambda row: -row[2])


def write_csv(path: str, rows: list[Row]) -> None:
    with open(path, "w") as f:
        f.write("step,tokens,requests,wall_ms\n")
        for i, ((tok, nreq), dt) in enumerate(rows):
            f.write(f"{i},{tok},{nreq},{1e3 * dt:.3f}\n")


def print_step_kinds(rows: list[Row]) -> None:
    for kind, steps, secs, extra in step_kinds(rows):
        print(
            f"{kind:>24}: {steps:5d} steps, {secs:7.2f} s, {1e3 * secs / steps:6.1f} ms/step, "
            f"{extra} tokens past one a request"
        )
