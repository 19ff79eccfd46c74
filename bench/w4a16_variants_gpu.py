"""The integer-weight GEMM variants side by side on one GPU, to pick the defaults: one call, ~2-3 minutes
with Triton's compilation (the MoE section alone, --moe: under 2 minutes).

Run on a GPU from the repository root:  PYTHONPATH=. python bench/w4a16_variants_gpu.py [--skip-int8]
                                        PYTHONPATH=. python bench/w4a16_variants_gpu.py --mid
                                        PYTHONPATH=. python bench/w4a16_variants_gpu.py --moe

1. Correctness (bf16): every W4A16 variant against w4a16_gemm_ref at the o shape (4096 x 4096), int4
   groups of 128 with and without zero points, M in {1, 16, 64, 256}; every W8A8 path against the W8A8
   reference (int8 weight per channel, int8 activations per token; w8a16 skips the activation
   quantization, so it is held to the quantization's error, 3e-2, instead of 1e-2).
2. Time at the Qwen3-8B shapes (qkv 4096->6144, o 4096->4096, gate_up 4096->24576, down 12288->4096) x
   M in {1, 16, 64, 256, 1024}: bf16 F.linear against each variant. Timed as the engine runs them:
   inside a CUDA graph (no Python launch cost; the split-K sum and dequantize+cuBLAS paths pay for all
   their launches) over enough weight copies that they do not stay in L2 (>= 256 MB a replay, as the
   36 layers of a model do not), median of 10 replays. Printed: us, speed-up over bf16 (x), GB/s of the
   weight bytes read (packed int4 + scales + zeros; int8 + scales; bf16 for the bf16 row).
3. The best variant per (shape, M) and, per M, the variant with the best geometric-mean speed-up over
   the four shapes, with its W4A16Config: what to put in kernels/w4a16_gemm.py's TIERS (and its
   KERNEL, LARGE_M_PATH, DEQUANT_GEMM_MIN_M, DEQUANT_KERNEL) and kernels/int8_gemm.py's
   (W8A16_MAX_M, LARGE_PATH).

4. --moe instead of 1-3: the packed int4 MoE experts (kernels/w4a16_moe.py) at Qwen3-30B-A3B's shapes
   (128 experts, top-8, hidden 2048, expert intermediate 768, int4 groups of 128), zero points and
   symmetric, x tokens in {1, 16, 128, 512, 1024, 4096}: every variant of MOE_VARIANTS against
   w4a16_fused_experts_ref (relative error < 1e-2 of the largest output) and timed against the bf16
   fused MoE (kernels/fused_moe.py, its tuned or default tiles) on the same routing, the whole layer
   (alignment, two GEMMs, sum) in a CUDA graph, MOE_CALLS calls a replay, each on its own routing and
   one of MOE_COPIES weight copies (so no call finds its experts in L2), median of 10 replays. Prints
   us and x bf16 per (tokens, variant) with and without zero points, the best variant per token count
   and its W4A16MoeConfig as a TIERS line (rows per expert = tokens * 8 / 128). A deadline
   (MOE_DEADLINE_S) skips the variants not yet timed rather than overrun.

5. --mid instead of 1-4: W4A16 at 96-1,024 rows and Qwen3-32B's shapes (MID_VARIANTS: the current
   swapped tiers and the "half" unpack's tiles against the default dequantize + cuBLAS), checked and
   timed as in 1-3; about 3 minutes.

Prints tables, then one JSON line.
"""

from __future__ import annotations

import json
import math
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")

from bench.gpu_timing import graph_time  # noqa: E402
from overnight.kernels.int8_gemm import int8_gemm_ref, int8_linear  # noqa: E402
from overnight.kernels.int8_quant import quantize_int8_ref  # noqa: E402
from overnight.kernels.w4a16_gemm import (  # noqa: E402
    W4A16Config,
    default_config,
    w4a16_gemm_ref,
    w4a16_linear,
)
from overnight.kernels.w4a16_moe import (  # noqa: E402
    V1_CONFIG,
    IntMoeTiles,
    W4A16MoeConfig,
    w4a16_fused_experts,
    w4a16_fused_experts_ref,
)
from overnight.kernels.w4a16_moe import default_config as moe_default_config  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
MS = (1, 16, 64, 256, 1024)
CHECK_MS = (1, 16, 64, 256)  # the correctness section's rows
SMALL_M = 64  # variants of the small-M regime run up to here, the large-M ones from 256 on
ROTATE_BYTES = 256 << 20
GROUP = 128
DEVICE, DTYPE = "cuda", torch.bfloat16  # tests/test_bench_w4a16_variants.py runs it on the CPU, fp32


