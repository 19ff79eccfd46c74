"""Integer weights on the GPU: W4A16 kernel correctness and speed against bf16, W8A8 through torch._int_mm,
and an engine run of a tiny packed checkpoint with CUDA graphs.

Run on a GPU from the repository root:  PYTHONPATH=. python bench/w4a16_gpu.py [--quick]
Needs torch + triton (+ transformers, compressed-tensors for section 4). Fixed seeds; each section runs
even if an earlier one failed. Not run yet (no GPU was lent when it was written).

1. Correctness, bf16: w4a16_gemm (4 and 8 bits, groups of 128 and channel-wise, zero points or none,
   split-K on and off) and the dequantize kernel against their torch references at the Qwen3-8B shapes.
2. GEMM time (CUDA events, triton.testing.do_bench, median) at the Qwen3-8B shapes (qkv 4096->6144,
   o 4096->4096, gate_up 4096->24576, down 12288->4096) x M in {1, 2, 4, 8, 16, 32, 64, 128, 256, 1024}:
   bf16 F.linear; w4a16_linear with the default tiles; the best of a small sweep of tiles and split-K
   (printed, to tune default_config); effective weight bandwidth (bytes of the packed weight / time).
   The goal: faster than bf16 up to M ~ 64 (a quarter of the bytes), not far behind past 256
   (dequantize + cuBLAS there).
3. MoE experts at the Qwen3-30B-A3B shapes (128 experts, H 2048, I 768, top 8) x tokens in {1, 8, 32,
   128, 512}: the bf16 fused experts (kernels/fused_moe.py) against the packed int4 ones
   (kernels/w4a16_moe.py), groups of 128, with an agreement check.
4. W8A8: Int8Linear (per-token quantization + torch._int_mm + scales) against bf16, same shapes and Ms.
5. Engine: a tiny Qwen3 written as GPTQ (act-order) and as compressed-tensors W4A16, loaded packed on the
   GPU in bf16 with CUDA graphs; greedy tokens against the engine on the dequantized twin (agreement
   share; bf16 rounding may split near-ties).

Prints human tables, then one JSON line.
"""

from __future__ import annotations

import json
import sys
import tempfile
import traceback
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, ".")

from overnight.kernels.w4a16_gemm import (  # noqa: E402
    W4A16Config,
    dequantize_int_weight,
    dequantize_int_weight_ref,
    w4a16_gemm,
    w4a16_gemm_ref,
    w4a16_linear,
)
from overnight.quant.int_formats import pack_along_last  # noqa: E402
from overnight.quant.int_linear import Int8Linear  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)
SWEEP = [
    W4A16Config(bm, bn, sk, nw, ns)
    for bm in (16,)
    for bn in (32, 64, 128)
    for sk in (0, 1, 2, 4, 8)
    for nw in (4, 8)
    for ns in (3, 4)
]
RESULTS: dict[str, object] = {}


