"""W4A16 on words in MMA order against column order, from decode batches to prefill rows, in one call
(~4 minutes; with the two runs end to end ~10: --no-runs leaves them out).

Run on a GPU from the repository root:  PYTHONPATH=. python3 bench/w4a16_mma_gpu.py
                                        [--model qwen3-32b-awq] [--save FILE] [--no-runs]
                                        [--runs FILE]  (step 4 alone, with a plan --save wrote)
                                        [--ms 64,128,256]  (other rows than MS)

MMA order (kernels/w4a16_gemm.py's to_mma_order) lets a swapped tile use its unpacked weights as wgmma's
register operand with no round trip through shared memory; what that is worth is measured here.

1. Correctness, bf16 and fp16 (scales of x's dtype, so the half unpack is exact): every variant below on
   MMA-ordered words against w4a16_gemm_ref on the same weight in column order, M in CHECK_MS.
2. Times at Qwen3-32B's shapes (bench/w4a16_variants_gpu.py's MID_SHAPES, int4 groups of 128 with zero
   points) and M in MS, timed as that bench does (CUDA graphs over weight copies that miss L2):
   bf16 F.linear; "current" (the module's tiers on column-order words: what runs without MMA order);
   "default" (the module's choice on MMA-ordered words: its tiers to MMA_DEQUANT_GEMM_MIN_M); and
   TILES, fused swapped tiles on MMA-ordered words at every M (no dequantize + cuBLAS).
3. The plan (plan()): MMA order when "default" is at least as fast as "current" (geometric mean of x
   bf16 over the shapes) at every M below both thresholds, where both run fused tiers; then the
   tiers from the winners among "default" and TILES, as bench/w4a16_tiers_gpu.py plans them (fused up
   to the last M where a tile or a fused default wins, dequantize + cuBLAS after). Printed as [tiers,
   threshold, MMA_ORDER] (the threshold is MMA_DEQUANT_GEMM_MIN_M when MMA_ORDER), the spec bench/pairs_gpu.sh's OV_W4A16_TIERS takes (--save FILE).
4. Unless --no-runs: ours on the model (seed-512-256, dummy weights, packed), the module's settings,
   then the plan's, each in its own process; the ratio of output tok/s.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")

import bench.w4a16_tiers_gpu as tb  # noqa: E402
import bench.w4a16_variants_gpu as vb  # noqa: E402
from bench.gpu_timing import graph_time  # noqa: E402
from overnight.kernels import w4a16_gemm  # noqa: E402
from overnight.kernels.w4a16_gemm import W4A16Config, to_mma_order, w4a16_gemm_ref, w4a16_linear  # noqa: E402

MS = (16, 64, 128, 192, 256, 384, 512, 1024)
CHECK_MS = (1, 100, 192, 300)
TILES_FROM = 96  # the fused tiles are timed from this many rows (below, the tiers' small tiles win)
CHECK_DTYPES = (torch.bfloat16, torch.float16)
RUN_TIMEOUT_S = 280  # one run end to end (Qwen3-32B on an H100: ~4 minutes with its start)


def _swapped_half(bm: int, bn: int, warps: int, stages: int) -> W4A16Config:
    """A swapped tile with the half unpack and 128-column steps: bm token rows, bn weight rows."""
    return W4A16Config(bm, bn, 0, warps, stages, 128, scale_after=False, swap_ab=True, unpack="half")


# sm_90 compiles (tests/test_kernels_w4a16_sm90.py): none of these spills or serializes its wgmma
TILES: dict[str, Callable[[int], W4A16Config | None]] = {
    "mma-128x128-w8": lambda m: _swapped_half(128, 128, 8, 3),  # 117 KB: one program an SM
    "mma-128x128-w8-s2": lambda m: _swapped_half(128, 128, 8, 2),  # two programs an SM
    "mma-256x128-w8": lambda m: _swapped_half(256, 128, 8, 3),  # 215 KB, 255 registers
    "mma-128x256-w8": lambda m: _swapped_half(128, 256, 8, 3),
    # the module's 64-row tier (f32 unpack, scale after the dot) past 192 rows: Qwen3-32B-AWQ's decode
    # steps carry ~265 rows on an H100 (session Z), 5 of its row tiles against 3 of 128 x 128
    "mma-64x64-w4": lambda m: W4A16Config(64, 64, 0, 4, 4, scale_after=True, swap_ab=True),
}
VARIANTS: dict[str, Callable[[int], W4A16Config | None]] = {"default": lambda m: None, **TILES}


def correctness() -> list:
    n, k = vb.MID_SHAPES["o"]
    bad = []
    for dtype in CHECK_DTYPES:
        qw, scale, zero = vb.int4_weight(n, k, True)
        scale = scale.to(dtype).float()
        mma = to_mma_order(qw)
        for m in CHECK_MS:
            x = torch.randn(m, k, device=vb.DEVICE, dtype=dtype)
            ref = w4a16_gemm_ref(x, qw, scale, zero, 4, vb.GROUP)
            for name, make in VARIANTS.items():
                err = vb.rel_err(w4a16_linear(x, mma, scale, zero, 4, vb.GROUP, make(m), mma_order=True), ref)
                if not err < 1e-2:
                    bad.append((str(dtype), m, name, err))
    print(f"correctness failures: {bad or 'none'}", flush=True)
    return bad


def times() -> list[dict]:
    table: list[dict] = []
    for shape, (n, k) in vb.MID_SHAPES.items():
        bf16 = [torch.randn(n, k, device=vb.DEVICE, dtype=vb.DTYPE) for _ in range(vb.copies(n * k * 2))]
        packed = n * k // 2 + 2 * 4 * n * (k // vb.GROUP)
        natural = [vb.int4_weight(n, k, True, seed=i) for i in range(vb.copies(packed))]
        mma = [(to_mma_order(q), s, z) for q, s, z in natural]
        for m in MS:
            x = torch.randn(m, k, device=vb.DEVICE, dtype=vb.DTYPE)
            t_bf16 = graph_time([lambda w=w, x=x: F.linear(x, w) for w in bf16])
            vb.row(table, shape, m, "bf16", t_bf16, t_bf16, n * k * 2)
            t = graph_time([lambda p=p, x=x: w4a16_linear(x, *p, 4, vb.GROUP) for p in natural])
            vb.row(table, shape, m, "current", t, t_bf16, packed)
            for name, make in VARIANTS.items():
                cfg = make(m)
                if cfg is not None and m < TILES_FROM:
                    continue
                calls = [
                    lambda p=p, x=x, c=cfg: w4a16_linear(x, *p, 4, vb.GROUP, c, mma_order=True) for p in mma
                ]
                vb.row(table, shape, m, name, graph_time(calls), t_bf16, packed)
        del bf16, natural, mma
        torch.cuda.empty_cache()
    return table


def plan(table: list[dict], shapes: int) -> list:
    """[tiers as (bound, W4A16Config fields), DEQUANT_GEMM_MIN_M, MMA_ORDER] from the timing table; the
    module's own settings where the sweep has no rows to judge the order by (session AA's 256-384 rows
    had planned column order for want of them)."""
    means = {m: vb.geometric_means(table, m, ("current", *VARIANTS), shapes) for m in MS}
    fused_ms = [
        m
        for m in MS
        if m < min(w4a16_gemm.DEQUANT_GEMM_MIN_M, w4a16_gemm.MMA_DEQUANT_GEMM_MIN_M)
        and {"current", "default"} <= set(means[m])
    ]
    current = [[b, asdict(c)] for b, c in w4a16_gemm.TIERS]
    if not fused_ms:  # a short sweep (--ms) with no rows where both orders run fused tiers: no verdict
        keep = w4a16_gemm.MMA_ORDER
        return [current, w4a16_gemm.MMA_DEQUANT_GEMM_MIN_M if keep else w4a16_gemm.DEQUANT_GEMM_MIN_M, keep]
    mma = all(means[m]["default"] >= means[m]["current"] for m in fused_ms)
    if not mma:
        return [current, w4a16_gemm.DEQUANT_GEMM_MIN_M, False]
    best = tb.winners(table, VARIANTS, tuple(m for m in MS if m >= TILES_FROM), shapes)
    planned = tb.new_tiers(best, VARIANTS, mma_order=True)
    if planned is None:
        return [current, w4a16_gemm.MMA_DEQUANT_GEMM_MIN_M, True]
    return [planned[0], planned[1], True]


def summary(table: list[dict]) -> None:
    names = ("current", *VARIANTS)
    print("\n== geometric mean of x bf16 over the shapes ==")
    print("    M " + "".join(f"{n:>19s}" for n in names))
    for m in MS:
        means = vb.geometric_means(table, m, names, len(vb.MID_SHAPES))
        print(f"{m:5d} " + "".join(f"{means[n]:19.2f}" if n in means else f"{'-':>19s}" for n in names))


def main(argv: list[str]) -> None:
    global MS
    model = argv[argv.index("--model") + 1] if "--model" in argv else "qwen3-32b-awq"
    if "--ms" in argv:  # fewer rows for a short call
        MS = tuple(int(m) for m in argv[argv.index("--ms") + 1].split(","))
    print(torch.cuda.get_device_name(), flush=True)
    if "--runs" in argv:  # step 4 alone, with a plan saved by an earlier call (a call is 10 minutes)
        with open(argv[argv.index("--runs") + 1]) as f:
            spec = json.load(f)
    else:
        t0 = time.time()
        if correctness():
            return
        table = times()
        summary(table)
        spec = plan(table, len(vb.MID_SHAPES))
        print(
            f"\nplan [tiers, DEQUANT_GEMM_MIN_M, MMA_ORDER]: {json.dumps(spec)}  ({time.time() - t0:.0f} s)"
        )
        if "--save" in argv:  # for bench/pairs_gpu.sh's OV_W4A16_TIERS and --runs
            with open(argv[argv.index("--save") + 1], "w") as f:
                f.write(json.dumps(spec))
        if "--no-runs" in argv:
            return
    tb.RUN_TIMEOUT_S = RUN_TIMEOUT_S
    args = ["bench", "throughput", "--model", model, "--workload", "seed-512-256"]
    args += ["--load-format", "dummy", "--int-weights", "packed"]
    runs = {"current": tb.ours(args, None), "planned": tb.ours(args, json.dumps(spec))}
    for tag, r in runs.items():
        print(f"{tag}: {json.dumps(r and r['results'][0])}", flush=True)
    before, after = runs["current"], runs["planned"]
    if before and after:
        a, b = after["results"][0]["output_tok_s"], before["results"][0]["output_tok_s"]
        print(f"output tok/s: current {b:,.1f}, planned {a:,.1f}: planned / current {a / b:.3f}x")


if __name__ == "__main__":
    main(sys.argv[1:])