def _bm(m: int) -> int:
    return 16 if m <= 16 else 32 if m <= 32 else 64


# name -> config for M rows (None: the variant does not apply at that M). "default" is whatever
# default_config picks now; "v1" is the first version (its tiles, dequantize + cuBLAS from 256 rows).
W4A16_VARIANTS: dict[str, Callable[[int], W4A16Config | None]] = {
    "default": lambda m: None,
    "v1": lambda m: (
        W4A16Config(_bm(m), 64, kernel="v1")
        if m <= SMALL_M
        else W4A16Config(64, 128, kernel="v1", path="dequant")
    ),
    # small M: the v2 kernel's options
    "v2-bn64": lambda m: W4A16Config(_bm(m), 64) if m <= SMALL_M else None,
    "v2-bn32": lambda m: W4A16Config(_bm(m), 32) if m <= SMALL_M else None,
    "v2-scale-w": lambda m: W4A16Config(_bm(m), 64, scale_after=False) if m <= SMALL_M else None,
    "v2-atomic": lambda m: W4A16Config(_bm(m), 64, reduce="atomic") if m <= SMALL_M else None,
    "v2-nosplit": lambda m: W4A16Config(_bm(m), 64, split_k=1) if m <= SMALL_M else None,
    "v2-bn32-nosplit": lambda m: W4A16Config(_bm(m), 32, split_k=1) if m <= SMALL_M else None,
    "v2-bn64-s6": lambda m: W4A16Config(_bm(m), 64, num_stages=6) if m <= SMALL_M else None,
    "v2-swap": lambda m: W4A16Config(_bm(m), 64, swap_ab=True) if m <= SMALL_M else None,
    "v2-swap-bn128": lambda m: W4A16Config(_bm(m), 128, swap_ab=True) if m <= SMALL_M else None,
    "v2-half-swap": lambda m: (
        W4A16Config(_bm(m), 64, scale_after=False, swap_ab=True, unpack="half") if m <= SMALL_M else None
    ),
    # large M: fused tiles against dequantize (v2) + cuBLAS
    "dequant-v2": lambda m: W4A16Config(128, 128, path="dequant") if m > SMALL_M else None,
    "fused-128x128x64": lambda m: (
        W4A16Config(128, 128, 1, 8, 3, 64, scale_after=False) if m > SMALL_M else None
    ),
    "fused-128x128x64-split": lambda m: (
        W4A16Config(128, 128, 0, 8, 3, 64, scale_after=False, reduce="atomic") if m > SMALL_M else None
    ),
    "fused-128x128x128": lambda m: (
        W4A16Config(128, 128, 1, 8, 3, 128, scale_after=False) if m > SMALL_M else None
    ),
    "fused-64x128x128-w4": lambda m: (
        W4A16Config(64, 128, 1, 4, 4, 128, scale_after=False) if m > SMALL_M else None
    ),
    "fused-swap-128x128x64": lambda m: (
        W4A16Config(128, 128, 1, 8, 3, 64, scale_after=False, swap_ab=True) if m > SMALL_M else None
    ),
    "fused-swap-64x256x64": lambda m: (
        W4A16Config(64, 256, 1, 8, 3, 64, scale_after=False, swap_ab=True) if m > SMALL_M else None
    ),
    "fused-128x256x64": lambda m: (
        W4A16Config(128, 256, 1, 8, 3, 64, scale_after=False) if m > SMALL_M else None
    ),
}
# --mid instead of 1-3: the decode batches of a large model (~100-400 rows a step: the 32B AWQ run's) at
# Qwen3-32B's shapes, where the default dequantizes the whole weight for cuBLAS (4.5 bytes a weight
# moved against the packed form's 0.5): the swapped fused tiles with BLOCK_M up to 256 (wgmma's widest
# N) against it. Each M-tile reads the packed weight once, so 64-row tiles read it M/64 times.
MID_SHAPES = {"qkv": (10240, 5120), "o": (5120, 8192), "gate_up": (51200, 5120), "down": (5120, 25600)}
MID_MS = (96, 128, 192, 256, 384, 512, 1024)
MID_CHECK_MS = (1, 96, 192, 384)


