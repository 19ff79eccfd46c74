"""Weight-only integer GEMM (W4A16 / W8A16): y = x @ dequant(W)^T, the weight dequantized in the kernel.

Reference: w4a16_gemm_ref below. Layout (made once at load, quant/int_formats.kernel_layout):

    x      [M, K] fp16/bf16/fp32, rows contiguous     activations, columns already in group order
    qw     [N, K / P] int32 (P = 32 / BITS)            row n's codes, value j of a word at bits j*BITS
                                                       (or, 4-bit, permuted in MMA order: below)
    scale  [N, K / G] float32                          one per output row and group of G columns
    zero   [N, K / G] float32                          zero points (codes), or none: 2^(BITS-1)

    W[n, k] = (code(n, k) - zero[n, k // G]) * scale[n, k // G]

Why this shape: at decode batch sizes the GEMM is a stream over the weight, so the kernel's worth is in
reading 4 bits per weight instead of 16. A program owns BLOCK_M x BLOCK_N outputs and one SPLIT_K share
of K and walks it BLOCK_K columns at a time (BLOCK_K divides G, so each step has one scale per row).

Kernel "v2" (the default; "v1" is the first version, kernels/w4a16_baseline.py, kept for the benchmark):
- the words are loaded as a [BLOCK_N, BLOCK_K / P] tile, K contiguous, and x's K offsets are declared
  multiples of BLOCK_K, so both are fetched by 16-byte async copies (kernels/w4a16_baseline.py says
  what the first version did); x's rows past M are masked rather than re-read.
- the words unpack in registers by interleaving (kernels/int_unpack.py: value j of word w is column
  w * P + j, the packed order) straight into float32 by the 2^23 exponent trick, no int-to-float
  conversions; the dot takes the transposed view (the weight K-major, as an nn.Linear's).
- swap_ab computes out^T = W x^T: the dequantized weight is the dot's first operand, which Hopper's
  wgmma reads from registers (no shared-memory round trip), and small M gets wgmma m64n16.
- scale_after: the dot runs on (code - zero) (small integers, exact in bf16/fp16) and the fp32 product
  of each step is scaled per output column: BLOCK_M * BLOCK_N multiplies a step instead of BLOCK_N *
  BLOCK_K. It sums the same terms as the reference in another rounding order (the reference rounds each
  scaled weight to x's dtype): differences are at the accumulation's rounding level.
- split-K only when the (M, N) tiles are fewer than the SMs; partial sums either in an fp32 [S, M, N]
  buffer summed in order by one small kernel ("sum": deterministic) or added with fp32 atomics into a
  zeroed [M, N] buffer, then cast ("atomic": the order of the adds, so the last bits, depend on
  scheduling).
- SIGNED codes (two's complement, zero 0) let int8 [N, K] weights (W8A8 layers, viewed as int32 words)
  run through the same kernel as W8A16: kernels/int8_gemm.py's small-M path.

Large M (prefill, throughput decode at 256+ rows) is compute-bound: either the same fused kernel with
large tiles (tensor-core wgmma on Hopper; the weight is read once per BLOCK_M rows), or ("dequant") the
whole weight dequantized into the compute dtype by one kernel and a cuBLAS GEMM.

Which variant runs: default_config (TIERS and the module constants, set from
bench/w4a16_variants_gpu.py's results).
Launches depend only on shapes: safe to capture in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from overnight.kernels.int_unpack import (
    _from_mma_order,
    _int_weight_step,
    _sum_partials_kernel,
    _unpack,
    check_unpack,
    fast_half,
)
from overnight.kernels.w4a16_baseline import _dequant_kernel_v1, _w4a16_kernel_v1

# Defaults, chosen on the GPU (bench/w4a16_variants_gpu.py prints the winners per shape and M); the
# tiles by M are TIERS below. Measured on an H100 (2026-12-05, Qwen3-8B shapes, int4 groups of 128,
# geometric mean over qkv / o / gate_up / down, x bf16 F.linear): swap_ab 1.38x at M=1, 1.40x at 16,
# 0.83x at 64 (unswapped 1.27x, 1.27x, 0.78x); from 256 rows dequantize + cuBLAS 0.50x at 256 and 0.74x
# at 1024 against the fused large tiles' 0.38x and 0.41x. At Qwen3-32B's shapes on an H200 (session V,
# bench/w4a16_tiers_gpu.py): at 128 rows, a decode graph bucket, the 128-row swapped tile 0.49x against
# dequantize + cuBLAS's 0.42x (the 64-row one 0.35x); from 192 rows dequantize wins (0.47-0.58x against
# at best 0.40x). Session W (H100, the same shapes, bench/w4a16_tiers_gpu.py at 96 / 128 / 192 rows, SM
# 1,980 MHz): the "half" unpack's swapped 128-row tile took 65-128 rows and the 64-row swapped tile
# 129-192 (TIERS' comments); from 256 rows dequantize + cuBLAS still wins (0.45x at 256, 0.57x at
# 512, against at best 0.43x and 0.39x for a fused tile). Session Y (H100, bench/w4a16_mma_gpu.py, the
# same shapes, SM 1,980 MHz, x bf16 F.linear): words in MMA order took every fused tier up (16 rows
# 1.38x -> 1.76x, 64 0.85x -> 1.18x, 128 0.67x -> 0.80x, 192 0.46x -> 0.68x) and made fused tiles beat
# dequantize + cuBLAS up to 384 rows (256: 0.58x against 0.45x; 384: 0.51x against 0.50x; 512: 0.52x
# against 0.57x), hence a threshold per order.
DEQUANT_GEMM_MIN_M = 193  # from this many rows on: the large-M path (words in column order)
MMA_DEQUANT_GEMM_MIN_M = 385  # the same for words in MMA order
LARGE_M_PATH = "dequant"  # "fused": the fused kernel with large tiles; "dequant": dequantize + cuBLAS
KERNEL = "v2"  # the fused kernel: "v2" (vector loads) or "v1" (the first version)
DEQUANT_KERNEL = "v2"  # the whole-weight dequantization: "v2" (tiles, vector loads) or "v1"
# v2's program order: True walks K first, so consecutive programs write along the same output rows;
# False walks N first. At Qwen3-32B's shapes and 530 rows on an H100 (bench/w4a16_dequant_gpu.py,
# session AC) K first dequantizes gate_up in 237 us against 295 (2.76 against 2.22 TB/s) and down in
# 120 against 132, whatever the tile; the 32B AWQ FP8-cache pair went 1.02x -> 1.06x vLLM.
DEQUANT_K_MAJOR = True
MMA_ORDER = True  # the layers hold their 4-bit words in MMA order (below) where they fit
_SMS = 132  # an H100/H200 SXM
_TARGET_PROGRAMS = 264  # split-K aims at ~2 waves


@dataclass(frozen=True)
class W4A16Config:
    """One variant of the GEMM (the module docstring says what each option does).

    split_k      0: chosen from the shape (v2: only when the tiles are fewer than the SMs)
    block_k      a cap on the K step (0: 128); the step is the largest of 128/64/32/16 dividing the group
    kernel       "v2" or "v1" (the first version)
    scale_after  v2: scale the dot's fp32 product per column instead of each weight element
    swap_ab      v2: out^T = W x^T, the dequantized weight the dot's first operand (wgmma reads it from
                 registers)
    reduce       split-K's partial sums: "sum" (deterministic) or "atomic"
    path         "fused", or "dequant" (w4a16_linear: the whole weight dequantized, then cuBLAS)
    unpack       v2: "f32" (codes to float32 values, then x's dtype), or "half" (kernels/int_unpack.py's
                 _unpack_scaled: 4-bit codes straight to scaled 16-bit weights in paired instructions,
                 the scale rounded to x's dtype first; needs scale_after False)
    """

    block_m: int
    block_n: int
    split_k: int = 0
    num_warps: int = 4
    num_stages: int = 4
    block_k: int = 0
    kernel: str = "v2"
    scale_after: bool = True
    swap_ab: bool = False
    reduce: str = "sum"
    path: str = "fused"
    unpack: str = "f32"

    def __post_init__(self) -> None:
        if self.kernel not in ("v1", "v2") or self.reduce not in ("sum", "atomic"):
            raise ValueError(f"unknown kernel {self.kernel!r} or split-K reduce {self.reduce!r}")
        if self.path not in ("fused", "dequant"):
            raise ValueError(f"unknown path {self.path!r}: 'fused' or 'dequant'")
        if self.kernel == "v1" and (self.reduce == "atomic" or self.swap_ab or self.unpack != "f32"):
            raise ValueError("the v1 kernel has no atomic reduce, no swap_ab and no unpack (v2 options)")
        check_unpack(self.unpack, self.scale_after)


# The default variant by M: the first tier whose bound is >= M. bench/w4a16_variants_gpu.py prints each
# variant's W4A16Config: the winners go here. Up to 64 rows the GEMM streams the weight (scale_after,
# split-K below the SM count); from DEQUANT_GEMM_MIN_M on it is compute-bound: one program per tile
# (split-K's fp32 partial sums would cost more than idle SMs), 64-row tiles (one warpgroup's wgmma)
# below 512 rows so N = 4096 layers still make 128 tiles.
TIERS: tuple[tuple[int, W4A16Config], ...] = (
    (16, W4A16Config(16, 64, swap_ab=True)),
    (32, W4A16Config(32, 64, swap_ab=True)),
    (64, W4A16Config(64, 64, swap_ab=True)),
    # rows 65-128: the 128-row swapped tile with the "half" unpack (session W, H100, Qwen3-32B shapes:
    # 0.74x bf16 at 96 rows and 0.70x at 128, against 0.66x / 0.65x for the same tile on the float32
    # unpack and at most 0.52x / 0.64x for the 64-row tile and dequantize + cuBLAS)
    (128, W4A16Config(128, 128, 0, 8, 3, 128, scale_after=False, swap_ab=True, unpack="half")),
    (192, W4A16Config(64, 64, swap_ab=True)),  # 0.48x against dequantize's 0.45x at 192 rows (session W)
    # rows 193-384, reached on words in MMA order only (MMA_DEQUANT_GEMM_MIN_M; session Y): 256 x 128
    # swapped tiles to 256 rows (0.58x bf16, dequantize + cuBLAS 0.45x), 128 x 128 to 384 (0.51x, 0.50x)
    (256, W4A16Config(256, 128, 0, 8, 3, 128, scale_after=False, swap_ab=True, unpack="half")),
    (384, W4A16Config(128, 128, 0, 8, 3, 128, scale_after=False, swap_ab=True, unpack="half")),
    # the fused large tiles (LARGE_M_PATH "fused"), kept for the bench and for LARGE_M_PATH's other value
    (511, W4A16Config(64, 128, 1, 4, 4, 128, scale_after=False)),
    (1 << 62, W4A16Config(128, 128, 1, 8, 3, 64, scale_after=False)),
)
# The first version's tiers ("v1"): dequantize + cuBLAS from 256 rows.
V1_TIERS: tuple[tuple[int, W4A16Config], ...] = (
    (16, W4A16Config(16, 64, kernel="v1")),
    (32, W4A16Config(32, 64, kernel="v1")),
    (64, W4A16Config(64, 64, kernel="v1")),
    (255, W4A16Config(64, 128, kernel="v1")),
    (1 << 62, W4A16Config(64, 128, kernel="v1", path="dequant")),
)


def default_config(m: int, mma_order: bool = False) -> W4A16Config:
    """The variant for M rows: KERNEL's tiers; with LARGE_M_PATH "dequant", from DEQUANT_GEMM_MIN_M rows
    (MMA_DEQUANT_GEMM_MIN_M for words in MMA order) on the whole weight is dequantized for cuBLAS
    instead."""
    tiers = V1_TIERS if KERNEL == "v1" else TIERS
    cfg = next(c for bound, c in tiers if m <= bound)
    min_m = MMA_DEQUANT_GEMM_MIN_M if mma_order else DEQUANT_GEMM_MIN_M
    if KERNEL != "v1" and m >= min_m and LARGE_M_PATH == "dequant":
        return replace(cfg, path="dequant")
    return cfg


# Speed-up over a bf16 F.linear of the same rows, each tier's tile at its bound, on MMA-ordered words
# (session Y, H100, SM 1,980 MHz, bench/w4a16_mma_gpu.py: geometric mean over Qwen3-32B's qkv / o /
# gate_up / down, int4 groups of 128 with zero points). decode_row_caps reads them.
MMA_TIER_SPEEDUPS: dict[int, float] = {64: 1.18, 128: 0.80, 192: 0.68, 256: 0.58, 384: 0.51}


def decode_row_caps(
    tiers: tuple[tuple[int, W4A16Config], ...] = TIERS,
    speedups: dict[int, float] | None = None,
) -> tuple[tuple[int, int], ...]:
    """(cap, upto) pairs for the scheduler (SchedulerConfig.decode_row_caps): a decode step of
    cap < D <= upto rows computes cap of them, the rest the next step.

    Why: a tier whose rows (cap, B] all take the same number of row tiles takes one time for any D
    there, about its time at B (the tile computes its padding rows too; at decode sizes the weight is
    read once per row tile). Qwen3-32B-AWQ on an H100 decodes ~265 requests a step (its KV pool's
    limit), which the 128 x 128 tier pads to 384 rows; 256 of them run one 256 x 128 tile.
    When is it worth serving fewer rows: the step's time, normalised to 1 at cap rows, is s k + (1 - s) x
    at x = D / cap, where s is the GEMMs' share and k their time at B over their time at cap; the rest
    grows with the rows. D rows give fewer tokens a second than cap rows while x / t(x) < 1, i.e.
    while x < k, whatever s. The bench gives k's lower bound: k = (speedup at cap / speedup at B)
    (t_bf16(B) / t_bf16(cap)), the second factor at least 1 (a bf16 GEMM of more rows is not faster),
    so upto = cap * speedup(cap) / speedup(B), rounded down and within the tier. Words in MMA order
    only (the tiers past 192 rows need them); a tier boundary without both measured speed-ups gives no
    cap. Measured (session AA, an H100): 265 decodes run as 256 made the 32B's run 1.14x faster."""
    speedups = MMA_TIER_SPEEDUPS if speedups is None else speedups
    caps = []
    for (cap, _), (bound, cfg) in zip(tiers, tiers[1:]):
        tiles = -(-bound // cfg.block_m)
        if -(-(cap + 1) // cfg.block_m) != tiles or cap not in speedups or bound not in speedups:
            continue  # the tier's time grows with the rows, or is not measured
        if bound >= MMA_DEQUANT_GEMM_MIN_M:
            break
        upto = min(bound, int(cap * speedups[cap] / speedups[bound] - 1e-9))
        if upto > cap:
            caps.append((cap, upto))
    return tuple(caps)


@triton.jit(do_not_specialize=["M"])
def _w4a16_kernel(
    x_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_om,
    stride_os,
    k_per_split,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    SIGNED: tl.constexpr,
    SCALE_AFTER: tl.constexpr,
    SWAP_AB: tl.constexpr,
    ATOMIC: tl.constexpr,
    HALF: tl.constexpr,
    FAST: tl.constexpr,
    MMA_ORDER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    PER: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = BLOCK_K // PER
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    rows_m = tl.minimum(offs_m, M - 1)
    rows_n = tl.minimum(offs_n, N - 1)  # clamped reads, masked stores
    offs_k = tl.arange(0, BLOCK_K)
    offs_w = tl.arange(0, WORDS)
    if SWAP_AB:  # out^T = W x^T: the weight tile is the dot's first operand
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    next_scale = tl.load(s_ptr + rows_n * stride_sn + tl.minimum(k_start, K - 1) // GROUP)
    # BLOCK_K divides the group and the group K: no step runs past K, so no K masks
    for k0 in range(k_start, k_end, BLOCK_K):
        # k0 is a multiple of BLOCK_K (k_per_split is): said so, the loads vectorize (a hint on the
        # loop variable itself is lost)
        kx = tl.max_contiguous(tl.multiple_of(k0 + offs_k, BLOCK_K), BLOCK_K)
        # rows past M are masked, not clamped: a 16-row tile at M = 1 would otherwise read x 16 times
        # from L2 (as many bytes as the packed weight) just to fill the MMA's rows
        x = tl.load(x_ptr + rows_m[:, None] * stride_xm + kx[None, :], mask=m_ok[:, None], other=0.0)
        kw = tl.max_contiguous(tl.multiple_of(k0 // PER + offs_w, WORDS), WORDS)
        words = tl.load(qw_ptr + rows_n[:, None] * stride_qn + kw[None, :])
        g = k0 // GROUP
        if SCALE_AFTER:
            # loaded one step ahead: Triton pipelines only loads that feed a dot, and this one's
            # latency would otherwise stall every step
            scale = next_scale
            next_scale = tl.load(s_ptr + rows_n * stride_sn + tl.minimum(k0 + BLOCK_K, K - 1) // GROUP)
        else:
            scale = tl.load(s_ptr + rows_n * stride_sn + g)
        if HAS_ZERO:
            zero = tl.load(z_ptr + rows_n * stride_sn + g)
        else:
            zero = scale  # unread
        acc = _int_weight_step(
            acc, x, words, scale, zero, BITS, SIGNED, HAS_ZERO, SCALE_AFTER, SWAP_AB, DOT_PRECISION,
            HALF, FAST, MMA_ORDER,
        )  # fmt: skip
    if SWAP_AB:
        acc = tl.trans(acc)
    ok = m_ok[:, None] & (offs_n[None, :] < N)
    if ATOMIC:
        tl.atomic_add(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc, mask=ok, sem="relaxed")
    else:
        out = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _dequant_kernel(
    qw_ptr,
    s_ptr,
    z_ptr,
    w_ptr,
    N,
    stride_qn,
    stride_sn,
    stride_wn,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    SIGNED: tl.constexpr,
    MMA_ORDER: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_MAJOR: tl.constexpr = False,
):
    """One [BLOCK_N, BLOCK_K] tile (BLOCK_K divides the group): words read once as 16-byte vectors, one
    scale per row, the tile stored row-contiguous (MMA_ORDER: put back in column order first).
    K_MAJOR: the grid's first axis walks K (programs launched one after another write along the same
    rows) instead of N (they write the same columns of rows BLOCK_N apart)."""
    PER: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = BLOCK_K // PER
    pid_n = tl.program_id(1) if K_MAJOR else tl.program_id(0)
    pid_k = tl.program_id(0) if K_MAJOR else tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_n = tl.minimum(offs_n, N - 1)
    k0 = tl.multiple_of(pid_k * BLOCK_K, BLOCK_K)
    kw = tl.multiple_of(k0 // PER, WORDS)
    words = tl.load(qw_ptr + rows_n[:, None] * stride_qn + (kw + tl.arange(0, WORDS))[None, :])
    g = k0 // GROUP
    if HAS_ZERO:
        vals = _unpack(words, BITS, SIGNED, tl.load(z_ptr + rows_n * stride_sn + g)[:, None])
    else:
        vals = _unpack(words, BITS, SIGNED, (1 << (BITS - 1)) * 1.0)
    if MMA_ORDER:
        vals = _from_mma_order(vals, BLOCK_N, BLOCK_K)
    w = vals * tl.load(s_ptr + rows_n * stride_sn + g)[:, None]
    out = w_ptr + offs_n[:, None] * stride_wn + (k0 + tl.arange(0, BLOCK_K))[None, :]
    tl.store(out, w.to(w_ptr.dtype.element_ty), mask=offs_n[:, None] < N)


def _check(
    qw: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bits: int,
    group: int,
    k: int,
    mma_order: bool = False,
) -> None:
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if mma_order and not mma_order_fits(bits, group, k):
        raise ValueError(f"MMA order needs 4-bit codes and groups of a multiple of {MMA_BLOCK} columns")
    n = qw.shape[0]
    if qw.dtype != torch.int32 or qw.dim() != 2 or qw.shape[1] * (32 // bits) != k or qw.stride(1) != 1:
        raise ValueError(
            f"qw must be int32 [N, K*{bits}/32] with contiguous rows, got {qw.dtype} {list(qw.shape)}"
        )
    if group <= 0 or k % group:
        raise ValueError(f"group size {group} does not divide K={k}")
    groups = (n, k // group)
    if scale.dtype != torch.float32 or tuple(scale.shape) != groups or scale.stride(1) != 1:
        raise ValueError(f"scale must be float32 {list(groups)}, got {scale.dtype} {list(scale.shape)}")
    if zero is not None and (
        zero.dtype != torch.float32 or zero.shape != scale.shape or zero.stride() != scale.stride()
    ):
        raise ValueError(f"zero must be float32 {list(groups)} laid out as scale, got {list(zero.shape)}")


def _block_k(group: int, cap: int = 0) -> int:
    """The largest of 128 / 64 / 32 / 16 dividing the group (and at most cap when given)."""
    for bk in (128, 64, 32, 16):
        if group % bk == 0 and (not cap or bk <= cap):
            return bk
    raise ValueError(f"group size {group} is not a multiple of 16")


def _split_k(cfg: W4A16Config, tiles: int, steps: int) -> int:
    if cfg.split_k:
        return cfg.split_k
    if cfg.kernel == "v1":  # the first version's rule: aim at _TARGET_PROGRAMS whatever the tiles
        return max(1, min(steps, _TARGET_PROGRAMS // tiles, 16))
    if tiles >= _SMS:
        return 1
    return max(1, min(steps, triton.cdiv(_TARGET_PROGRAMS, tiles), 16))


# MMA order (mma_order=True; 4-bit codes, groups a multiple of 128 columns). In the natural order a
# word holds 8 neighbouring columns, so a swapped tile's unpacked weights sit in the wrong threads for
# wgmma's register operand and go through shared memory to get there (a store, a barrier and ldmatrix
# each K step). In MMA order each row's words are permuted within every 128-column block so that a
# thread's word holds the 8 values it holds of the operand (two register pairs in each of two k16
# steps): word 4t + c of a block holds columns 32c + 16s + 8h + 2t + e as value 4s + 2h + e (t: the
# thread's place in its quad; c: the block's 32-column chunk; s, h: the k16 step and register half;
# e: the pair's element), and a thread's four words of a block are one 16-byte shared-memory load.
# The kernels unpack as usual and put the columns back with a reshape and a permute that the compiler
# resolves in registers (kernels/int_unpack.py's _from_mma_order); x keeps its order.
MMA_BLOCK = 128


def mma_order_fits(bits: int, group: int, k: int) -> bool:
    """Whether a weight can be held in MMA order: 4-bit codes, every K step inside one group."""
    return bits == 4 and group % MMA_BLOCK == 0 and k % MMA_BLOCK == 0


def _codes(qw: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [N, W] words -> [N, W * 32 / bits] codes, value j of word w at column w * (32 / bits) + j."""
    shifts = torch.arange(0, 32, bits, device=qw.device, dtype=torch.int32)
    return ((qw.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(qw.shape[0], -1)


def _mma_columns(device: torch.device) -> torch.Tensor:
    """Position p = 8w + j of a 128-column block in MMA order -> the column it holds."""
    p = torch.arange(MMA_BLOCK, device=device)
    w, j = p // 8, p % 8
    t, c, s, h, e = w // 4, w % 4, j // 4, (j // 2) % 2, j % 2
    return 32 * c + 16 * s + 8 * h + 2 * t + e


def to_mma_order(qw: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """int32 [N, K/8] words of 4-bit codes (value j of a word at bits 4j) in column order -> MMA order;
    inverse: back. Row chunks bound the temporaries (the largest layers are ~100 MB packed)."""
    n, words = qw.shape
    cols = _mma_columns(qw.device)
    if inverse:
        cols = torch.argsort(cols)
    shifts = torch.arange(0, 32, 4, device=qw.device, dtype=torch.int32)
    out = torch.empty_like(qw)
    rows = max(1, (32 << 20) // max(1, words * 8))
    for r in range(0, n, rows):
        chunk = qw[r : r + rows]
        codes = _codes(chunk, 4).reshape(chunk.shape[0], -1, MMA_BLOCK)[:, :, cols]
        fields = codes.reshape(chunk.shape[0], words, 8) << shifts  # the top field wraps into the sign
        word = fields[..., 0]
        for i in range(1, 8):
            word = word | fields[..., i]
        out[r : r + rows] = word
    return out


def w4a16_gemm(
    x: torch.Tensor,
    qw: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bits: int,
    group: int,
    split_k: int | None = None,
    config: W4A16Config | None = None,
    signed: bool = False,
    mma_order: bool = False,
) -> torch.Tensor:
    """x [M, K] @ dequant(qw)^T -> [M, N] in x's dtype, the fused kernel (see the module docstring);
    split_k: None picks (or config.split_k when set). signed: two's complement codes with no zero point
    (int8 weights viewed as words; v2 only). mma_order: qw is in MMA order (to_mma_order; the K step is
    then 128 columns whatever the config's cap)."""
    m, k = x.shape
    n = qw.shape[0]
    _check(qw, scale, zero, bits, group, k, mma_order)
    if x.stride(1) != 1:
        x = x.contiguous()
    cfg = config or default_config(m, mma_order)
    if signed and (cfg.kernel != "v2" or zero is not None):
        raise ValueError("signed codes need the v2 kernel and no zero points")
    if mma_order and cfg.kernel != "v2":
        raise ValueError("words in MMA order need the v2 kernel")
    block_k = MMA_BLOCK if mma_order else _block_k(group, cfg.block_k)
    block_m, block_n = cfg.block_m, cfg.block_n
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    steps = triton.cdiv(k, block_k)
    if split_k is None:
        split_k = _split_k(cfg, tiles, steps)
    per_split = triton.cdiv(steps, split_k) * block_k
    split_k = triton.cdiv(k, per_split)
    atomic = split_k > 1 and cfg.reduce == "atomic"
    if split_k == 1:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    elif atomic:
        out = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    else:
        out = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split_k)
    args = (x, qw, scale, zero if zero is not None else scale, out, m, n, k, x.stride(0), qw.stride(0))
    args += (scale.stride(0), out.stride(-2), out.stride(0) if out.dim() == 3 else 0, per_split)
    # fp32 models get fp32 products (torch's default for fp32 matmuls), not TF32
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    common = dict(BITS=bits, GROUP=group, HAS_ZERO=zero is not None, BLOCK_M=block_m, BLOCK_N=block_n)
    common.update(
        BLOCK_K=block_k, DOT_PRECISION=precision, num_warps=cfg.num_warps, num_stages=cfg.num_stages
    )
    if cfg.kernel == "v1":
        _w4a16_kernel_v1[grid](*args, **common)
    else:
        _w4a16_kernel[grid](
            *args, SIGNED=signed, SCALE_AFTER=cfg.scale_after, SWAP_AB=cfg.swap_ab, ATOMIC=atomic,
            HALF=cfg.unpack == "half", FAST=fast_half(cfg.unpack, bits, signed, x.dtype), MMA_ORDER=mma_order,
            **common,
        )  # fmt: skip
    if split_k == 1:
        return out
    if atomic:
        return out.to(x.dtype)
    if cfg.kernel == "v1":  # the first version's reduce, as measured
        return out.sum(0).to(x.dtype)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block = 1024
    _sum_partials_kernel[(triton.cdiv(m * n, block),)](out, y, m * n, split_k, BLOCK=block)
    return y


def dequantize_int_weight(
    qw: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bits: int,
    group: int,
    dtype: torch.dtype,
    kernel: str | None = None,
    mma_order: bool = False,
) -> torch.Tensor:
    """The whole weight [N, K] in `dtype` (the "dequant" path's first half); kernel: DEQUANT_KERNEL
    when None. mma_order: qw is in MMA order (to_mma_order; the v2 kernel)."""
    n = qw.shape[0]
    k = qw.shape[1] * (32 // bits)
    _check(qw, scale, zero, bits, group, k, mma_order)
    w = torch.empty(n, k, dtype=dtype, device=qw.device)
    z = zero if zero is not None else scale
    if (kernel or DEQUANT_KERNEL) == "v1":
        if mma_order:
            raise ValueError("words in MMA order need the v2 dequantization")
        grid = (triton.cdiv(n, 32), triton.cdiv(k, 128))
        args = (qw, scale, z, w, n, k, qw.stride(0), scale.stride(0), w.stride(0))
        _dequant_kernel_v1[grid](
            *args, BITS=bits, GROUP=group, HAS_ZERO=zero is not None, BLOCK_N=32, BLOCK_K=128
        )
        return w
    dequantize_into(w, qw, scale, zero, bits, group, mma_order)
    return w


def dequantize_into(
    w: torch.Tensor,
    qw: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bits: int,
    group: int,
    mma_order: bool = False,
    block_n: int = 32,
    num_warps: int = 4,
    k_major: bool | None = None,
) -> None:
    """The v2 dequantization into w [N, K] (checked by the caller). block_n, num_warps and k_major
    (DEQUANT_K_MAJOR when None) are the tile and program order; bench/w4a16_dequant_gpu.py varies them."""
    n, k = w.shape
    block_k = _block_k(group)
    k_first = DEQUANT_K_MAJOR if k_major is None else k_major
    grid = (triton.cdiv(n, block_n), k // block_k)
    _dequant_kernel[grid[::-1] if k_first else grid](
        qw,
        scale,
        zero if zero is not None else scale,
        w,
        n,
        qw.stride(0),
        scale.stride(0),
        w.stride(0),
        BITS=bits,
        GROUP=group,
        HAS_ZERO=zero is not None,
        SIGNED=False,
        MMA_ORDER=mma_order,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        K_MAJOR=k_first,
        num_warps=num_warps,
    )


def w4a16_linear(
    x: torch.Tensor,
    qw: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bits: int,
    group: int,
    config: W4A16Config | None = None,
    mma_order: bool = False,
) -> torch.Tensor:
    """The layer's GEMM: the variant default_config(M) names (or `config`): the fused kernel, or for
    path "dequant" the whole weight dequantized and a cuBLAS GEMM. mma_order: qw is in MMA order."""
    cfg = config or default_config(x.shape[0], mma_order)
    if cfg.path == "dequant":
        kernel = "v1" if cfg.kernel == "v1" else None
        return x @ dequantize_int_weight(qw, scale, zero, bits, group, x.dtype, kernel, mma_order).t()
    return w4a16_gemm(x, qw, scale, zero, bits, group, config=cfg, mma_order=mma_order)


def dequantize_int_weight_ref(
    qw: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bits: int,
    group: int,
    dtype: torch.dtype,
    mma_order: bool = False,
) -> torch.Tensor:
    if mma_order:
        qw = to_mma_order(qw, inverse=True)
    per = 32 // bits
    codes = _codes(qw, bits)
    z = zero if zero is not None else torch.full_like(scale, float(1 << (bits - 1)))
    g = torch.arange(qw.shape[1] * per, device=qw.device) // group
    return ((codes.float() - z[:, g]) * scale[:, g]).to(dtype)


def w4a16_gemm_ref(
    x: torch.Tensor,
    qw: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bits: int,
    group: int,
    mma_order: bool = False,
) -> torch.Tensor:
    """x @ W^T with W dequantized to x's dtype and the product accumulated in fp32."""
    w = dequantize_int_weight_ref(qw, scale, zero, bits, group, x.dtype, mma_order)
    return (x.float() @ w.float().t()).to(x.dtype)
