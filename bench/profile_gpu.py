"""Per-step profile on the GPU: where the time of a workload's steps goes (GEMMs, attention, small ops,
sampling, other kernels) and how long the host spends per step.

    PYTHONPATH=. python bench/profile_gpu.py --workload seed-512-256 [--steps 40]

Runs the workload for a warm-up, then records `--steps` engine steps with torch.profiler (CUDA kernels)
and prints GPU time by category, the step mix (prefill tokens, decodes) and the engine's host timings.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

sys.path.insert(0, ".")

from bench.kernel_categories import kernel_times, print_breakdown  # noqa: E402
from bench.step_timeline import (  # noqa: E402
    Mix,
    planned_mix,
    print_step_kinds,
    print_window,
    run_to_end,
    walls_by_plan,
    write_csv,
)
from overnight import LLM, SamplingParams  # noqa: E402
from overnight.bench.workloads import WORKLOADS, Workload  # noqa: E402
from overnight.engine.interfaces import StepTimings  # noqa: E402
from overnight.kernels.jit_watch import watch_compiles  # noqa: E402


def submit(llm: LLM, w: Workload) -> None:
    """Every request of the workload added to the engine, unrun; an image workload's pictures
    preprocessed first, as LLM.generate does (in the image processor's threads)."""
    prompts = w.prompts(llm.engine.config.model.arch)
    for i, (_, ids, mm) in enumerate(llm._prepare_all([p for p, _ in prompts])):
        params = SamplingParams(max_tokens=prompts[i][1], ignore_eos=True, temperature=0)
        llm.engine.add_request(f"r{i}", ids, params, multi_modal=mm)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="seed-512-256")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup-steps", type=int, default=30)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--quantization", default=None, choices=["fp8"])
    ap.add_argument("--model", default=None, help="another model on the workload's lengths (a preset)")
    ap.add_argument("--attention-variant", default="default")
    ap.add_argument(
        "--cprofile",
        action="store_true",
        help="after a warm-up generate, run --steps steps under cProfile (host Python, JIT compiles) instead",
    )
    ap.add_argument(
        "--host-table", type=int, default=0, help="also print the N host ops of most self CPU time"
    )
    ap.add_argument(
        "--whole-run",
        action="store_true",
        help="profile every step from the first to the last (no warm-up steps; compare with profile_vllm.py)",
    )
    ap.add_argument(
        "--timeline",
        default=None,
        metavar="CSV",
        help="run the whole workload without the profiler and write each step's mix and wall to CSV "
        "(the wall of a step is the call that waited for its tokens: launches run one step ahead)",
    )
    args = ap.parse_args()
    if args.whole_run or args.timeline:
        args.warmup_steps = 0
    w = WORKLOADS[args.workload]
    llm = LLM(
        args.model or w.model,
        load_format="dummy",
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        attention_variant=args.attention_variant,
    )
    engine = llm.engine
    if (
        args.whole_run or args.cprofile or args.timeline
    ):  # kernels compiled and the allocator warm before the profiled run, as profile_vllm.py does
        warm = w.warmup_prompts(engine.config.model.arch, 8)
        llm.generate(warm, SamplingParams(max_tokens=8, ignore_eos=True, temperature=0), use_tqdm=False)
    submit(llm, w)
    for _ in range(args.warmup_steps):
        engine.step()
    torch.cuda.synchronize()
    engine.timings = StepTimings()
    sched_tokens: list[Mix] = []
    orig_schedule = engine.scheduler.schedule

    def schedule():
        out = orig_schedule()
        sched_tokens.append(
            planned_mix(out.total_num_scheduled_tokens, out.num_scheduled_tokens, engine.scheduler.requests)
        )
        return out

    engine.scheduler.schedule = schedule
    if args.cprofile:
        return host_profile(engine, args.steps, sched_tokens)
    if args.timeline:
        return timeline(engine, sched_tokens, args.timeline)
    from torch.profiler import ProfilerActivity, profile

    step_wall: list[float] = []  # per step of a whole run, to split the wall by step kind
    start = time.perf_counter()
    # A whole run records kernels only: host events of ~1,000 steps would cost more than they tell.
    activities = [ProfilerActivity.CUDA] if args.whole_run else [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=activities) as prof:
        if args.whole_run:
            while engine.has_unfinished_requests():
                t0 = time.perf_counter()
                engine.step()
                step_wall.append(time.perf_counter() - t0)
        else:
            for _ in range(args.steps):
                engine.step()
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    by_cat, _top = kernel_times(prof)
    what = "the whole run" if args.whole_run else f"{args.steps} steps"
    print_breakdown(
        f"profile of {what} of {args.workload} (after {args.warmup_steps} warm-up steps)", wall, by_cat, _top
    )
    print_window(sched_tokens)
    if step_wall:
        # A step with more tokens than requests carries prefill; the rest are decode-only steps.
        kinds: dict[str, list[float]] = {"with prefill": [], "decode only": []}
        for mix, dt in zip(sched_tokens, step_wall):
            kinds["with prefill" if mix.tokens > mix.requests else "decode only"].append(dt)
        for kind, dts in kinds.items():
            print(
                f"{kind:>13}: {len(dts)} steps, {sum(dts):.2f} s wall, {1e3 * sum(dts) / max(len(dts), 1):.1f} ms/step"
            )
    print("host per step:", engine.timings.summary())
    mem = torch.cuda.memory_stats()
    # Allocation retries free cached blocks (cudaFree synchronizes the device) and stall the host.
    print(
        "allocator: retries",
        mem.get("num_alloc_retries"),
        "device allocs",
        mem.get("num_device_alloc"),
        "frees",
        mem.get("num_device_free"),
        "reserved GiB",
        round(mem.get("reserved_bytes.all.current", 0) / 2**30, 2),
    )
    if args.host_table and not args.whole_run:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.host_table))
    print(
        "PROFILE",
        json.dumps(
            {
                "workload": args.workload,
                "wall_ms": round(wall * 1e3, 1),
                "steps": len(sched_tokens),
                "gpu_ms": {k: round(v, 1) for k, v in by_cat.items()},
                "host": engine.timings.summary(),
            }
        ),
    )
    return 0


def timeline(engine, sched_tokens: list[Mix], path: str) -> int:
    """Every step's mix and wall, no profiler: where a whole run's time goes by kind of step."""
    walls, planned, wall = run_to_end(engine)
    rows = list(zip(sched_tokens, walls_by_plan(walls, planned, engine._async)))
    write_csv(path, rows)
    print(f"timeline: {len(rows)} steps, {wall:.2f} s wall; {path}")
    print_step_kinds(rows)
    print("host per step:", engine.timings.summary())
    return 0


def host_profile(engine, steps: int, sched_tokens: list[Mix]) -> int:
    """Each step's wall and the host's Python profile of `steps` steps (a JIT compile or a slow input
    build shows here; torch.profiler's host ops do not name them)."""
    import cProfile
    import pstats

    walls = []
    prof = cProfile.Profile()
    with watch_compiles() as compiled:
        for _ in range(steps):
            t0 = time.perf_counter()
            prof.enable()
            engine.step()
            prof.disable()
            walls.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    for c in compiled:
        print("JIT compile:", c[:400])
    for mix, dt in zip(sched_tokens, walls):
        print(f"step: {mix.tokens} tokens, {mix.requests} requests, {mix.context} context, {dt * 1e3:.1f} ms")
    stats = pstats.Stats(prof)
    stats.sort_stats("cumulative").print_stats(40)
    stats.sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