def _half(bm: int, bn: int, warps: int, stages: int, bk: int, swap: bool = False) -> W4A16Config:
    """A fused tile with the "half" unpack (4-bit codes straight to scaled 16-bit weights, the dots
    chained); split-K where the tiles are fewer than the SMs."""
    return W4A16Config(bm, bn, 0, warps, stages, bk, scale_after=False, swap_ab=swap, unpack="half")


# Session V's current tiers (the 64- and 128-row swapped tiles) and the default against the "half"
# tiles (their sm_90 builds: tests/test_kernels_w4a16_sm90.py). Session V's other swapped tiles lost at
# every M (0.27-0.40x bf16) and are left out.
MID_VARIANTS: dict[str, Callable[[int], W4A16Config | None]] = {
    "default": lambda m: None,
    "swap-64x64": lambda m: W4A16Config(64, 64, swap_ab=True),
    "swap-128x128-w8": lambda m: W4A16Config(128, 128, num_warps=8, num_stages=3, swap_ab=True),
    "half-128x128x64-w8": lambda m: _half(128, 128, 8, 4, 64),  # 2 programs an SM (97 KB, 128 regs)
    "half-128x128x128-w8": lambda m: _half(128, 128, 8, 3, 128),
    "half-64x128x64-w4": lambda m: _half(64, 128, 4, 4, 64),
    "half-64x256x64-w8": lambda m: _half(64, 256, 8, 3, 64),
    "half-128x256x64-w8": lambda m: _half(128, 256, 8, 3, 64),
    "half-256x128x64-w8": lambda m: _half(256, 128, 8, 3, 64),
    "half-swap-128x128-w8": lambda m: _half(128, 128, 8, 3, 128, swap=True),
}
INT8_PATHS = {"int_mm": lambda m: True, "triton": lambda m: True, "w8a16": lambda m: m <= SMALL_M}
RESULTS: dict[str, object] = {}


