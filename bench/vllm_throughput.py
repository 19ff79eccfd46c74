"""vLLM's offline throughput on the same requests as `overnight bench throughput` (docs/performance.md).
    python bench/vllm_throughput.py --workload seed-512-256 [--kv-cache-dtype fp8] [--quantization fp8]
    python bench/vllm_throughput.py --workload seed-512-256 --model qwen3-30b-a3b
    python bench/vllm_throughput.py --workload seed-512-256,long-1024-1024   (one start-up, a line each)
    python bench/vllm_throughput.py --workload seed-512-256 --lora-adapters 8     (the adapters ours uses)
    python bench/vllm_throughput.py --workload seed-512-256 --model qwen3-8b-awq  (Marlin, from the config)
    python bench/vllm_throughput.py --workload caption-448 [--model qwen3-vl-8b]  (one image per request)
    python bench/vllm_throughput.py --workload long-1024-1024 --model qwen3-30b-a3b --dummy-weights overnight
Needs vLLM (0.26 for the published figures) in the environment, and this repository on PYTHONPATH (the
script puts "." there). vLLM runs with its defaults but for what makes the two runs the same work:
LLM(model=<a folder holding the preset's config.json>, load_format="dummy", dtype="bfloat16", seed=0,
max_model_len=4096, skip_tokenizer_init=True); the token ids, lengths and order of
overnight/bench/workloads.py; greedy, ignore_eos, max_tokens = each request's output length. After an
8-request warm-up, one LLM.generate over the whole workload is timed, the SM clock sampled during it.
Prints the rate, then one JSON line; its distinct_tokens (as in ours) counts the distinct tokens the
requests emitted at a few output positions: dummy weights are each engine's own random draw, and a
mixture of experts whose outputs collapse onto few tokens reads few experts a step (--dummy-weights
overnight draws vLLM's weights as ours are drawn).

An image workload (caption-448) gives vLLM the same prompt dicts as ours, {"prompt_token_ids": ids,
"multi_modal_data": {"image": PIL image}}, the same images. vLLM's multimodal processor needs the HF
processor and a tokenizer even for token-id prompts, so the preset's folder also gets the files of
overnight/bench/processor_folder.py (a tokenizer of the model's special tokens at their ids, the
published preprocessor_config.json), the tokenizer is loaded (skip_tokenizer_init=False; outputs stay
token ids: detokenize=False) and one image per prompt is allowed (limit_mm_per_prompt). Before the
timed run the script checks that AutoProcessor on that folder expands an image to as many pads as ours.

With images or LoRA adapters vLLM's engine core runs in the calling process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, unless set): in its own process it hung at start-up on the GPU
machine (main() says more). The JSON line's "engine_core" says which ran.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import replace

sys.path.insert(0, ".")

from overnight.bench.gpu_info import ClockSampler  # noqa: E402
from overnight.bench.workloads import WORKLOADS, Workload, output_spread  # noqa: E402
from overnight.loader.resolve import PRESETS_DIR, preset_names  # noqa: E402

LOG_TIME = "%m-%d %H:%M:%S"  # vLLM's log lines' time stamp


def preset_folder(name: str, images: bool = False) -> str:
    """A model folder vLLM can read: a folder holding a config.json as it is, else a temporary one with the
    preset's config.json (overnight/loader/presets/), plus, for images, the processor files."""
    if os.path.isfile(os.path.join(name, "config.json")):
        return name
    if name not in preset_names():
        raise SystemExit(f"unknown preset {name!r}; known: {', '.join(preset_names())}")
    folder = tempfile.mkdtemp(prefix=f"vllm-{name}-")
    shutil.copy(os.path.join(PRESETS_DIR, f"{name}.json"), os.path.join(folder, "config.json"))
    if images:
        from overnight.bench.processor_folder import write_processor_files

        write_processor_files(folder)
    return folder


def vocab_size(folder: str) -> int:
    from transformers import AutoConfig

    # the text model's vocabulary, with the config class's default where the file leaves it out
    return int(AutoConfig.from_pretrained(folder).get_text_config().vocab_size)


