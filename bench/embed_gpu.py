"""Embedding throughput of the decoder pooling path on one GPU (the lead runs it on the H200):

    PYTHONPATH=. python bench/embed_gpu.py

1. Correctness: a random Qwen3-0.6B (exact architecture, weights spread so hidden states differ) saved as
   a bf16 checkpoint; our engine (runner pooling, last-token pooling, normalized; a step budget of 512
   tokens, so long prompts are pooled over several chunks) against transformers' Qwen3Model in fp32 on
   the same weights, prompt by prompt: cosine >= 0.99 for every prompt (bf16 against fp32).
   The same for a BERT-base-shaped encoder (random init, CLS pooling, normalized) through the encoder
   engine, against transformers' BertModel in fp32.
2. Throughput: the qwen3-0.6b preset with dummy weights, runner pooling (as `LLM("qwen3-0.6b",
   load_format="dummy", runner="pooling")`), bf16, default limits. Workloads (token ids: Python
   random.Random(0); per prompt n = randint(lo, hi), then n ids with randrange(100, vocab - 1000)):
       embed-128-512   8,192 prompts of 128 to 512 tokens
       embed-16-128   16,384 prompts of 16 to 128 tokens (host-bound: many small requests)
   Timed: one LLM.encode call over the whole list after a warm-up; SM clock sampled during it.
   vLLM's counterpart, bench/embed_vllm.py (run it first on the same GPU, then this with
   --throughput-only): LLM(model=<a Qwen3-0.6B config folder>, runner="pooling",
   load_format="dummy").embed([{"prompt_token_ids": ids} ...]) on the same ids.

Prints a table, then one JSON line. Exit status 1 if the correctness check fails. `--smoke` runs the same
code on the CPU with a 2-layer model and small workloads (a check of the script, not a measurement).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, ".")

from overnight import LLM  # noqa: E402
from overnight.bench.gpu_info import ClockSampler, sm_clock_now  # noqa: E402
from overnight.bench.hf_reference import hf_config  # noqa: E402
from overnight.loader.resolve import resolve_source  # noqa: E402

VOCAB = 151936
WORKLOADS = {"embed-128-512": (8192, 128, 512), "embed-16-128": (16384, 16, 128)}
SMOKE = False  # --smoke: CPU, a 2-layer model, small workloads
DEVICE = "cuda"


def rate_record(prompts: int, tokens: int, seconds: float, clocks) -> dict:
    """One workload's timed encode (ours or vLLM's, bench/embed_vllm.py): counts, rates, SM clock."""
    return {
        "prompts": prompts,
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tok_per_s": round(tokens / seconds),
        "prompts_per_s": round(prompts / seconds),
        "clock": clocks.samples.summary(),
    }


def token_prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.randint(lo, hi)
        out.append([rng.randrange(100, VOCAB - 1000) for _ in range(k)])
    return out


def spread_(model: torch.nn.Module, seed: int = 0) -> None:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                v = 1.0 + 0.2 * (torch.rand(p.shape, generator=gen) - 0.5)
            elif "embed_tokens" in name:
                v = torch.randn(p.shape, generator=gen)
            else:
                v = torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5
            p.copy_(v.to(p.dtype))


def free(llm: LLM | None) -> None:
    if llm is not None:
        llm.engine.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def correctness() -> dict:
    import transformers

    source = resolve_source("qwen3-0.6b", "dummy")
    arch = source.arch
    if SMOKE:
        arch = dataclasses.replace(arch, num_hidden_layers=2, hidden_size=128, intermediate_size=256)
    config = hf_config(arch, source.hf_architecture)
    model = transformers.AutoModel.from_config(config, dtype=torch.float32)  # Qwen3Model: no LM head
    spread_(model)
    folder = tempfile.mkdtemp()
    model.to(torch.bfloat16).save_pretrained(folder)  # saved as sentence-transformers saves Qwen3-Embedding
    model = model.float().to(DEVICE).eval()
    rng = random.Random(1)
    lengths = [1, 7, 64, 300, 511, 512, 513, 1000, 1500, 2048] + [rng.randint(2, 400) for _ in range(22)]
    if SMOKE:
        lengths = [1, 7, 64, 300, 513, 700]
    prompts = [[rng.randrange(100, VOCAB - 1000) for _ in range(n)] for n in lengths]
    refs = []
    with torch.inference_mode():
        for p in prompts:
            h = model(torch.tensor([p], device=DEVICE)).last_hidden_state[0, -1]
            refs.append(torch.nn.functional.normalize(h, dim=-1).cpu())
    del model
    gc.collect()
    torch.cuda.empty_cache()

    llm = LLM(
        folder,
        runner="pooling",
        skip_tokenizer_init=True,
        dtype="float32" if SMOKE else "bfloat16",
        gpu_memory_utilization=0.2,
        max_model_len=4096,
        max_num_batched_tokens=512,
    )
    outs = llm.encode([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    again = llm.encode([{"prompt_token_ids": p} for p in prompts[:8]], use_tqdm=False)  # prefix-cache hits
    free(llm)
    cos = [float(torch.nn.functional.cosine_similarity(o.outputs.data, r, dim=0)) for o, r in zip(outs, refs)]
    cos_cached = [
        float(torch.nn.functional.cosine_similarity(a.outputs.data, o.outputs.data, dim=0))
        for a, o in zip(again, outs)
    ]
    norms = [float(o.outputs.data.norm()) for o in outs]
    ok = min(cos) >= 0.99 and min(cos_cached) >= 0.999 and all(abs(n - 1) < 1e-3 for n in norms)
    if SMOKE:
        global SMOKE_FOLDER
        SMOKE_FOLDER = folder
    return {
        "ok": ok,
        "min_cosine_vs_transformers_fp32": round(min(cos), 5),
        "worst_prompt_len": lengths[cos.index(min(cos))],
        "min_cosine_prefix_cached": round(min(cos_cached), 5),
        "cached_tokens": sum(a.num_cached_tokens for a in again),
    }


def correctness_bert() -> dict:
    """BERT-base shape (or a 2-layer one with --smoke) through the encoder engine vs transformers."""
    import transformers

    layers, hidden = (2, 128) if SMOKE else (12, 768)
    config = transformers.BertConfig(
        vocab_size=30522,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        intermediate_size=4 * hidden,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    folder = tempfile.mkdtemp()
    model.save_pretrained(folder)
    model = model.to(DEVICE)
    rng = random.Random(2)
    lengths = [1, 2, 17, 64, 100, 255, 256, 300, 511, 512] + [rng.randint(2, 512) for _ in range(22)]
    prompts = [[101] + [rng.randrange(1000, 30000) for _ in range(n - 1)] for n in lengths]
    with torch.inference_mode():
        refs = [
            torch.nn.functional.normalize(
                model(torch.tensor([p], device=DEVICE)).last_hidden_state[0, 0], dim=-1
            )
            .float()
            .cpu()
            for p in prompts
        ]
    del model
    gc.collect()
    torch.cuda.empty_cache()
    llm = LLM(
        folder,
        skip_tokenizer_init=True,
        dtype="float32" if SMOKE else "bfloat16",
        max_num_batched_tokens=2048,
    )
    outs = llm.encode([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    free(llm)
    cos = [float(torch.nn.functional.cosine_similarity(o.outputs.data, r, dim=0)) for o, r in zip(outs, refs)]
    return {
        "ok": min(cos) >= 0.99,
        "min_cosine_vs_transformers_fp32": round(min(cos), 5),
        "worst_prompt_len": lengths[cos.index(min(cos))],
    }


SMOKE_FOLDER = ""


def throughput() -> dict:
    if SMOKE:
        llm = LLM(SMOKE_FOLDER, load_format="dummy", runner="pooling", skip_tokenizer_init=True)
    else:
        llm = LLM("qwen3-0.6b", load_format="dummy", runner="pooling", gpu_memory_utilization=0.6)
    cfg = llm.engine.config.scheduler
    results = {"max_num_seqs": cfg.max_num_seqs, "max_num_batched_tokens": cfg.max_num_batched_tokens}
    warm = 16 if SMOKE else 512
    llm.encode([{"prompt_token_ids": p} for p in token_prompts(warm, 16, 512, seed=99)], use_tqdm=False)
    for name, (n, lo, hi) in WORKLOADS.items():
        n = 32 if SMOKE else n
        prompts = [{"prompt_token_ids": p} for p in token_prompts(n, lo, hi)]
        tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
        timings = llm.engine.timings
        steps_before = timings.steps if timings else 0
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        with ClockSampler() as clocks:
            t0 = time.perf_counter()
            outs = llm.encode(prompts, use_tqdm=False)
            seconds = time.perf_counter() - t0
        hidden = llm.engine.config.model.arch.hidden_size
        assert len(outs) == n and all(o.outputs.data.shape == (hidden,) for o in outs)
        results[name] = rate_record(n, tokens, seconds, clocks)
        results[name]["steps"] = (timings.steps - steps_before) if timings else None
    results["host_timings_per_step"] = llm.engine.timings.summary() if llm.engine.timings else None
    free(llm)
    return results


def main() -> int:
    global SMOKE, DEVICE
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--smoke", action="store_true", help="CPU, tiny model and workloads: checks the script"
    )
    parser.add_argument(
        "--throughput-only",
        action="store_true",
        help="skip the correctness checks (for a call that runs bench/embed_vllm.py beside it; not with --smoke)",
    )
    args = parser.parse_args()
    if args.smoke and args.throughput_only:
        parser.error("--smoke builds its model in the correctness check: drop --throughput-only")
    SMOKE = args.smoke
    DEVICE = "cpu" if SMOKE else "cuda"
    t0 = time.time()
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"device: {name}, SM clock now: {sm_clock_now()}")
    check: dict = {"ok": True, "skipped": True}
    if not args.throughput_only:
        try:
            check = correctness()
        except Exception as e:  # noqa: BLE001 - report and go on to the throughput numbers
            check = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        print("CORRECTNESS qwen3", "PASS" if check["ok"] else "FAIL", json.dumps(check))
        try:
            check_bert = correctness_bert()
        except Exception as e:  # noqa: BLE001 - report and go on to the throughput numbers
            check_bert = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        print("CORRECTNESS bert", "PASS" if check_bert["ok"] else "FAIL", json.dumps(check_bert))
    perf = throughput()
    print(
        f"{'workload':<16}{'prompts':>9}{'tokens':>11}{'seconds':>9}{'tok/s':>10}{'prompts/s':>11}  SM clock"
    )
    for name in WORKLOADS:
        r = perf[name]
        clock = r["clock"]
        print(
            f"{name:<16}{r['prompts']:>9}{r['tokens']:>11}{r['seconds']:>9.2f}{r['tok_per_s']:>10}"
            f"{r['prompts_per_s']:>11}  {clock['sm_clock_mhz_median']} / {clock['sm_clock_mhz_min']} MHz"
        )
    print(
        json.dumps({"bench": "embed_gpu", "correctness": check, **perf, "wall_s": round(time.time() - t0, 1)})
    )
    return 0 if check["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