def int4_weight(n: int, k: int, zeros: bool, seed: int = 0):
    """Random words are random 4-bit codes; made on the device (the CPU would take minutes for the
    copies of the largest shapes)."""
    gen = torch.Generator(DEVICE).manual_seed(seed)
    words = torch.randint(-(1 << 31), 1 << 31, (n, k // 8), generator=gen, device=DEVICE, dtype=torch.int32)
    scale = torch.rand(n, k // GROUP, generator=gen, device=DEVICE) * 0.02 + 0.001
    zero = torch.randint(0, 16, (n, k // GROUP), generator=gen, device=DEVICE).float() if zeros else None
    return words, scale, zero


def int8_weight(n: int, k: int, seed: int = 0):
    gen = torch.Generator(DEVICE).manual_seed(seed)
    w = torch.randint(-127, 128, (n, k), generator=gen, device=DEVICE, dtype=torch.int8)
    return w, torch.rand(n, generator=gen, device=DEVICE) * 0.01 + 0.001


def copies(nbytes: int) -> int:
    return max(1, min(32, math.ceil(ROTATE_BYTES / nbytes)))


def section(fn):
    def run(*args):
        print(f"\n== {fn.__name__} ==", flush=True)
        t0 = time.time()
        try:
            fn(*args)
        except Exception:
            traceback.print_exc()
            RESULTS[fn.__name__] = "failed"
        print(f"({time.time() - t0:.0f} s)", flush=True)

    return run


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


@section
def correctness(skip_int8: bool) -> None:
    n, k = SHAPES["o"]
    bad, worst = [], 0.0
    for zeros in (True, False):
        qw, scale, zero = int4_weight(n, k, zeros)
        for m in CHECK_MS:
            x = torch.randn(m, k, device=DEVICE, dtype=DTYPE)
            ref = w4a16_gemm_ref(x, qw, scale, zero, 4, GROUP)
            for name, make in W4A16_VARIANTS.items():
                if name != "default" and make(m) is None:
                    continue
                err = rel_err(w4a16_linear(x, qw, scale, zero, 4, GROUP, make(m)), ref)
                worst = max(worst, err)
                if not err < 1e-2:
                    bad.append((name, m, zeros, err))
    if not skip_int8:
        w, sw = int8_weight(n, k)
        for m in (1, 16, 64, 256):
            x = torch.randn(m, k, device=DEVICE, dtype=DTYPE)
            ref = int8_gemm_ref(*quantize_int8_ref(x), w, sw, DTYPE)
            for path, applies in INT8_PATHS.items():
                if applies(m):
                    err = rel_err(int8_linear(x, w, sw, path), ref)
                    if not err < (3e-2 if path == "w8a16" else 1e-2):
                        bad.append((path, m, "int8", err))
    print(f"worst int4 relative error {worst:.2e}; failures: {bad or 'none'}")
    RESULTS["correctness"] = "ok" if not bad else bad


def row(table: list, shape: str, m: int, name: str, us: float, bf16_us: float, nbytes: int) -> None:
    gbps = nbytes / (us * 1e-6) / 1e9
    table.append({"shape": shape, "M": m, "variant": name, "us": us, "x_bf16": bf16_us / us, "GBps": gbps})
    print(f"{shape:8s} M={m:5d}  {name:20s} {us:9.1f} us  x{bf16_us / us:5.2f}  {gbps:6.0f} GB/s", flush=True)


@section
def times(skip_int8: bool) -> None:
    table: list[dict] = []
    for shape, (n, k) in SHAPES.items():
        bf16 = [torch.randn(n, k, device=DEVICE, dtype=DTYPE) for _ in range(copies(n * k * 2))]
        packed_bytes = n * k // 2 + 2 * 4 * n * (k // GROUP)
        int4 = [int4_weight(n, k, True, seed=i) for i in range(copies(packed_bytes))]
        int8 = [] if skip_int8 else [int8_weight(n, k, seed=i) for i in range(copies(n * k + 4 * n))]
        for m in MS:
            x = torch.randn(m, k, device=DEVICE, dtype=DTYPE)
            t_bf16 = graph_time([lambda w=w, x=x: F.linear(x, w) for w in bf16])
            row(table, shape, m, "bf16", t_bf16, t_bf16, n * k * 2)
            for name, make in W4A16_VARIANTS.items():
                cfg = make(m)
                if name != "default" and cfg is None:
                    continue
                calls = [lambda p=p, cfg=cfg, x=x: w4a16_linear(x, *p, 4, GROUP, cfg) for p in int4]
                try:
                    row(table, shape, m, name, graph_time(calls), t_bf16, packed_bytes)
                except Exception as e:
                    print(f"{shape:8s} M={m:5d}  {name:20s} failed: {type(e).__name__}: {str(e)[:200]}")
            for path, applies in INT8_PATHS.items():
                if not int8 or not applies(m):
                    continue
                calls = [lambda p=p, path=path, x=x: int8_linear(x, *p, path) for p in int8]
                try:
                    row(table, shape, m, f"w8a8:{path}", graph_time(calls), t_bf16, n * k + 4 * n)
                except Exception as e:
                    print(f"{shape:8s} M={m:5d}  w8a8:{path:15s} failed: {type(e).__name__}: {str(e)[:200]}")
        del bf16, int4, int8
        torch.cuda.empty_cache()
    RESULTS["times"] = table
    summary(table)


def geometric_means(table: list[dict], m: int, names, shapes: int) -> dict[str, float]:
    """Per variant of `names`, the geometric mean of its x bf16 at M rows over the shapes, for the
    variants that ran at all `shapes` of them."""
    means = {}
    for name in names:
        xs = [r["x_bf16"] for r in table if r["M"] == m and r["variant"] == name]
        if len(xs) == shapes:
            means[name] = math.exp(sum(map(math.log, xs)) / len(xs))
    return means


def summary(table: list[dict]) -> None:
    print("\n== best per (shape, M) ==")
    best: dict[str, object] = {}
    for family, keep in (
        ("w4a16", lambda v: not v.startswith(("w8a8", "bf16"))),
        ("w8a8", lambda v: v.startswith("w8a8")),
    ):
        for shape in SHAPES:
            for m in MS:
                rows = [r for r in table if r["shape"] == shape and r["M"] == m and keep(r["variant"])]
                if rows:
                    top = min(rows, key=lambda r: r["us"])
                    best[f"{family} {shape} M={m}"] = top["variant"]
                    base = next((r for r in rows if r["variant"] in ("v1", "w8a8:int_mm")), top)
                    print(
                        f"{family:6s} {shape:8s} M={m:5d}  best {top['variant']:20s} {top['us']:8.1f} us "
                        f"x{top['x_bf16']:5.2f} bf16  ({base['variant']} was x{base['x_bf16']:5.2f})"
                    )
        print(f"-- {family}: per M, geometric mean of x bf16 over the shapes (variants run at all four) --")
        for m in MS:
            names = {r["variant"] for r in table if r["M"] == m and keep(r["variant"])}
            means = geometric_means(table, m, names, len(SHAPES))
            ranked = sorted(means.items(), key=lambda kv: -kv[1])
            print(f"M={m:5d}  " + "  ".join(f"{name} {gm:.2f}" for name, gm in ranked[:6]))
            if ranked and ranked[0][0] in W4A16_VARIANTS:
                top = ranked[0][0]
                print(f"         {top}: {W4A16_VARIANTS[top](m) or default_config(m)!r}")
            best[f"{family} gmean M={m}"] = ranked[:3]
    RESULTS["best"] = best


# -- MoE experts (section 4) ------------------------------------------------------------------------
MOE_SHAPE = (128, 2048, 768, 8)  # experts, hidden, expert intermediate, top-k (Qwen3-30B-A3B)
MOE_TOKENS = (1, 16, 128, 512, 1024, 4096)
MOE_COPIES, MOE_CALLS = 4, 8  # weight copies, calls (routings) a replay
MOE_DEADLINE_S = 100.0
_A = IntMoeTiles(64, 128, 1, 4, 3)  # scale after the dot, mma.sync at 16/32 rows
_A_SWAP = replace(_A, swap_ab=True)  # the same with swap_ab (wgmma m64n16/n32)
_B64 = (IntMoeTiles(64, 128, 8, 4, 3, False), IntMoeTiles(128, 128, 8, 4, 3, False))
_B64_K64 = (IntMoeTiles(64, 64, 8, 4, 4, False), IntMoeTiles(128, 64, 8, 4, 4, False))
_B128 = (IntMoeTiles(128, 64, 8, 8, 3, False), IntMoeTiles(128, 128, 8, 8, 3, False))
_B128_N64 = (IntMoeTiles(64, 128, 8, 8, 3, False), IntMoeTiles(128, 64, 8, 8, 3, False))


def _rows(tokens: int) -> float:
    return tokens * MOE_SHAPE[3] / MOE_SHAPE[0]


def _swapped(tiles: tuple[IntMoeTiles, IntMoeTiles]) -> tuple[IntMoeTiles, IntMoeTiles]:
    return replace(tiles[0], swap_ab=True), replace(tiles[1], swap_ab=True)


def _halved(tiles: tuple[IntMoeTiles, IntMoeTiles]) -> tuple[IntMoeTiles, IntMoeTiles]:
    return tuple(replace(t, scale_after=False, unpack="half") for t in tiles)  # type: ignore[return-value]


# name -> config for a token count (None: not run there). "default" is default_config's tier; "v1" the
# first version (BLOCK_M 16, scalar shared stores, cvt). The others pin one BLOCK_M with its options, in
# the token range where that BLOCK_M is a candidate (by rows per expert).
MOE_VARIANTS: dict[str, Callable[[int], W4A16MoeConfig | None]] = {
    "default": lambda t: moe_default_config(t, MOE_SHAPE[3], MOE_SHAPE[0]),
    "v1": lambda t: V1_CONFIG,
    "m16": lambda t: W4A16MoeConfig(16, _A, _A) if _rows(t) <= 8 else None,
    "m16-n32": lambda t: (
        W4A16MoeConfig(16, replace(_A, block_n=32, num_stages=4), _A) if _rows(t) <= 1 else None
    ),
    "m16-swap": lambda t: W4A16MoeConfig(16, _A_SWAP, _A_SWAP) if _rows(t) <= 64 else None,
    "m32": lambda t: (
        W4A16MoeConfig(32, replace(_A, block_k=64, num_stages=4), _A) if 4 <= _rows(t) <= 64 else None
    ),
    "m32-swap": lambda t: W4A16MoeConfig(32, _A_SWAP, _A_SWAP) if 4 <= _rows(t) <= 64 else None,
    "m64": lambda t: W4A16MoeConfig(64, *_B64) if 8 <= _rows(t) else None,
    "m64-swap": lambda t: W4A16MoeConfig(64, *_swapped(_B64)) if 8 <= _rows(t) else None,
    "m64-k64": lambda t: W4A16MoeConfig(64, *_B64_K64) if 8 <= _rows(t) else None,
    "m128": lambda t: W4A16MoeConfig(128, *_B128) if 32 <= _rows(t) else None,
    "m128-n64": lambda t: W4A16MoeConfig(128, *_B128_N64) if 32 <= _rows(t) else None,
    "m128-swap": lambda t: W4A16MoeConfig(128, *_swapped(_B128)) if 32 <= _rows(t) else None,
    # the "half" unpack (kernels/int_unpack.py's _unpack_scaled) on the large tiers' tiles
    "m64-k64-half": lambda t: W4A16MoeConfig(64, *_halved(_B64_K64)) if 8 <= _rows(t) else None,
    "m128-half": lambda t: W4A16MoeConfig(128, *_halved(_B128)) if 32 <= _rows(t) else None,
    "m128-swap-half": lambda t: W4A16MoeConfig(128, *_halved(_swapped(_B128))) if 32 <= _rows(t) else None,
}


def moe_stack(n: int, k: int, zeros: bool, seed: int):
    words, scale, zero = int4_weight(MOE_SHAPE[0] * n, k, zeros, seed)
    return (
        words.view(MOE_SHAPE[0], n, -1),
        scale.view(MOE_SHAPE[0], n, -1),
        (zero.view(MOE_SHAPE[0], n, -1) if zero is not None else None),
    )


def routing(tokens: int, seed: int):
    gen = torch.Generator(DEVICE).manual_seed(1000 + seed)
    logits = torch.randn(tokens, MOE_SHAPE[0], generator=gen, device=DEVICE)
    weights, ids = torch.topk(logits.softmax(-1), MOE_SHAPE[3])
    return weights, ids.int()


@section
def moe_times() -> None:
    from overnight.kernels.fused_moe import fused_experts
    from overnight.kernels.w4a16_moe import dequantize_experts_ref

    e, hidden, inter, _ = MOE_SHAPE
    stacks = [
        (moe_stack(2 * inter, hidden, True, 2 * i), moe_stack(hidden, inter, True, 2 * i + 1))
        for i in range(MOE_COPIES)
    ]
    bf16 = [tuple(dequantize_experts_ref(*p, 4, GROUP, DTYPE) for p in pair) for pair in stacks]
    table: list[dict] = []
    deadline = time.time() + MOE_DEADLINE_S
    bad = []
    for tokens in MOE_TOKENS:
        xs = [torch.randn(tokens, hidden, device=DEVICE, dtype=DTYPE) for _ in range(MOE_CALLS)]
        routes = [routing(tokens, i) for i in range(MOE_CALLS)]
        t_bf16 = graph_time(
            [
                lambda i=i, x=x, r=r: fused_experts(x, *bf16[i % MOE_COPIES], *r)
                for i, (x, r) in enumerate(zip(xs, routes))
            ]
        )
        rec = {"tokens": tokens, "variant": "bf16", "us": t_bf16}
        table.append(rec)
        print(f"tokens {tokens:5d}  {'bf16':12s} {t_bf16:9.1f} us", flush=True)
        for name, make in MOE_VARIANTS.items():
            cfg = make(tokens)
            if cfg is None or (time.time() > deadline and name not in ("default", "v1")):
                continue
            rec = {"tokens": tokens, "variant": name, "config": repr(cfg)}
            for zeros in (True, False):
                tag = "zero" if zeros else "sym"
                packed = [tuple(p if zeros else (p[0], p[1], None) for p in pair) for pair in stacks]
                try:
                    y = w4a16_fused_experts(xs[0], *packed[0], 4, (GROUP, GROUP), *routes[0], config=cfg)
                    ref = w4a16_fused_experts_ref(xs[0], *packed[0], 4, (GROUP, GROUP), *routes[0])
                    rec[f"err_{tag}"] = err = rel_err(y, ref)
                    if not err < 1e-2:
                        bad.append((name, tokens, tag, err))
                    calls = [
                        lambda i=i, x=x, r=r, p=packed, c=cfg: w4a16_fused_experts(
                            x, *p[i % MOE_COPIES], 4, (GROUP, GROUP), *r, config=c
                        )
                        for i, (x, r) in enumerate(zip(xs, routes))
                    ]
                    rec[f"us_{tag}"] = graph_time(calls)
                    rec[f"x_{tag}"] = t_bf16 / rec[f"us_{tag}"]
                except Exception as exc:
                    rec[f"failed_{tag}"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            table.append(rec)
            cells = "  ".join(
                f"{tag} {rec[f'us_{tag}']:8.1f} us x{rec[f'x_{tag}']:5.2f} err {rec[f'err_{tag}']:.0e}"
                if f"us_{tag}" in rec
                else f"{tag} failed: {rec.get(f'failed_{tag}')}"
                for tag in ("zero", "sym")
            )
            print(f"tokens {tokens:5d}  {name:12s} {cells}", flush=True)
    RESULTS["moe_correctness"] = "ok" if not bad else bad
    RESULTS["moe_times"] = table
    print(f"correctness failures: {bad or 'none'}")
    moe_summary(table)


def moe_summary(table: list[dict]) -> None:
    """Per token count the variant with the best geometric mean of x bf16 over zero / sym, and the
    TIERS line that would make it the default (bound: that count's rows per expert)."""
    print("\n== MoE: best variant per token count (geometric mean of zero and sym x bf16) ==")
    best = {}
    for tokens in MOE_TOKENS:
        rows = [r for r in table if r["tokens"] == tokens and "x_zero" in r and "x_sym" in r]
        if not rows:
            continue
        top = max(rows, key=lambda r: r["x_zero"] * r["x_sym"])
        default = next((r for r in rows if r["variant"] == "default"), top)
        v1 = next((r for r in rows if r["variant"] == "v1"), top)
        gm = lambda r: math.sqrt(r["x_zero"] * r["x_sym"])  # noqa: E731
        print(
            f"tokens {tokens:5d}: best {top['variant']:12s} x{gm(top):5.2f}  (default x{gm(default):5.2f}, "
            f"v1 x{gm(v1):5.2f})\n    ({_rows(tokens):g}, {top['config']}),"
        )
        best[tokens] = top["variant"]
    RESULTS["moe_best"] = best


if __name__ == "__main__":
    skip = "--skip-int8" in sys.argv
    t0 = time.time()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    if "--moe" in sys.argv:
        from overnight.bench.gpu_info import sm_clock_now

        print(f"SM clock (now, max): {sm_clock_now()}", flush=True)
        moe_times()
        print(f"SM clock (now, max): {sm_clock_now()}", flush=True)
    else:
        if "--mid" in sys.argv:  # the module's tables swapped for section --mid's (no int8 there)
            SHAPES, MS, CHECK_MS, W4A16_VARIANTS = MID_SHAPES, MID_MS, MID_CHECK_MS, MID_VARIANTS
            skip = True
        correctness(skip)
        times(skip)
    print(f"total {time.time() - t0:.0f} s")
    print(json.dumps(RESULTS))
