"""vLLM's offline throughput on the same requests as `overnight bench throughput` (docs/performance.md).
    python bench/vllm_throughput.py --workload seed-512-256 [--kv-cache-dtype fp8] [--quantization fp8]
    python bench/vllm_throughput.py --workload seed-512-256 --model qwen3-30b-a3b
    python bench/vllm_throughput.py --workload seed-512-256 --lora-adapters 8     (the adapters ours uses)
    python bench/vllm_throughput.py --workload seed-512-256 --model qwen3-8b-awq  (Marlin, from the config)
Needs vLLM (0.26 for the published figures) in the environment, and this repository on PYTHONPATH (the
script puts "." there). vLLM runs with its defaults but for what makes the two runs the same work:
LLM(model=<a folder holding the preset's config.json>, load_format="dummy", dtype="bfloat16", seed=0,
max_model_len=4096, skip_tokenizer_init=True); the token ids, lengths and order of
overnight/bench/workloads.py; greedy, ignore_eos, max_tokens = each request's output length. After an
8-request warm-up, one LLM.generate over the whole workload is timed, the SM clock sampled during it.
Prints the rate, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, ".")

from overnight.bench.gpu_info import ClockSampler  # noqa: E402
from overnight.bench.workloads import WORKLOADS  # noqa: E402
from overnight.loader.resolve import PRESETS_DIR, preset_names  # noqa: E402


def preset_folder(name: str) -> str:
    """A model folder vLLM can read: a folder holding a config.json as it is, else a temporary one with the
    preset's config.json (overnight/loader/presets/)."""
    if os.path.isfile(os.path.join(name, "config.json")):
        return name
    if name not in preset_names():
        raise SystemExit(f"unknown preset {name!r}; known: {', '.join(preset_names())}")
    folder = tempfile.mkdtemp(prefix=f"vllm-{name}-")
    shutil.copy(os.path.join(PRESETS_DIR, f"{name}.json"), os.path.join(folder, "config.json"))
    return folder


def vocab_size(folder: str) -> int:
    from transformers import AutoConfig

    # the text model's vocabulary, with the config class's default where the file leaves it out
    return int(AutoConfig.from_pretrained(folder).get_text_config().vocab_size)


def vllm_engine(folder: str, **extra: object):
    """vLLM's LLM on dummy weights of the config in `folder`, its defaults otherwise. A vision-language
    checkpoint runs text-only (no image slots), as our side does on token-id prompts."""
    from vllm import LLM  # type: ignore[import-not-found]

    with open(os.path.join(folder, "config.json")) as f:
        archs = json.load(f).get("architectures") or []
    if any(a.endswith("ForConditionalGeneration") for a in archs):
        extra = {"limit_mm_per_prompt": {"image": 0, "video": 0}, **extra}
    return LLM(
        model=folder,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        seed=0,
        max_model_len=4096,
        **extra,
    )


def workload_inputs(workload: str, vocab: int):
    """(prompts, sampling params) of a workload, as vLLM takes them."""
    from vllm import SamplingParams  # type: ignore[import-not-found]

    reqs = WORKLOADS[workload].requests(vocab)
    prompts = [{"prompt_token_ids": ids} for ids, _ in reqs]
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False) for _, n in reqs
    ]
    return prompts, params


def engine_extra(args: argparse.Namespace) -> dict[str, object]:
    extra: dict[str, object] = {}
    if args.kv_cache_dtype != "auto":
        extra["kv_cache_dtype"] = args.kv_cache_dtype
    if args.quantization:
        extra["quantization"] = args.quantization
    if args.max_num_seqs:
        extra["max_num_seqs"] = args.max_num_seqs
    if args.max_num_batched_tokens:
        extra["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.lora_adapters:
        n = args.lora_adapters
        extra.update(enable_lora=True, max_loras=n, max_cpu_loras=n, max_lora_rank=args.lora_rank)
    return extra


def lora_requests(model: str, n: int, rank: int, folder: str) -> list[object]:
    """n random adapters on every projection, the very files `overnight bench throughput --lora-adapters`
    writes (overnight/bench/lora.py), as vLLM's LoRARequests."""
    from vllm.lora.request import LoRARequest  # type: ignore[import-not-found]

    from overnight.bench.lora import write_random_adapters
    from overnight.loader.resolve import resolve_source

    arch = resolve_source(model, "dummy").arch
    ours = write_random_adapters(arch, n, rank, folder)
    return [LoRARequest(a.lora_name, a.lora_int_id, a.lora_path) for a in ours]


def add_engine_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--workload", default="seed-512-256", choices=sorted(WORKLOADS))
    ap.add_argument("--model", default=None, help="a preset other than the workload's model")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    ap.add_argument("--quantization", default=None, choices=["fp8"])
    ap.add_argument("--max-num-seqs", type=int, default=None, help="vLLM's max_num_seqs (default: its own)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="vLLM's (default: its own)")
    ap.add_argument(
        "--lora-adapters", type=int, default=0, help="requests spread round-robin over N random LoRA adapters"
    )
    ap.add_argument("--lora-rank", type=int, default=16)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(ap)
    args = ap.parse_args()
    import torch

    folder = preset_folder(args.model or WORKLOADS[args.workload].model)
    extra = engine_extra(args)
    t0 = time.perf_counter()
    llm = vllm_engine(folder, **extra)
    init_s = time.perf_counter() - t0
    prompts, params = workload_inputs(args.workload, vocab_size(folder))
    loras = None
    if args.lora_adapters:
        adapters = lora_requests(
            args.model or WORKLOADS[args.workload].model,
            args.lora_adapters,
            args.lora_rank,
            tempfile.mkdtemp(prefix="vllm-lora-"),
        )
        loras = [adapters[i % len(adapters)] for i in range(len(prompts))]
    warm = loras[:8] if loras else None
    llm.generate(prompts[:8], params[:8], use_tqdm=False, lora_request=warm)  # warm-up
    torch.cuda.synchronize()
    with ClockSampler() as clocks:
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    clock = clocks.samples.summary()
    print(
        f"vLLM {args.workload}: {n_out} output tokens in {seconds:.2f} s = {n_out / seconds:,.0f} tok/s "
        f"(SM clock {clock['sm_clock_mhz_median']} / {clock['sm_clock_mhz_min']} MHz; start-up {init_s:.0f} s)"
    )
    record = {
        "bench": "vllm_throughput",
        "workload": args.workload,
        "model": args.model or WORKLOADS[args.workload].model,
        "extra": extra,
        "output_tok_s": round(n_out / seconds, 1),
        "seconds": round(seconds, 3),
        "init_s": round(init_s, 1),
        **clock,
    }
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