def vllm_engine(folder: str, images: bool = False, max_model_len: int = 4096, **extra: object):
    """vLLM's LLM on dummy weights of the config in `folder`, its defaults otherwise. A vision-language
    checkpoint runs text-only (no image slots), as our side does on token-id prompts, unless `images`:
    then one image per prompt, no video, and the folder's tokenizer (its multimodal processor needs one)."""
    from vllm import LLM  # type: ignore[import-not-found]

    with open(os.path.join(folder, "config.json")) as f:
        archs = json.load(f).get("architectures") or []
    if any(a.endswith("ForConditionalGeneration") for a in archs):
        extra = {"limit_mm_per_prompt": {"image": 1 if images else 0, "video": 0}, **extra}
    return LLM(
        model=folder,
        load_format="dummy",
        skip_tokenizer_init=not images,
        dtype="bfloat16",
        seed=0,
        max_model_len=max_model_len,
        **extra,
    )


def kv_pool_tokens(llm) -> int | None:
    """vLLM's KV pool in tokens (blocks x block size) where its engine exposes them, else None: the log's
    "GPU KV cache size" line says it too (a model with sliding windows counts per token of context)."""
    try:
        cache = llm.llm_engine.vllm_config.cache_config
        return int(cache.num_gpu_blocks) * int(cache.block_size)
    except (AttributeError, TypeError):
        return None


def model_arch(folder: str):
    """Our ModelArch of the config in `folder` (the vocabulary, the image token ids)."""
    from overnight.loader.resolve import resolve_source

    return resolve_source(folder, "dummy").arch


def workload_inputs(workload: Workload, arch):
    """(prompts, sampling params) of a workload, as vLLM takes them: the prompt dicts ours gets."""
    from vllm import SamplingParams  # type: ignore[import-not-found]

    reqs = workload.prompts(arch)
    prompts = [p for p, _ in reqs]
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False) for _, n in reqs
    ]
    return prompts, params


def require_torchvision() -> None:
    if importlib.util.find_spec("torchvision") is None:
        raise SystemExit("vLLM's Qwen-VL processor loads a torchvision video processor: install torchvision")


def check_expansion(folder: str, prompt: dict, arch) -> int:
    """The image tokens of `prompt`'s image with transformers' AutoProcessor on `folder` (what vLLM's
    processor calls), checked equal to ours (overnight/multimodal/processor.py); returns the count."""
    from transformers import AutoProcessor

    from overnight.multimodal.media import MediaPolicy
    from overnight.multimodal.processor import ImageProcessor

    image = prompt["multi_modal_data"]["image"]
    hf = AutoProcessor.from_pretrained(folder)
    out = hf(text=[hf.image_token], images=[image], return_tensors="pt")
    theirs = out["input_ids"][0].tolist().count(arch.vision.image_token_id)
    ours_proc = ImageProcessor(arch.vision, folder, MediaPolicy())
    try:
        ids, _ = ours_proc.process(prompt["prompt_token_ids"], [image])
    finally:
        ours_proc.close()
    ours = ids.count(arch.vision.image_token_id)
    if theirs != ours:
        raise SystemExit(f"AutoProcessor on {folder} expands an image to {theirs} tokens, ours to {ours}")
    return ours


