"""vLLM's GPU time by kernel category over a whole workload, to set beside ours on the same workload
(docs/performance.md: where the time of each engine goes). Needs vLLM in the environment:
    VLLM_ENABLE_V1_MULTIPROCESSING=0 PYTHONPATH=. python bench/profile_vllm.py long-1024-1024 \
        [--kv-cache-dtype fp8] [--quantization fp8]
    PYTHONPATH=. python bench/profile_gpu.py --workload long-1024-1024 --whole-run [--kv-cache-dtype fp8]
vLLM as bench/vllm_throughput.py runs it (LLM.generate, dummy weights, no tokenizer, defaults otherwise),
with its engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so torch.profiler sees its
kernels, CUDA-graph replays included. After the same 8-request warm-up, the whole timed generate is
profiled (kernels only); the categories are bench/kernel_categories.py's, shared with profile_gpu.py.
Wall time under the profiler is longer than an unprofiled run: compare the categories' GPU time.

Two cheaper forms drive vLLM's engine step by step (LLMEngine.add_request, then step()):
    ... profile_vllm.py long-1024-1024 --warmup-steps 900 --steps 30   # a window, as profile_gpu.py's
    ... profile_vllm.py long-1024-1024 --timeline steps.csv             # every step's wall, no profiler
Each step's mix (tokens, requests, context attended) is read off vLLM's scheduler as it plans the step, and each step()
call's wall goes to the step it waited for (with async scheduling, the one planned before the call's
own: step_timeline.walls_by_plan).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

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
from bench.vllm_throughput import (  # noqa: E402
    engine_extra,
    model_arch,
    preset_folder,
    vllm_engine,
    workload_inputs,
)
from overnight.bench.workloads import WORKLOADS  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("workload", choices=sorted(WORKLOADS))
    ap.add_argument("--model", default=None, help="a preset other than the workload's model")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    ap.add_argument("--quantization", default=None, choices=["fp8"])
    ap.add_argument(
        "--steps",
        type=int,
        default=0,
        help="profile this many engine steps after --warmup-steps (profile_gpu.py's window) instead of the whole run",
    )
    ap.add_argument("--warmup-steps", type=int, default=0)
    ap.add_argument(
        "--cudagraph-mode",
        default=None,
        choices=["PIECEWISE", "NONE"],
        help="vLLM's CUDA-graph mode (default: its own, FULL_AND_PIECEWISE). Its FULL decode graphs gave "
        "kernel times that do not add up (docs/performance.md, session R); PIECEWISE leaves attention "
        "outside the graphs, at the price of its launches",
    )
    ap.add_argument(
        "--timeline",
        default=None,
        metavar="CSV",
        help="run the whole workload without the profiler and write each step's mix and wall to CSV "
        "(as profile_gpu.py --timeline: bench/step_timeline.py)",
    )
    args = ap.parse_args()
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        print("set VLLM_ENABLE_V1_MULTIPROCESSING=0: the profiler only sees kernels of this process")
        return 2
    import torch
    from torch.profiler import ProfilerActivity, profile

    w = WORKLOADS[args.workload]
    extra = profile_extra(args)
    folder = preset_folder(args.model or w.model)
    llm = vllm_engine(folder, **extra)
    prompts, params = workload_inputs(w, model_arch(folder))
    llm.generate(prompts[:8], params[:8], use_tqdm=False)  # warm-up, as vllm_throughput.py
    torch.cuda.synchronize()
    if args.timeline or args.steps:
        return by_step(llm, prompts, params, args)
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        outs = llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    by_cat, top = kernel_times(prof)
    print_breakdown(f"vLLM: the whole run of {args.workload} ({n_out} output tokens)", wall, by_cat, top)
    print(
        "PROFILE",
        json.dumps(
            {
                "engine": "vllm-0.26.0",
                "workload": args.workload,
                "extra": extra,
                "wall_ms": round(wall * 1e3, 1),
                "gpu_ms": {k: round(v, 1) for k, v in by_cat.items()},
            }
        ),
    )
    return 0


def profile_extra(args: argparse.Namespace) -> dict[str, object]:
    """vLLM's engine arguments: bench/vllm_throughput.py's, and the CUDA-graph mode when one is asked."""
    extra = engine_extra(args)
    if args.cudagraph_mode:
        extra["compilation_config"] = {"cudagraph_mode": args.cudagraph_mode}
    return extra


def by_step(llm, prompts, params, args) -> int:
    """The workload's requests added to vLLM's engine, then its steps driven one by one (what
    LLM.generate does inside): each step's mix read off its scheduler, and either a profile of the
    window --warmup-steps .. + --steps or, with --timeline, every step's wall with no profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    engine = llm.llm_engine
    mixes = record_schedules(engine)
    for i, (prompt, param) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, param)
    if args.timeline:
        walls, planned, wall = run_to_end(engine, planned=lambda: len(mixes))
        rows = list(zip(mixes, walls_by_plan(walls, planned, schedules_ahead(engine))))
        write_csv(args.timeline, rows)
        print(
            f"vLLM timeline: {len(walls)} steps ({len(mixes)} scheduled), {wall:.2f} s wall; {args.timeline}"
        )
        print_step_kinds(rows)
        return 0
    for _ in range(args.warmup_steps):
        engine.step()
    torch.cuda.synchronize()
    first = len(mixes)
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    window = mixes[first:]
    by_cat, top = kernel_times(prof)
    what = f"{args.steps} steps of {args.workload} after {args.warmup_steps}"
    print_breakdown(f"vLLM: {what}", wall, by_cat, top)
    if window:
        print_window(window)
    return 0


def schedules_ahead(engine) -> bool:
    """Whether vLLM plans step N + 1 before step N's tokens are back (its async scheduling): then a
    step() call's wait is the step planned before it."""
    config = getattr(engine, "vllm_config", None)
    return bool(getattr(getattr(config, "scheduler_config", None), "async_scheduling", False))


def record_schedules(engine) -> list[Mix]:
    """The mix of each step vLLM's scheduler plans (step_timeline.planned_mix: its scheduler advances
    num_computed_tokens when it plans, as ours does), appended as it plans them. Reaches its
    in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0: LLMEngine.engine_core is then an
    in-process client holding the EngineCore); if vLLM moved it, no mixes and a note."""
    mixes: list[Mix] = []
    try:
        scheduler = engine.engine_core.engine_core.scheduler
        plan = scheduler.schedule
    except AttributeError as e:
        print(f"no step mixes: vLLM's scheduler not found ({e})")
        return mixes

    def schedule(*a, **kw):
        out = plan(*a, **kw)
        if out.total_num_scheduled_tokens:
            mixes.append(
                planned_mix(out.total_num_scheduled_tokens, out.num_scheduled_tokens, scheduler.requests)
            )
        return out

    scheduler.schedule = schedule
    return mixes


if __name__ == "__main__":
    sys.exit(main())
