"""The MXFP4 expert GEMM rewritten as kernels/w4a16_moe.py rewrote the int4 one (moe_gemm.py's
MXFP4_DECODE "v2"; moe_gemm.py says why the first version is slow). Reference: moe_gemm.moe_gemm_ref.

    a       [A, K] rows gathered per pair (A_DIV as in moe_gemm.py)
    qw      [E, N, K / 8] int32: the uint8 blocks [E, N, K / 2] viewed as words, 8 e2m1 codes a word,
            code j at bits 4j .. 4j + 3 (the low nibble of each byte first: the checkpoint's order)
    scale   [E, N, K / 32] uint8 e8m0 exponents, one per 32 columns
    out     [P, N]: gated -> act(gate + bias, up + bias) with qw holding [gate | up] rows; else
            (+ bias) times the pair's routing weight

Each K step of BLOCK_K (a multiple of 32) reads every weight row's BLOCK_K / 2 bytes by 16-byte copies
(K-contiguous, as the memory holds them; the first version read its byte tile N-major, one byte a
load), unpacks them in registers by bit placement (_e2m1_field: no int-to-float conversion) and
interleaves them back into packed order without a shared-memory reshape; each word's 8 weights are
scaled by its group's power of two (one exp2 a word, one multiply a weight). The dot takes the weight tile's transposed
view, as the int4 kernel's does. Tiles past num_padded return at once: safe in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from overnight.kernels.moe_align import ExpertRuns
from overnight.kernels.tile_order import grouped_tile

GROUP = 32  # columns per e8m0 scale, the K step


@triton.jit
def _e2m1_field(words, mult, j: tl.constexpr):
    """Code j of each word (bits 4j .. 4j + 3) as its fp32 value times mult (the word's scale). Its 3
    magnitude bits are moved to fp32 bits 22 .. 24 (the exponent's two low bits and the mantissa's top
    one) and its sign to bit 31, each by one shift and one mask: that float is the e2m1 value times
    2^-126 for every code, m = 1 (0.5) included, as the subnormal 2^-127 (the kernel's fp32 multiplies
    keep subnormals: PTX mul.f32, no .ftz). Two multiplies restore the scale: exact, since the e2m1
    value times 2^126 is, and a power of two times it is unless it leaves fp32's range."""
    SHIFT: tl.constexpr = 22 - 4 * j
    if SHIFT >= 0:
        magnitude = (words << SHIFT) & 0x01C00000
    else:
        magnitude = (words >> -SHIFT) & 0x01C00000  # arithmetic shift: only the top bits differ
    sign = (words << (28 - 4 * j)) & (-0x80000000)
    return (magnitude | sign).to(tl.float32, bitcast=True) * 8.507059173023462e37 * mult  # 2^126


@triton.jit
def _unpack_e2m1(words, mult):
    """[R, W] int32 words with their scales [R, W] fp32 -> [R, 8 W] fp32 values in packed order (code j of
    word w at column 8 w + j), built by interleaving so each thread keeps its own words' values in
    registers (no shared-memory reshape)."""
    even = tl.interleave(
        tl.interleave(_e2m1_field(words, mult, 0), _e2m1_field(words, mult, 4)),
        tl.interleave(_e2m1_field(words, mult, 2), _e2m1_field(words, mult, 6)),
    )
    odd = tl.interleave(
        tl.interleave(_e2m1_field(words, mult, 1), _e2m1_field(words, mult, 5)),
        tl.interleave(_e2m1_field(words, mult, 3), _e2m1_field(words, mult, 7)),
    )
    return tl.interleave(even, odd)


@triton.jit
def _scaled_tile(q_rows, s_rows, kw, dtype: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weight tile of words kw in dtype. A word's 8 codes share one scale (4 words
    a 32-column group): each word reads its group's byte (the 4 reads of a byte hit the same cache
    line) and takes one exp2, so any BLOCK_K multiple of 32 needs no [groups, 32] broadcast."""
    words = tl.load(q_rows + kw[None, :])
    s = tl.load(s_rows[:, None] + (kw // 4)[None, :]).to(tl.float32)
    return _unpack_e2m1(words, tl.exp2(s - 127.0)).to(dtype)


@triton.jit(do_not_specialize=["num_pairs", "num_tiles_m"])
def _mxfp4_moe_kernel(
    a_ptr,
    qw_ptr,
    s_ptr,
    bias_ptr,
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
    stride_be,
    stride_om,
    alpha,
    limit,
    A_DIV: tl.constexpr,
    GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), num_tiles_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pair < num_pairs  # padding rows are masked, never read
    a_rows = a_ptr + (pair // A_DIV).to(tl.int64)[:, None] * stride_am
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows_n = tl.minimum(offs_n, N - 1).to(tl.int64)  # clamped reads, masked stores
    q_rows = qw_ptr + expert * stride_qe + rows_n[:, None] * stride_qn
    s_rows = s_ptr + expert * stride_se + rows_n * stride_sn
    offs_k = tl.arange(0, BLOCK_K)
    offs_w = tl.arange(0, BLOCK_K // 8)
    dtype = a_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros_like(acc)
    for k0 in range(0, K, BLOCK_K):  # BLOCK_K divides K: no K masks
        kx = tl.max_contiguous(tl.multiple_of(k0 + offs_k, BLOCK_K), BLOCK_K)
        a = tl.load(a_rows + kx[None, :], mask=row_ok[:, None], other=0.0)
        kw = tl.max_contiguous(tl.multiple_of(k0 // 8 + offs_w, BLOCK_K // 8), BLOCK_K // 8)
        w = _scaled_tile(q_rows, s_rows, kw, dtype)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PRECISION)
        if GATED:
            up = _scaled_tile(q_rows + N * stride_qn, s_rows + N * stride_sn, kw, dtype)
            acc_up = tl.dot(a, tl.trans(up), acc_up, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        bias_rows = bias_ptr + expert * stride_be + offs_n
        acc += tl.load(bias_rows, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(bias_rows + N, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if GATED:
        if ACTIVATION == 0:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        else:  # gpt-oss's clamped SwiGLU (moe_gemm.py)
            g = tl.minimum(acc, limit)
            u = tl.minimum(tl.maximum(acc_up, -limit), limit)
            acc = g / (1.0 + tl.exp(-alpha * g)) * (u + 1.0)
    if MUL_WEIGHT:
        acc = acc * tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def k_step(k: int, block_k: int) -> int:
    """The K step for K (a multiple of 32): the largest of block_k, 64 and 32 that divides it, at most
    block_k (gpt-oss's 2880 takes 64 where block_k is 128: 2880 = 45 x 64)."""
    return next(bk for bk in (block_k, 64, 32) if bk <= block_k and bk % GROUP == 0 and k % bk == 0)


def mxfp4_moe_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    runs: ExpertRuns,
    out: torch.Tensor,
    *,
    block_n: int,
    block_k: int,
    group_m: int,
    num_warps: int,
    num_stages: int,
    gated: bool = False,
    topk_weights: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    activation: tuple[str, float, float] = ("silu", 0.0, 0.0),
) -> torch.Tensor:
    """moe_gemm's MXFP4 case (w uint8 [E, rows, K/2], w_scale uint8 [E, rows, K/32]) by this file's kernel,
    into `out` [P, N]; moe_gemm has checked the shapes. w must be contiguous (its rows viewed as words).
    The K step is the largest of block_k, 64 and 32 that divides K (a multiple of 32)."""
    num_pairs = runs.num_pairs
    a_rows, k = a.shape
    if k % GROUP or not w.is_contiguous():
        raise ValueError(f"MXFP4 v2: K ({k}) must be a multiple of 32 and w contiguous")
    step = k_step(k, block_k)
    qw = w.view(torch.int32)  # [E, rows, K / 8]
    n = out.shape[1]
    num_tiles_m = runs.sorted_ids.numel() // runs.block_m
    grid = (num_tiles_m * triton.cdiv(n, block_n),)
    kind, alpha, limit = activation
    _mxfp4_moe_kernel[grid](
        a, qw, w_scale, bias if bias is not None else out, out,
        topk_weights if topk_weights is not None else out, runs.sorted_ids, runs.expert_ids,
        runs.num_padded, n, k, num_pairs, num_tiles_m, a.stride(0), qw.stride(0), qw.stride(1),
        w_scale.stride(0), w_scale.stride(1), bias.stride(0) if bias is not None else 0, out.stride(0),
        float(alpha), float(limit),
        A_DIV=num_pairs // a_rows, GATED=gated, HAS_BIAS=bias is not None,
        ACTIVATION=0 if kind == "silu" else 1, MUL_WEIGHT=topk_weights is not None,
        BLOCK_M=runs.block_m, BLOCK_N=block_n, GROUP_M=group_m, BLOCK_K=step,
        # fp32 models get fp32 products (torch's default for fp32 matmuls), not TF32
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out