def engine_extra(args: argparse.Namespace) -> dict[str, object]:
    extra: dict[str, object] = {}
    if args.kv_cache_dtype != "auto":
        extra["kv_cache_dtype"] = args.kv_cache_dtype
    if args.quantization:
        extra["quantization"] = args.quantization
    # (bench/profile_vllm.py's arguments have only the first two)
    if getattr(args, "max_num_seqs", None):
        extra["max_num_seqs"] = args.max_num_seqs
    if getattr(args, "max_num_batched_tokens", None):
        extra["max_num_batched_tokens"] = args.max_num_batched_tokens
    if getattr(args, "lora_adapters", 0):
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
    ap.add_argument(
        "--workload", default="seed-512-256", help="one workload, or several of one model: A,B (one start-up)"
    )
    ap.add_argument("--model", default=None, help="a preset other than the workload's model")
    ap.add_argument("--num-prompts", type=int, default=None, help="the workload's first N requests")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    ap.add_argument("--quantization", default=None, choices=["fp8"])
    ap.add_argument("--max-num-seqs", type=int, default=None, help="vLLM's max_num_seqs (default: its own)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="vLLM's (default: its own)")
    ap.add_argument(
        "--lora-adapters", type=int, default=0, help="requests spread round-robin over N random LoRA adapters"
    )
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument(
        "--dummy-weights",
        default="vllm",
        choices=["vllm", "overnight"],
        help="vLLM's own dummy draw, or ours (bench/vllm_dummy.py: norms 1, a seed a tensor), so that both "
        "engines' models emit and route alike (the JSON line's distinct_tokens says how they did)",
    )
    ap.add_argument(
        "--max-model-len",
        type=int,
        default=4096,
        help="vLLM's max_model_len; its log's KV cache size and maximum concurrency at this length are the "
        "pool figures to set beside `overnight budget --max-model-len N` (pairs_gpu.sh keeps those lines)",
    )


def workloads_of(arg: str, num_prompts: int | None) -> list[Workload]:
    """--workload A[,B...]: several workloads of one model run on one LLM, one start-up for all (a row of
    the table per workload, the start-up paid once: it is vLLM's largest fixed cost)."""
    names = arg.split(",")
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise SystemExit(f"unknown workload {', '.join(unknown)}; known: {', '.join(sorted(WORKLOADS))}")
    picked = [WORKLOADS[n] for n in names]
    if len(picked) > 1 and any(w.image_size is not None for w in picked):
        raise SystemExit("an image workload runs alone: one --workload")
    if num_prompts:
        picked = [replace(w, num_requests=num_prompts) for w in picked]
    return picked


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(ap)
    args = ap.parse_args()
    import torch

    workloads = workloads_of(args.workload, args.num_prompts)
    images = workloads[0].image_size is not None
    if images:
        require_torchvision()
    if (images or args.lora_adapters) and "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ:
        # vLLM's engine-core process, with images or LoRA adapters, never got past "Using V2 Model
        # Runner" in 270-300 s (an H100, 2026-12-06: twice with 8 adapters, once with images); in the
        # calling process the image run started in 64 s. An explicit setting is kept.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"
    if args.dummy_weights == "overnight":
        from bench.vllm_dummy import install

        install()  # a vLLM plugin, found by this process and the engine core's
    model = args.model or workloads[0].model
    folder = preset_folder(model, images)
    arch = model_arch(folder)
    extra = engine_extra(args)
    llm = None
    init_s = 0.0
    adapters = (
        lora_requests(model, args.lora_adapters, args.lora_rank, tempfile.mkdtemp(prefix="vllm-lora-"))
        if args.lora_adapters
        else []
    )
    for workload in workloads:
        prompts, params = workload_inputs(workload, arch)
        image_tokens = check_expansion(folder, prompts[0], arch) if images else 0
        if llm is None:
            t0 = time.perf_counter()
            llm = vllm_engine(folder, images, args.max_model_len, **extra)
            init_s = time.perf_counter() - t0
        loras = [adapters[i % len(adapters)] for i in range(len(prompts))] if adapters else None
        # Warm-up: the first requests' lengths (and adapters); an image workload's with other images.
        warm_prompts = workload.warmup_prompts(arch)
        first = range(len(warm_prompts))
        warm = [loras[i % len(loras)] for i in first] if loras else None
        llm.generate(
            warm_prompts, [params[i % len(params)] for i in first], use_tqdm=False, lora_request=warm
        )
        torch.cuda.synchronize()
        with ClockSampler() as clocks:
            began = time.strftime(LOG_TIME)
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            ended = time.strftime(LOG_TIME)
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        n_in = sum(len(o.prompt_token_ids) for o in outs)  # an image's pads expanded
        clock = clocks.samples.summary()
        per_image = f", {len(prompts) / seconds:,.2f} images/s" if images else ""
        print(
            f"vLLM {workload.name}: {n_out} output tokens in {seconds:.2f} s = {n_out / seconds:,.0f} tok/s"
            f"{per_image} (SM clock {clock['sm_clock_mhz_median']} / {clock['sm_clock_mhz_min']} MHz; "
            f"start-up {init_s:.0f} s)"
        )
        record = {
            "bench": "vllm_throughput",
            "workload": workload.name,
            "model": model,
            "requests": len(prompts),
            "extra": extra,
            "output_tok_s": round(n_out / seconds, 1),
            "input_tokens": n_in,
            "seconds": round(seconds, 3),
            "init_s": round(init_s, 1),  # the one start-up, repeated on each workload's line
            "max_model_len": args.max_model_len,
            "engine_core": "in-process" if in_process else "own process",
            "dummy_weights": args.dummy_weights,
            # distinct tokens across requests at a few output positions (the work dummy weights do)
            "distinct_tokens": output_spread([list(o.outputs[0].token_ids) for o in outs]),
            "kv_pool_tokens": kv_pool_tokens(llm),
            # the timed run's span in vLLM's log format: a "JIT compilation during inference" warning
            # stamped inside it is a Triton compile the timed run paid for (pairs_gpu.sh lists them)
            "timed": [began, ended],
            **clock,
        }
        if images:
            record.update(
                images=len(prompts), images_s=round(len(prompts) / seconds, 2), image_tokens=image_tokens
            )
        print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
