"""Grouped GEMM of a mixture-of-experts layer on integer expert weights (W4A16 / W8A16): moe_gemm.py's
sorted-pair scheme with w4a16_gemm.py's in-kernel dequantization.

Reference: w4a16_fused_experts_ref (below).

    a       [A, K] rows gathered per pair (A_DIV as in moe_gemm.py)
    qw      [E, N, K / P] int32, P = 32 / BITS values per word, low bits first (int_formats.py)
    scale   [E, N, K / G] float32, zero the same or none (2^(BITS-1))
    out     [P, N]: gated -> silu(gate) * up with qw holding [gate | up] rows; else times the pair's
            routing weight

W[e, n, k] = (code - zero[e, n, k // G]) * scale[e, n, k // G]. BLOCK_K divides G, so each K step has
one scale per weight row. Tiles past num_padded return at once: a launch depends only on shapes, safe
in a CUDA graph.

Kernel "v2" (the default; "v1" is the first version, kernels/w4a16_moe_baseline.py, which says why it
was slow past ~128 tokens) takes the dense kernel's K step (kernels/int_unpack.py's _int_weight_step,
inlined): the [BLOCK_N, BLOCK_K / P] words of a row tile K-contiguous by 16-byte copies (a's gathered
rows too), unpacked in registers (one fused and-mask and one FMA a weight, no int-to-float conversion,
no shared-memory reshape), the dot on the weight's transposed view; scale_after (the dot on code -
zero, its fp32 product scaled per column) where the tile has few rows, the weights scaled before the
dot at large tiles (wgmma then chains its accumulator); swap_ab (out^T = W a^T: the dequantized tile
is wgmma's register operand, m64n16 at 16 rows). The SASS of a gated 16-row K step: 545 instructions
against the first version's 1,032 (and its 128 conversions at 1/8 rate). What matters most at large
batches is BLOCK_M, the alignment's padding: the dequantization's ALU work is paid once per BLOCK_M
rows, so the tiers below grow it with the rows each expert gets (the first version kept 16 at every
size), and GROUP_M row tiles of one expert sweep a column tile together (kernels/tile_order.py) so its
words come from L2.

MMA order (mma_order=True; kernels/w4a16_gemm.py's to_mma_order on each expert's rows, 4-bit codes in
groups of a multiple of 128 columns): the same kernel with 128-deep K steps puts each thread's unpacked
values in wgmma's register-operand layout, as the dense kernel does (where it measured 1.2-1.5x on
every swapped tier); quant/int_moe.py's IntExperts converts after loading when MMA_ORDER is on, and
default_config then takes MMA_TIERS.

Which variant runs: default_config (TIERS, or MMA_TIERS on words in MMA order; KERNEL "v1" for the
first version), set from bench/w4a16_variants_gpu.py's MoE section and bench/w4a16_moe_mma_gpu.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from overnight.kernels.int_unpack import _int_weight_step, check_unpack, fast_half
from overnight.kernels.moe_align import ExpertRuns, moe_align
from overnight.kernels.moe_sum import moe_sum
from overnight.kernels.tile_order import grouped_tile
from overnight.kernels.w4a16_gemm import MMA_BLOCK, mma_order_fits, to_mma_order
from overnight.kernels.w4a16_moe_baseline import _w4a16_moe_kernel_v1

KERNEL = "v2"  # "v2", or "v1" (the first version, at its one tile)
# The experts hold their 4-bit words in MMA order where they fit (module docstring), with MMA_TIERS.
# bench/w4a16_moe_mma_gpu.py on an H100 (2026-12-07, docs/performance.md's session Z): faster at every
# token count than column order with TIERS, 1.20 -> 1.50x bf16 at 1 token, 1.79 -> 2.32x at 128,
# 1.43 -> 1.57x at 512, 0.71 -> 0.85x at 4,096.
MMA_ORDER = True


@dataclass(frozen=True)
class IntMoeTiles:
    """One grouped GEMM's tiles (BLOCK_M is the alignment's, shared by both GEMMs). block_k caps the K
    step (the largest of 128/64/32/16 dividing the group). The v1 kernel reads block_n, block_k,
    num_warps and num_stages only."""

    block_n: int = 64
    block_k: int = 128
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3
    scale_after: bool = True
    swap_ab: bool = False
    unpack: str = "f32"  # or "half": kernels/w4a16_gemm.py's W4A16Config says what each does

    def __post_init__(self) -> None:
        check_unpack(self.unpack, self.scale_after)


@dataclass(frozen=True)
class W4A16MoeConfig:
    block_m: int
    gemm1: IntMoeTiles  # gate/up with SiLU-and-mul: x [T, H] -> [P, I]
    gemm2: IntMoeTiles  # down, times the routing weight: [P, I] -> [P, H]
    kernel: str = "v2"

    def __post_init__(self) -> None:
        if self.kernel not in ("v1", "v2"):
            raise ValueError(f"unknown MoE int kernel {self.kernel!r}: 'v1' or 'v2'")
        if self.block_m not in (16, 32, 64, 128):
            raise ValueError(f"block_m must be 16, 32, 64 or 128, got {self.block_m}")


_V1 = IntMoeTiles(64, 128, 1, 4, 3)
# The first version as it ran (BLOCK_M 16 at every size).
V1_CONFIG = W4A16MoeConfig(16, _V1, _V1, kernel="v1")
_SWAP = IntMoeTiles(64, 128, 1, 4, 3, True, True)
# The default by the rows each expert gets on average, tokens * top_k / experts (Qwen3-30B-A3B: tokens /
# 16): the first tier whose bound is >= it. BLOCK_M grows with the rows, so each word is unpacked once
# per BLOCK_M rows (the first version's fault). Up to 24 rows: swap_ab with the scale after the dot
# (wgmma m64n16/n32, the weight the register operand); compiled for sm_90 it issues 545 instructions a
# gated K step of 16 rows against 731 for the same tile unswapped (mma.sync, whose operand shuffles
# cost ~180 integer moves) and 1,032 for the first version. From 64 rows: wgmma with the scale on the
# weights (the accumulator chains), gated column tiles as wide as the registers allow (two
# accumulators), ~5-6 instructions a weight element. All read compiled for sm_90: no spills, 16-byte
# copies, wgmma (tests/test_kernels_w4a16_moe_sm90.py). bench/w4a16_variants_gpu.py --moe prints the
# winners per token count as lines of this table.
# Measured on an H100 (2026-12-05, Qwen3-30B-A3B shapes, geometric mean of zero-point and symmetric
# checkpoints, x the bf16 fused MoE): 16 rows swapped 1.20x at 1 token, 1.70x at 16, 1.79x at 128; at
# 512 and 1024 tokens (32 and 64 rows an expert) 64-row tiles with 64-deep K steps 1.49x and 1.14x (the
# 128-deep ones 1.46x, 1.08x); at 4096 (256 rows) 128-row swapped tiles 0.71x (unswapped 0.67x). The
# 32-row tier (rows 9-24) had no measured point: kept from the sm_90 reading.
TIERS: tuple[tuple[float, W4A16MoeConfig], ...] = (
    (8, W4A16MoeConfig(16, _SWAP, _SWAP)),
    (24, W4A16MoeConfig(32, _SWAP, _SWAP)),
    (64, W4A16MoeConfig(64, IntMoeTiles(64, 64, 8, 4, 4, False), IntMoeTiles(128, 64, 8, 4, 4, False))),
    (
        float("inf"),
        W4A16MoeConfig(
            128, IntMoeTiles(128, 64, 8, 8, 3, False, True), IntMoeTiles(128, 128, 8, 8, 3, False, True)
        ),
    ),
)


# On words in MMA order the 64-row tier is swapped too (its weights wgmma's register operand, where
# MMA order puts them with no shuffle). Measured on an H100 (2026-12-07, the same shapes and means as
# above): 1.57x at 512 tokens and 1.16x at 1,024, where TIERS' unswapped 64-row tier gives 1.33x and
# 0.99x on MMA-ordered words (its 64-deep K step, its best, is not open to them) and 1.43x and 1.11x on
# column-order words. The other tiers are TIERS' own: MMA order made each faster (1.50x at 1 token,
# 2.23x at 16, 2.32x at 128, 0.85x at 4,096).
MMA_TIERS: tuple[tuple[float, W4A16MoeConfig], ...] = (
    TIERS[0],
    TIERS[1],
    (
        64,
        W4A16MoeConfig(
            64, IntMoeTiles(64, 64, 8, 4, 4, False, True), IntMoeTiles(128, 64, 8, 4, 4, False, True)
        ),
    ),
    TIERS[3],
)


def default_config(num_tokens: int, top_k: int, num_experts: int, mma_order: bool = False) -> W4A16MoeConfig:
    """The variant for a batch: KERNEL "v1" -> V1_CONFIG, else the tier of its rows per expert, from
    MMA_TIERS where the words are in MMA order."""
    if KERNEL == "v1":
        return V1_CONFIG
    rows = num_tokens * top_k / num_experts
    return next(cfg for bound, cfg in (MMA_TIERS if mma_order else TIERS) if rows <= bound)


def _fit_operand_size(tiles: IntMoeTiles, dtype: torch.dtype, mma_order: bool) -> IntMoeTiles:
    """fp32 activations (exactness checks, never a fast path) take twice the shared memory of the
    16-bit ones the tiles are sized for: 32-deep steps in two stages fit every tier; MMA order's
    128-deep steps fit in one stage."""
    if dtype == torch.float32 and mma_order:
        return replace(tiles, num_stages=1)
    if dtype == torch.float32:
        return replace(tiles, block_k=min(tiles.block_k, 32), num_stages=min(tiles.num_stages, 2))
    return tiles


@triton.jit(do_not_specialize=["num_pairs", "num_tiles_m"])
def _w4a16_moe_kernel(
    a_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    out_ptr,
    topk_weights_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_padded_ptr,
    N,
    K,
    num_pairs,
    num_tiles_m,
    stride_am,
    stride_qe,
    stride_qn,
    stride_se,
    stride_sn,
    stride_om,
    A_DIV: tl.constexpr,
    GATED: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    SCALE_AFTER: tl.constexpr,
    SWAP_AB: tl.constexpr,
    HALF: tl.constexpr,
    FAST: tl.constexpr,
    MMA_ORDER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    PER: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = BLOCK_K // PER
    pid_m, pid_n = grouped_tile(tl.program_id(0), num_tiles_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pair < num_pairs  # padding rows are masked, never read
    a_rows = a_ptr + (pair // A_DIV).to(tl.int64)[:, None] * stride_am
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_n = tl.minimum(offs_n, N - 1).to(tl.int64)  # clamped reads, masked stores
    q_rows = qw_ptr + expert * stride_qe + rows_n[:, None] * stride_qn
    s_rows = s_ptr + expert * stride_se + rows_n * stride_sn
    z_rows = z_ptr + expert * stride_se + rows_n * stride_sn
    up_q = N * stride_qn  # GATED: the up rows follow the N gate rows
    up_s = N * stride_sn
    offs_k = tl.arange(0, BLOCK_K)
    offs_w = tl.arange(0, WORDS)
    if SWAP_AB:  # out^T = W a^T
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros_like(acc)
    # SCALE_AFTER: the scales multiply the dot's product, so Triton does not pipeline their loads;
    # each is loaded one step ahead instead
    next_scale = tl.load(s_rows)
    next_up_scale = tl.load(s_rows + up_s) if GATED else next_scale
    # BLOCK_K divides the group and the group K: no step runs past K, so no K masks
    for k0 in range(0, K, BLOCK_K):
        kx = tl.max_contiguous(tl.multiple_of(k0 + offs_k, BLOCK_K), BLOCK_K)
        a = tl.load(a_rows + kx[None, :], mask=row_ok[:, None], other=0.0)
        kw = tl.max_contiguous(tl.multiple_of(k0 // PER + offs_w, WORDS), WORDS)
        g = k0 // GROUP
        words = tl.load(q_rows + kw[None, :])
        if SCALE_AFTER:
            scale = next_scale
            next_scale = tl.load(s_rows + tl.minimum(k0 + BLOCK_K, K - 1) // GROUP)
        else:
            scale = tl.load(s_rows + g)
        zero = tl.load(z_rows + g) if HAS_ZERO else scale  # unread without HAS_ZERO
        acc = _int_weight_step(
            acc, a, words, scale, zero, BITS, False, HAS_ZERO, SCALE_AFTER, SWAP_AB, DOT_PRECISION,
            HALF, FAST, MMA_ORDER,
        )  # fmt: skip
        if GATED:
            up_words = tl.load(q_rows + up_q + kw[None, :])
            if SCALE_AFTER:
                up_scale = next_up_scale
                next_up_scale = tl.load(s_rows + up_s + tl.minimum(k0 + BLOCK_K, K - 1) // GROUP)
            else:
                up_scale = tl.load(s_rows + up_s + g)
            up_zero = tl.load(z_rows + up_s + g) if HAS_ZERO else up_scale
            acc_up = _int_weight_step(
                acc_up, a, up_words, up_scale, up_zero, BITS, False, HAS_ZERO, SCALE_AFTER, SWAP_AB,
                DOT_PRECISION, HALF, FAST, MMA_ORDER,
            )  # fmt: skip
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if SWAP_AB:
        acc = tl.trans(acc)
    if MUL_WEIGHT:
        acc = acc * tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < N))


def _block_k(group: int, cap: int = 128) -> int:
    """The largest of 128 / 64 / 32 / 16 dividing the group, at most cap."""
    for bk in (128, 64, 32, 16):
        if group % bk == 0 and bk <= cap:
            return bk
    raise ValueError(f"group size {group} is not a multiple of 16")


def w4a16_moe_gemm(
    a: torch.Tensor,
    qw: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bits: int,
    group: int,
    runs: ExpertRuns,
    *,
    gated: bool = False,
    topk_weights: torch.Tensor | None = None,
    block_n: int | None = None,
    tiles: IntMoeTiles | None = None,
    kernel: str = "v2",
    mma_order: bool = False,
) -> torch.Tensor:
    """Pair p's row: a[p // (P / A)] @ dequant(qw[expert of p])^T, gated or weighted (module docstring).
    tiles: IntMoeTiles() when None (block_n, when given, overrides its block_n); kernel "v2" or "v1".
    mma_order: qw's rows are in MMA order (experts_to_mma_order; the K step is then 128 columns)."""
    num_pairs = runs.num_pairs
    a_rows, k = a.shape
    e, rows, words = qw.shape
    if kernel not in ("v1", "v2"):
        raise ValueError(f"unknown MoE int kernel {kernel!r}: 'v1' or 'v2'")
    if a_rows == 0 or num_pairs % a_rows:
        raise ValueError(f"a has {a_rows} rows; the pairs ({num_pairs}) must be a multiple of them")
    if bits not in (4, 8) or qw.dtype != torch.int32 or words * (32 // bits) != k or qw.stride(2) != 1:
        raise ValueError(f"qw must be int32 [E, N, {k}*{bits}/32], got {qw.dtype} {tuple(qw.shape)}")
    if group <= 0 or k % group:
        raise ValueError(f"group size {group} does not divide K={k}")
    if scale.shape != (e, rows, k // group) or scale.dtype != torch.float32 or not scale.is_contiguous():
        raise ValueError(f"scale must be float32 {(e, rows, k // group)}, got {tuple(scale.shape)}")
    if zero is not None and (
        zero.shape != scale.shape or zero.dtype != torch.float32 or not zero.is_contiguous()
    ):
        raise ValueError(f"zero must be float32 {tuple(scale.shape)}, got {tuple(zero.shape)}")
    if gated and rows % 2:
        raise ValueError(f"gated: qw must hold [gate | up] rows, got {rows}")
    if topk_weights is not None and topk_weights.numel() != num_pairs:
        raise ValueError(f"topk_weights must hold one weight per pair ({num_pairs})")
    if mma_order and not mma_order_fits(bits, group, k):
        raise ValueError(f"MMA order needs 4-bit codes in groups of a multiple of {MMA_BLOCK} columns")
    if mma_order and kernel != "v2":
        raise ValueError("words in MMA order need the v2 kernel")
    tiles = tiles or IntMoeTiles()
    if block_n is not None:
        tiles = replace(tiles, block_n=block_n)
    tiles = _fit_operand_size(tiles, a.dtype, mma_order)
    if a.stride(1) != 1:
        a = a.contiguous()
    n = rows // 2 if gated else rows
    out = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    num_tiles_m = runs.sorted_ids.numel() // runs.block_m
    grid = (num_tiles_m * triton.cdiv(n, tiles.block_n),)
    args = (a, qw, scale, zero if zero is not None else scale, out)
    args += (topk_weights if topk_weights is not None else out, runs.sorted_ids, runs.expert_ids)
    args += (runs.num_padded, n, k, num_pairs, num_tiles_m, a.stride(0), qw.stride(0), qw.stride(1))
    args += (scale.stride(0), scale.stride(1), out.stride(0))
    common = dict(
        A_DIV=num_pairs // a_rows, GATED=gated, MUL_WEIGHT=topk_weights is not None, BITS=bits,
        GROUP=group, HAS_ZERO=zero is not None, BLOCK_M=runs.block_m, BLOCK_N=tiles.block_n,
        BLOCK_K=MMA_BLOCK if mma_order else _block_k(group, tiles.block_k),
        # fp32 models get fp32 products (torch's default for fp32 matmuls), not TF32
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    if kernel == "v1":
        if tiles.unpack != "f32":
            raise ValueError("the v1 MoE kernel has no unpack option (a v2 option)")
        _w4a16_moe_kernel_v1[grid](*args, n, **common)
    else:
        _w4a16_moe_kernel[grid](
            *args, SCALE_AFTER=tiles.scale_after, SWAP_AB=tiles.swap_ab, HALF=tiles.unpack == "half",
            FAST=fast_half(tiles.unpack, bits, False, a.dtype),  # MoE codes are never signed
            MMA_ORDER=mma_order, GROUP_M=tiles.group_m, **common,
        )  # fmt: skip
    return out


def w4a16_fused_experts(
    x: torch.Tensor,
    gate_up: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    down: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    bits: int,
    groups: tuple[int, int],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    block_m: int | None = None,
    config: W4A16MoeConfig | None = None,
    mma_order: bool = False,
) -> torch.Tensor:
    """x [T, H] -> [T, H]: fused_moe.py's pipeline (align, gated GEMM, weighted GEMM, sum over k) on
    (packed, scale, zero) expert weights: gate_up [E, 2I, H/P], down [E, H, I/P]. config:
    default_config's when None; block_m, when given, overrides its alignment. mma_order: both
    projections' words are in MMA order (experts_to_mma_order)."""
    num_tokens = x.shape[0]
    if num_tokens == 0:
        return torch.zeros_like(x)
    num_experts = gate_up[0].shape[0]
    top_k = topk_ids.shape[1]
    cfg = config or default_config(num_tokens, top_k, num_experts, mma_order)
    if block_m is not None:
        cfg = replace(cfg, block_m=block_m)
    runs = moe_align(topk_ids.int().contiguous(), num_experts, cfg.block_m)
    h = w4a16_moe_gemm(
        x.contiguous(), *gate_up, bits, groups[0], runs, gated=True, tiles=cfg.gemm1, kernel=cfg.kernel,
        mma_order=mma_order,
    )  # fmt: skip
    weights = topk_weights.float().contiguous()
    y = w4a16_moe_gemm(
        h, *down, bits, groups[1], runs, topk_weights=weights, tiles=cfg.gemm2, kernel=cfg.kernel,
        mma_order=mma_order,
    )  # fmt: skip
    return moe_sum(y, top_k)


def experts_to_mma_order(qw: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """int32 [E, N, K/8] words of every expert -> MMA order (inverse: back), row by row as
    kernels/w4a16_gemm.py's to_mma_order."""
    return to_mma_order(qw.reshape(-1, qw.shape[-1]), inverse).view(qw.shape)


def dequantize_experts_ref(
    qw: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bits: int,
    group: int,
    dtype: torch.dtype,
    mma_order: bool = False,
) -> torch.Tensor:
    """[E, N, K] in dtype: every expert's weight dequantized (the reference's first half); mma_order:
    qw's rows are in MMA order, put back first."""
    if mma_order:
        qw = experts_to_mma_order(qw, inverse=True)
    shifts = torch.arange(0, 32, bits, device=qw.device, dtype=torch.int32)
    codes = ((qw.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(*qw.shape[:2], -1)
    z = zero if zero is not None else torch.full_like(scale, float(1 << (bits - 1)))
    g = torch.arange(codes.shape[-1], device=qw.device) // group
    return ((codes.float() - z[:, :, g]) * scale[:, :, g]).to(dtype)


def w4a16_fused_experts_ref(
    x: torch.Tensor,
    gate_up: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    down: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    bits: int,
    groups: tuple[int, int],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    mma_order: bool = False,
) -> torch.Tensor:
    """The same in torch, fp32, one matmul per (token, expert) group of rows."""
    w1 = dequantize_experts_ref(*gate_up, bits, groups[0], x.dtype, mma_order).float()
    w2 = dequantize_experts_ref(*down, bits, groups[1], x.dtype, mma_order).float()
    inter = w1.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    xf = x.float()
    for expert in torch.unique(topk_ids).tolist():
        tok, slot = torch.nonzero(topk_ids == expert, as_tuple=True)
        h = xf[tok] @ w1[expert].t()
        h = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
        y = h.to(x.dtype).float() @ w2[expert].t()
        out.index_add_(0, tok, y * topk_weights[tok, slot].float()[:, None])
    return out.to(x.dtype)