def weight(n: int, k: int, bits: int, group: int, zeros: bool):
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 1 << bits, (n, k), generator=gen)
    scale = (torch.rand(n, k // group, generator=gen) * 0.02 + 0.001).cuda()
    zero = torch.randint(0, 1 << bits, (n, k // group), generator=gen).float().cuda() if zeros else None
    return pack_along_last(codes, bits).cuda(), scale, zero


def section(fn):
    def run(*args):
        print(f"\n== {fn.__name__} ==", flush=True)
        try:
            fn(*args)
        except Exception:
            traceback.print_exc()
            RESULTS[fn.__name__] = "failed"

    return run


@section
def correctness() -> None:
    rows = []
    for name, (n, k) in SHAPES.items():
        for bits, group, zeros in ((4, 128, True), (4, 128, False), (4, k, True), (8, 128, False)):
            qw, scale, zero = weight(n, k, bits, group, zeros)
            deq_ok = torch.equal(
                dequantize_int_weight(qw, scale, zero, bits, group, torch.bfloat16),
                dequantize_int_weight_ref(qw, scale, zero, bits, group, torch.bfloat16),
            )
            for m in (1, 16, 64, 300):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ref = w4a16_gemm_ref(x, qw, scale, zero, bits, group).float()
                for split in (None, 1):
                    y = w4a16_gemm(x, qw, scale, zero, bits, group, split_k=split).float()
                    err = ((y - ref).abs().max() / ref.abs().max()).item()
                    rows.append((name, bits, group, zeros, m, split, err, deq_ok))
    bad = [r for r in rows if r[6] > 2e-2 or not r[7]]
    print(f"{len(rows)} cases, worst relative error {max(r[6] for r in rows):.2e}, failures: {bad[:5]}")
    RESULTS["correctness"] = "ok" if not bad else "FAILED"


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


@section
def gemm_times(quick: bool) -> None:
    table = []
    for name, (n, k) in SHAPES.items():
        qw, scale, zero = weight(n, k, 4, 128, True)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        packed_bytes = qw.numel() * 4 + scale.numel() * 8
        for m in MS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t_bf16 = bench(partial(F.linear, x, w))
            t_int4 = bench(partial(w4a16_linear, x, qw, scale, zero, 4, 128))
            best = (t_int4, "default")
            if not quick and m <= 64:
                for cfg in SWEEP:
                    try:
                        t = bench(partial(w4a16_gemm, x, qw, scale, zero, 4, 128, config=cfg))
                    except Exception:
                        continue
                    best = min(best, (t, repr(cfg)))
            gbps = packed_bytes / (t_int4 * 1e-3) / 1e9
            table.append(
                {
                    "shape": name,
                    "M": m,
                    "bf16_ms": t_bf16,
                    "int4_ms": t_int4,
                    "speedup": t_bf16 / t_int4,
                    "int4_GBps": gbps,
                    "best_ms": best[0],
                    "best": best[1],
                }
            )
            print(
                f"{name:8s} M={m:5d}  bf16 {t_bf16 * 1e3:8.1f} us  int4 {t_int4 * 1e3:8.1f} us  "
                f"x{t_bf16 / t_int4:5.2f}  {gbps:6.0f} GB/s  best {best[0] * 1e3:8.1f} us {best[1]}",
                flush=True,
            )
    RESULTS["gemm_times"] = table


@section
def moe_times() -> None:
    from overnight.kernels.fused_moe import fused_experts
    from overnight.kernels.w4a16_moe import dequantize_experts_ref, w4a16_fused_experts

    experts, hidden, inter, top_k = 128, 2048, 768, 8

    def stack(n: int, k: int):
        parts = [weight(n, k, 4, 128, True) for _ in range(experts)]
        return tuple(torch.stack([p[i] for p in parts]) for i in range(3))

    gate_up, down = stack(2 * inter, hidden), stack(hidden, inter)
    w1 = dequantize_experts_ref(*gate_up, 4, 128, torch.bfloat16)
    w2 = dequantize_experts_ref(*down, 4, 128, torch.bfloat16)
    table = []
    for tokens in (1, 8, 32, 128, 512):
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        logits = torch.randn(tokens, experts, device="cuda")
        weights, ids = torch.topk(logits.softmax(-1), top_k)
        ids = ids.int()
        y4 = w4a16_fused_experts(x, gate_up, down, 4, (128, 128), weights, ids)
        y16 = fused_experts(x, w1, w2, weights, ids)
        err = ((y4.float() - y16.float()).abs().max() / y16.float().abs().max()).item()
        t16 = bench(partial(fused_experts, x, w1, w2, weights, ids))
        t4 = bench(partial(w4a16_fused_experts, x, gate_up, down, 4, (128, 128), weights, ids))
        table.append({"tokens": tokens, "bf16_ms": t16, "int4_ms": t4, "rel_err": err})
        print(
            f"tokens {tokens:4d}  bf16 {t16 * 1e3:8.1f} us  int4 {t4 * 1e3:8.1f} us  x{t16 / t4:5.2f}  err {err:.1e}"
        )
    RESULTS["moe_times"] = table


@section
def int8_times() -> None:
    table = []
    for name, (n, k) in SHAPES.items():
        layer = Int8Linear(k, n, False, torch.bfloat16, "cuda")
        layer.weight.data = torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8)
        layer.weight_scale.data = torch.rand(n, device="cuda") * 0.01
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for m in MS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t_bf16, t_int8 = bench(partial(F.linear, x, w)), bench(partial(layer, x))
            table.append({"shape": name, "M": m, "bf16_ms": t_bf16, "int8_ms": t_int8})
            print(
                f"{name:8s} M={m:5d}  bf16 {t_bf16 * 1e3:8.1f} us  w8a8 {t_int8 * 1e3:8.1f} us  x{t_bf16 / t_int8:5.2f}"
            )
    RESULTS["int8_times"] = table


@section
def engine() -> None:
    from overnight import LLM, SamplingParams
    from tests.int_checkpoints import make_int_checkpoint
    from tests.test_engine_parity import prompts_for
    from tests.tiny_models import make_tiny_checkpoint

    root = Path(tempfile.mkdtemp())
    src = make_tiny_checkpoint(root / "src", "qwen3", hidden_size=256, intermediate_size=512)
    out = {}
    for layout in (
        "gptq-w4-g32-sym",
        "gptq-w4-g16-asym-descact",
        "ct-w4-g32-asym-gidx",
        "awq-g32",
        "ct-w8a8",
    ):
        quantized, twin = make_int_checkpoint(src, root / layout, layout)
        prompts = prompts_for(384, n=8)
        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        tokens = []
        for folder in (quantized, twin):
            llm = LLM(str(folder), skip_tokenizer_init=True, dtype="bfloat16", kv_cache_memory_bytes=64 << 20)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            tokens.append([o.outputs[0].token_ids for o in outs])
            del llm
        same = sum(a == b for a, b in zip(*tokens)) / len(prompts)
        out[layout] = same
        print(f"{layout:28s} identical greedy continuations: {same:.2f}")
    RESULTS["engine"] = out


if __name__ == "__main__":
    quick = "--quick" in sys.argv
    correctness()
    gemm_times(quick)
    moe_times()
    int8_times()
    engine()
    print(json.dumps(RESULTS))
