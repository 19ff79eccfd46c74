"""vLLM 0.26's GPU time by kernel category over a whole workload, to set beside ours (issue 15: a per-step
breakdown of both engines on the same workload says where a gap is). Run in the device call that unpacked
vLLM (../shared/bench/vllm/: side_by_side.sh leaves it in $HOME/vsite), then ours on the same workload:

    VLLM_ENABLE_V1_MULTIPROCESSING=0 PYTHONPATH=$HOME/vsite/a:$HOME/vsite/b:. \\
        python bench/profile_vllm.py .peer/c2/configs long-1024-1024 [--kv-cache-dtype fp8] [--quantization fp8]
    PYTHONPATH=. python bench/profile_gpu.py --workload long-1024-1024 --whole-run [--kv-cache-dtype fp8]

vLLM as bench/vllm_bench.py runs it (LLM.generate, dummy weights, no tokenizer, defaults otherwise), with
its engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so torch.profiler sees its kernels,
CUDA-graph replays included. After the same 8-request warm-up, the whole timed generate is profiled
(kernels only); the categories are bench/kernel_categories.py's, shared with profile_gpu.py. Wall time
under the profiler is longer than an unprofiled run: compare the categories' GPU time, not the wall.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, ".")

from bench.kernel_categories import kernel_times, print_breakdown  # noqa: E402
from overnight.bench.workloads import WORKLOADS  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("configs", help="the folder of model config folders (.peer/c2/configs)")
    ap.add_argument("workload", choices=sorted(WORKLOADS))
    ap.add_argument("--model", default=None, help="a config folder name other than the workload's model")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--quantization", default=None, choices=["fp8"])
    args = ap.parse_args()
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        print("set VLLM_ENABLE_V1_MULTIPROCESSING=0: the profiler only sees kernels of this process")
        return 2
    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import LLM, SamplingParams  # type: ignore[import-not-found]

    w = WORKLOADS[args.workload]
    extra: dict[str, object] = {}
    if args.kv_cache_dtype != "auto":
        extra["kv_cache_dtype"] = args.kv_cache_dtype
    if args.quantization:
        extra["quantization"] = args.quantization
    folder = os.path.join(args.configs, args.model or w.model)
    with open(os.path.join(folder, "config.json")) as f:
        vocab_size = json.load(f)["vocab_size"]  # the ids are drawn as bench/vllm_bench.py draws them
    llm = LLM(
        model=folder,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        seed=0,
        max_model_len=4096,
        **extra,
    )
    reqs = w.requests(vocab_size)
    prompts = [{"prompt_token_ids": ids} for ids, _ in reqs]
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False) for _, n in reqs
    ]
    llm.generate(prompts[:8], params[:8], use_tqdm=False)  # warm-up, as vllm_bench.py
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
