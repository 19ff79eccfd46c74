"""Per-step profile on the GPU: where the time of a workload's steps goes (GEMMs, attention, small ops,
sampling, other kernels) and how long the host spends per step.

    PYTHONPATH=. python bench/profile_gpu.py --workload seed-512-256 [--steps 40]

Runs the workload for a warm-up, then records `--steps` engine steps with torch.profiler (CUDA kernels)
and prints GPU time by category, the step mix (prefill tokens, decodes) and the engine's host timings.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, ".")

from overnight import LLM, SamplingParams  # noqa: E402
from overnight.bench.workloads import WORKLOADS  # noqa: E402
from overnight.engine.interfaces import StepTimings  # noqa: E402

CATEGORIES = [
    ("moe gemm", re.compile(r"_moe_gemm", re.I)),  # the experts' grouped GEMMs (kernels/moe_gemm.py)
    ("moe routing", re.compile(r"_router_topk|_moe_align", re.I)),  # top-k and sort by expert
    ("attention", re.compile(r"_decode|_prefill|kv_write|flash|attn", re.I)),
    ("fp8 quant", re.compile(r"quantize", re.I)),
    ("gemm", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|matmul|sm90_", re.I)),
    ("norm/rope/silu", re.compile(r"rms|norm|rotary|rope|silu|_add_", re.I)),
    ("sampling", re.compile(r"argmax|max|softmax|topk|sort|gather|index", re.I)),
]


def category(name: str) -> str:
    for cat, rx in CATEGORIES:
        if rx.search(name):
            return cat
    return "other"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="seed-512-256")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup-steps", type=int, default=30)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--quantization", default=None, choices=["fp8"])
    ap.add_argument("--model", default=None, help="another model on the workload's lengths (a preset)")
    ap.add_argument("--attention-variant", default="default")
    args = ap.parse_args()
    w = WORKLOADS[args.workload]
    llm = LLM(
        args.model or w.model,
        load_format="dummy",
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        attention_variant=args.attention_variant,
    )
    engine = llm.engine
    reqs = w.requests(engine.config.model.arch.vocab_size)
    for i, (ids, n_out) in enumerate(reqs):
        engine.add_request(f"r{i}", ids, SamplingParams(max_tokens=n_out, ignore_eos=True, temperature=0))
    for _ in range(args.warmup_steps):
        engine.step()
    torch.cuda.synchronize()
    engine.timings = StepTimings()
    sched_tokens = []
    orig_schedule = engine.scheduler.schedule

    def schedule():
        out = orig_schedule()
        sched_tokens.append((out.total_num_scheduled_tokens, len(out.num_scheduled_tokens)))
        return out

    engine.scheduler.schedule = schedule
    from torch.profiler import ProfilerActivity, profile

    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    by_cat: dict[str, float] = defaultdict(float)
    top: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():
        t = getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0)
        if t <= 0 or evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        by_cat[category(evt.key)] += t / 1e3
        top[evt.key] += t / 1e3
    gpu_ms = sum(by_cat.values())
    print(f"\nprofile of {args.steps} steps of {args.workload} (after {args.warmup_steps} warm-up steps)")
    print(f"wall {wall * 1e3:.1f} ms, GPU kernel time {gpu_ms:.1f} ms ({gpu_ms / (wall * 1e3):.0%} busy)")
    for cat, ms in sorted(by_cat.items(), key=lambda kv: -kv[1]):
        print(f"  {cat:<16} {ms:9.1f} ms  {ms / gpu_ms:6.1%}")
    print("top kernels:")
    for name, ms in sorted(top.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {ms:9.1f} ms  {name[:90]}")
    tokens = sum(t for t, _ in sched_tokens)
    print(
        f"steps: {len(sched_tokens)}, tokens/step {tokens / max(len(sched_tokens), 1):.0f}, "
        f"requests/step {sum(r for _, r in sched_tokens) / max(len(sched_tokens), 1):.0f}"
    )
    print("host per step:", engine.timings.summary())
    print(
        "PROFILE",
        json.dumps(
            {
                "workload": args.workload,
                "wall_ms": round(wall * 1e3, 1),
                "gpu_ms": {k: round(v, 1) for k, v in by_cat.items()},
                "host": engine.timings.summary(),
            }
        ),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
