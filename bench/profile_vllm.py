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
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, ".")

from bench.kernel_categories import kernel_times, print_breakdown  # noqa: E402
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
    args = ap.parse_args()
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        print("set VLLM_ENABLE_V1_MULTIPROCESSING=0: the profiler only sees kernels of this process")
        return 2
    import torch
    from torch.profiler import ProfilerActivity, profile

    w = WORKLOADS[args.workload]
    extra = engine_extra(args)
    folder = preset_folder(args.model or w.model)
    llm = vllm_engine(folder, **extra)
    prompts, params = workload_inputs(w, model_arch(folder))
    llm.generate(prompts[:8], params[:8], use_tqdm=False)  # warm-up, as vllm_throughput.py
    torch.cuda.synchronize()
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


if __name__ == "__main__":
    sys.exit(main())
