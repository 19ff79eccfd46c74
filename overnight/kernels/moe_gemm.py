"""Grouped GEMM of a mixture-of-experts layer: every (token, expert) pair's row times its expert's weight.

Reference: moe_gemm_ref (below).

The pairs arrive sorted by expert with each expert's run padded to BLOCK_M (moe_align.py), so one
program computes a [BLOCK_M, BLOCK_N] output tile for one expert:

    rows    pair ids  sorted_ids[m * BLOCK_M : (m + 1) * BLOCK_M]   (sentinel P: padding, masked)
    A       a[pair // A_DIV, :]   gathered rows: token rows (A_DIV = k) or pair rows (A_DIV = 1)
    B       w[expert_ids[m]]^T    [K, N] tiles of the expert's [N, K] weight
    out     out[pair, :]          rows indexed by pair id, so the order of the sort never shows

Two uses:
  gate/up (GATED)   w = [E, 2N, K] laid out [gate | up]; each program keeps two accumulators, the gate
                    and the up columns of the same N range, and stores silu(gate) * up: the SiLU-and-mul
                    is the epilogue, and the [P, 2N] gate/up activations are never written.
  down (MUL_WEIGHT) w = [E, H, N]; the epilogue scales each row by its pair's routing weight.
  up (ACTIVATION 2) w = [E, N, K], no gate (Nemotron-H's experts): the epilogue stores relu(acc)^2, so
                    the [P, N] pre-activations are never written either.
Bias (HAS_BIAS, gpt-oss): bias [E, rows of w] added to the accumulators before the epilogue's activation
or routing weight. ACTIVATION: 0 = silu(gate) * up (GATED; ungated: none); 1 = gpt-oss's clamped
SwiGLU (GATED), g = min(gate, limit), u = clamp(up, -limit, limit), g * sigmoid(alpha * g) * (u + 1);
2 = squared ReLU of the single accumulator (not GATED).
FP8 experts (W_FP8): w holds e4m3 values with one float32 scale per expert and weight row (w_scale
[E, rows of w]); each tile is converted to a's dtype for the dot (the activations stay as they are:
weight-only FP8, half the bytes a decode step reads), and the scales multiply the accumulators in the
epilogue, the gate's and the up's each by its own rows' before the SiLU.
FP8 activations too (A_FP8, W8A8: what the GPU runs for FP8 experts, layers/moe.py): a holds e4m3 rows
with one float32 scale per row (a_scale [A], kernels/fp8_quant.py); the tiles go to the dot as stored
(e4m3 x e4m3 on FP8 tensor cores, products exact in the fp32 accumulator), and the epilogue multiplies
each row by its a_scale beside the weight rows' scales. Weight-only FP8 converts every weight tile to
a's dtype first, which made FP8 experts slower than bf16 ones (docs/performance.md, session L).
MXFP4 experts (W_MXFP4, gpt-oss): w is uint8 [E, rows, K/2], two e2m1 values a byte (the low nibble the
even column), and w_scale uint8 [E, rows, K/32] holds one e8m0 exponent per 32 columns (quant/mxfp4.py).
Each [BLOCK_K, BLOCK_N] tile is read as BLOCK_K/2 bytes a column, decoded and scaled in registers and
converted to a's dtype for the dot: a decode step reads a quarter of bf16's expert bytes (Hopper has no
FP4 MMA, so the dot itself runs in a's dtype).
Accumulation is fp32; the result is rounded once, to out's dtype. Tiles past num_padded (a device
scalar) return at once, so the grid is sized for the worst case and a launch depends only on shapes
and pointers: safe to capture in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from overnight.kernels.fp8_gemm import MIN_BLOCK_K
from overnight.kernels.moe_align import ExpertRuns
from overnight.kernels.tile_order import grouped_tile


@dataclass(frozen=True)
class GemmTiles:
    """One GEMM's tile shape and launch parameters (BLOCK_M is shared: it is the alignment's)."""

    block_n: int = 64
    block_k: int = 64
    group_m: int = 8  # tiles of GROUP_M row blocks are swept column by column, for L2 reuse
    num_warps: int = 4
    num_stages: int = 3


def fit_operand_size(tiles: GemmTiles, dtype: torch.dtype) -> GemmTiles:
    """The tiles for operands of `dtype`. The configs are sized for 16-bit operands; fp32 ones (exactness
    checks, never a fast path) take twice their shared memory: the largest gated tile, 128 x 128 x 64 in
    three stages, needs 240 KB on sm_90, past the 227 KB a block may use. Two stages of 32-deep tiles fit
    (tests/test_kernels_sm90_fit.py compiles both for sm_90). e4m3 operands (W8A8) need K steps of at
    least MIN_BLOCK_K, the K of the GPU's FP8 MMA: Triton refuses to compile a shallower FP8 dot."""
    if dtype == torch.float8_e4m3fn and tiles.block_k < MIN_BLOCK_K:
        return replace(tiles, block_k=MIN_BLOCK_K)
    if dtype == torch.float32:
        return replace(tiles, block_k=min(tiles.block_k, 32), num_stages=min(tiles.num_stages, 2))
    return tiles


# How MXFP4 tiles are decoded: "v1" (the first version, _e2m1_to_float: per weight two int-to-float
# conversions and an exp2), "bits" (_e2m1_bits: integer ops only) or "v2" (kernels/mxfp4_moe.py). Why v1 is slow, from its sm_90
# compile (tests/test_kernels_moe_mxfp4_sm90.py; the same tiles in bf16 beside it): the weight bytes come by
# single-byte global loads (68 ld.global.u8 per loop body, no cp.async, no 16-byte copy: the [BLOCK_K/2,
# BLOCK_N] byte tile is read N-major while K is the contiguous dimension), ~2 int-to-float conversions and
# one ex2 per weight (272 cvt and 152 ex2 a K step of a 16 x 64 x 128 gated tile: a quarter-rate unit
# each), every default tier spills (200-680 bytes of stack at 255 registers; bf16's small tiers none),
# and the join / permute / reshape interleave plus the [K/32, 32, N] scale broadcast go through shared
# memory (st.shared per step) before the dot (mma.sync up to 32 rows). "bits" removes the conversions;
# the loads and the layout round trip remain (kernels/w4a16_moe.py's K-contiguous words and in-register
# unpacking are the rewrite that fixes those: "v2", kernels/mxfp4_moe.py, with 16-byte copies of
# K-contiguous words, unpacked and scaled in registers). bench/mxfp4_moe_gpu.py on an H200 (session I, SM
# 1980 MHz; gpt-oss-20b and -120b shapes, x the bf16 fused MoE at 1 / 16 / 128 / 512 / 1,024 / 4,096 / 8,192
# tokens): v1 0.33-0.45x, bits 0.37-0.64x, v2 0.38-0.61x; v2 best at 5 of 7 sizes (bits at 1 and 16
# tokens, by 5-12%), 1.3-2.2x v1 everywhere, the same error. Still well below bf16: where the bf16 experts
# fit, the mxfp4_experts option dequantizes them (loader/expert_form.py).
MXFP4_DECODES = ("v1", "bits", "v2")
MXFP4_DECODE = "v2"


# Sizes that change with the batch are not specialized on (divisibility by 16), so one compiled kernel per
# tile configuration serves every batch size.
@triton.jit
def _e2m1_to_float(code):
    """e2m1 codes (0..15, int32) -> their values: sign, 2 exponent bits (bias 1), 1 mantissa bit."""
    exponent = (code >> 1) & 3
    mantissa = (code & 1).to(tl.float32)
    magnitude = tl.where(
        exponent == 0, 0.5 * mantissa, (1.0 + 0.5 * mantissa) * tl.exp2((exponent - 1).to(tl.float32))
    )
    return tl.where((code & 8) != 0, -magnitude, magnitude)


@triton.jit
def _e2m1_bits(code):
    """The same values by placing bits, with no int-to-float conversion and no exp2: magnitude m = code & 7
    shifted to the top of an fp32 mantissa (bit 22) puts m's two exponent bits at the bottom of the
    exponent field and its mantissa bit at the top of the mantissa; adding 126 << 23 makes that
    2^(e - 1) * (1 + mantissa / 2), e2m1's value for m >= 2. m = 1 (0.5) and m = 0 are selected as
    constants (e2m1's subnormals), and the sign bit is or-ed in: about ten integer ops a weight."""
    m = code & 7
    bits = tl.where(m >= 2, (m << 22) + 0x3F000000, tl.where(m == 1, 0x3F000000, 0))
    return (bits | ((code & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _mxfp4_tile(
    w_ptrs, s_ptrs, mask, s_mask, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, DECODE_BITS: tl.constexpr
):
    """A [BLOCK_K, BLOCK_N] tile of MXFP4 weights in fp32: w_ptrs point at [BLOCK_K / 2, BLOCK_N] bytes,
    s_ptrs at the tile's [BLOCK_K / 32, BLOCK_N] scale bytes. DECODE_BITS: _e2m1_bits, else
    _e2m1_to_float (the first version)."""
    packed = tl.load(w_ptrs, mask=mask, other=0).to(tl.int32)
    if DECODE_BITS:
        low = _e2m1_bits(packed & 15)
        high = _e2m1_bits(packed >> 4)
    else:
        low = _e2m1_to_float(packed & 15)
        high = _e2m1_to_float(packed >> 4)
    # byte i holds columns 2i (low) and 2i + 1 (high): interleave along K
    w = tl.reshape(tl.permute(tl.join(low, high), (0, 2, 1)), (BLOCK_K, BLOCK_N))
    exps = tl.load(s_ptrs, mask=s_mask, other=127).to(tl.float32) - 127.0
    w = tl.reshape(w, (BLOCK_K // 32, 32, BLOCK_N)) * tl.exp2(exps)[:, None, :]
    return tl.reshape(w, (BLOCK_K, BLOCK_N))


@triton.jit(do_not_specialize=["num_pairs", "num_tiles_m"])
def _moe_gemm_kernel(
    a_ptr,
    w_ptr,
    w_scale_ptr,  # W_FP8: [E, rows of w] float32; W_MXFP4: [E, rows of w, K / 32] uint8
    a_scale_ptr,  # A_FP8: [rows of a] float32
    bias_ptr,  # HAS_BIAS: [E, rows of w]
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
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    stride_se,  # W_FP8 / W_MXFP4: w_scale's stride between experts
    stride_sn,  # W_MXFP4: w_scale's stride between rows
    stride_be,  # HAS_BIAS: bias's stride between experts
    up_offset,  # GATED: the up rows follow the gate rows, N rows further
    alpha,  # ACTIVATION 1
    limit,  # ACTIVATION 1
    A_DIV: tl.constexpr,
    GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    W_FP8: tl.constexpr,
    A_FP8: tl.constexpr,
    W_MXFP4: tl.constexpr,
    MXFP4_BITS: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), num_tiles_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return

    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = pair < num_pairs
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = a_ptr + (pair // A_DIV).to(tl.int64)[:, None] * stride_am + offs_k[None, :] * stride_ak
    if W_MXFP4:  # bytes of half the tile's K, and its scales (one per 32 columns)
        offs_kb = tl.arange(0, BLOCK_K // 2)
        offs_ks = tl.arange(0, BLOCK_K // 32)
        w_ptrs = (
            w_ptr
            + expert * stride_we
            + offs_n[None, :].to(tl.int64) * stride_wn
            + offs_kb[:, None] * stride_wk
        )
        s_ptrs = (
            w_scale_ptr + expert * stride_se + offs_n[None, :].to(tl.int64) * stride_sn + offs_ks[:, None]
        )
    else:
        w_ptrs = (
            w_ptr
            + expert * stride_we
            + offs_n[None, :].to(tl.int64) * stride_wn
            + offs_k[:, None] * stride_wk
        )

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a_mask = row_mask[:, None]
            w_mask = n_mask[None, :]
        else:
            k_left = K - k * BLOCK_K
            a_mask = row_mask[:, None] & (offs_k[None, :] < k_left)
            w_mask = n_mask[None, :] & (offs_k[:, None] < k_left)
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        if W_MXFP4:
            k_left = K - k * BLOCK_K
            b_mask = n_mask[None, :] & (offs_kb[:, None] < k_left // 2)
            s_mask = n_mask[None, :] & (offs_ks[:, None] < k_left // 32)
            w = _mxfp4_tile(w_ptrs, s_ptrs, b_mask, s_mask, BLOCK_K, BLOCK_N, MXFP4_BITS)
            w = w.to(a_ptr.dtype.element_ty)
        else:
            w = tl.load(w_ptrs, mask=w_mask, other=0.0)
            if W_FP8 and not A_FP8:
                w = w.to(a_ptr.dtype.element_ty)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        if GATED:
            if W_MXFP4:
                up = _mxfp4_tile(
                    w_ptrs + up_offset, s_ptrs + N * stride_sn, b_mask, s_mask, BLOCK_K, BLOCK_N, MXFP4_BITS
                ).to(a_ptr.dtype.element_ty)
            else:
                up = tl.load(w_ptrs + up_offset, mask=w_mask, other=0.0)
                if W_FP8 and not A_FP8:
                    up = up.to(a_ptr.dtype.element_ty)
            acc_up = tl.dot(a, up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        if W_MXFP4:
            w_ptrs += (BLOCK_K // 2) * stride_wk
            s_ptrs += BLOCK_K // 32
        else:
            w_ptrs += BLOCK_K * stride_wk

    if A_FP8:
        a_scale = tl.load(a_scale_ptr + pair // A_DIV, mask=row_mask, other=0.0)[:, None]
        acc = acc * a_scale
        if GATED:
            acc_up = acc_up * a_scale
    if W_FP8:
        scale_ptrs = w_scale_ptr + expert * stride_se + offs_n
        acc = acc * tl.load(scale_ptrs, mask=n_mask, other=0.0)[None, :]
        if GATED:
            acc_up = acc_up * tl.load(scale_ptrs + N, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        bias_ptrs = bias_ptr + expert * stride_be + offs_n
        acc = acc + tl.load(bias_ptrs, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up = acc_up + tl.load(bias_ptrs + N, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if GATED:
        if ACTIVATION == 0:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        else:
            g = tl.minimum(acc, limit)
            u = tl.minimum(tl.maximum(acc_up, -limit), limit)
            acc = g / (1.0 + tl.exp(-alpha * g)) * (u + 1.0)
    elif ACTIVATION == 2:
        acc = tl.maximum(acc, 0.0)
        acc = acc * acc
    if MUL_WEIGHT:
        acc = acc * tl.load(topk_weights_ptr + pair, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


def moe_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    runs: ExpertRuns,
    tiles: GemmTiles,
    *,
    gated: bool = False,
    topk_weights: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    activation: tuple[str, float, float] = ("silu", 0.0, 0.0),
    mxfp4_decode: str | None = None,
    a_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Pair p's output row: out[p] = a[p // (P / a_rows)] @ w[expert of p]^T (+ bias[expert of p]), then

    gated:         act(first N columns, last N columns), with w [E, 2N, K]: out [P, N]; activation =
                   (kind, alpha, limit), kind "silu" (silu(gate) * up) or "swiglu_oai" (module docstring)
    not gated:     activation kind "relu2": relu(row)^2, with w [E, N, K]: out [P, N]; any other kind
                   (the default "silu") leaves the rows as they are (the down GEMM)
    topk_weights:  times topk_weights.flatten()[p]: out [P, N] with w [E, N, K]

    a [A, K] holds either one row per token (A = T, P = T * k) or one per pair (A = P); rows and w must
    have unit stride along K. An e4m3 w comes with w_scale [E, rows of w] float32 (w[e, r] * w_scale[e, r]
    is the weight); its a may be e4m3 too, with a_scale [A] float32 (a[i] * a_scale[i] is the row: W8A8),
    and then out_dtype (or out) says the output's dtype. MXFP4 w (uint8) comes with w_scale [E, rows, K/32] uint8; mxfp4_decode names the
    decoding (MXFP4_DECODES; None: MXFP4_DECODE)."""
    decode = MXFP4_DECODE if mxfp4_decode is None else mxfp4_decode
    if decode not in MXFP4_DECODES:
        raise ValueError(f"unknown MXFP4 decode {decode!r}: one of {', '.join(MXFP4_DECODES)}")
    tiles = fit_operand_size(tiles, a.dtype)
    num_pairs = runs.num_pairs
    a_rows, k_dim = a.shape
    w_mxfp4 = w.dtype == torch.uint8
    if a_rows == 0 or num_pairs % a_rows:
        raise ValueError(f"a has {a_rows} rows; the pairs ({num_pairs}) must be a multiple of them")
    w_k = k_dim // 2 if w_mxfp4 else k_dim
    if w.dim() != 3 or w.shape[2] != w_k:
        raise ValueError(f"w must be [E, N, {w_k}], got {tuple(w.shape)}")
    if a.stride(1) != 1 or w.stride(2) != 1:
        raise ValueError("a and w must have unit stride along K")
    if gated and w.shape[1] % 2:
        raise ValueError(f"gated: w must hold [gate | up] rows, got {w.shape[1]} rows")
    n = w.shape[1] // 2 if gated else w.shape[1]
    a_fp8 = a.dtype == torch.float8_e4m3fn
    if a_fp8 != (a_scale is not None):
        raise ValueError("an e4m3 a needs a_scale, and only it takes one")
    if a_fp8 and w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"e4m3 activations need e4m3 weights, got {w.dtype}")
    if a_scale is not None and (a_scale.shape != (a_rows,) or a_scale.dtype != torch.float32):
        raise ValueError(f"a_scale must be float32 [{a_rows}], got {a_scale.dtype} {tuple(a_scale.shape)}")
    if out is None:
        dtype = out_dtype or (None if a_fp8 else a.dtype)
        if dtype is None:
            raise ValueError("e4m3 activations need out_dtype (or out)")
        out = torch.empty(num_pairs, n, dtype=dtype, device=a.device)
    if out.shape != (num_pairs, n) or out.stride(1) != 1:
        raise ValueError(f"out must be [{num_pairs}, {n}] with unit stride, got {tuple(out.shape)}")
    if topk_weights is not None and topk_weights.numel() != num_pairs:
        raise ValueError(f"topk_weights must hold one weight per pair ({num_pairs})")
    w_fp8 = w.dtype == torch.float8_e4m3fn
    if (w_fp8 or w_mxfp4) != (w_scale is not None):
        raise ValueError("an e4m3 or MXFP4 w needs w_scale, and only those take one")
    if (
        w_fp8
        and w_scale is not None
        and (w_scale.shape != w.shape[:2] or w_scale.dtype != torch.float32 or w_scale.stride(1) != 1)
    ):
        raise ValueError(f"w_scale must be float32 {tuple(w.shape[:2])}, rows contiguous")
    if w_mxfp4 and w_scale is not None:
        if k_dim % 32 or tiles.block_k % 32:
            raise ValueError(f"MXFP4: K ({k_dim}) and block_k ({tiles.block_k}) must be multiples of 32")
        if (
            w_scale.shape != (*w.shape[:2], k_dim // 32)
            or w_scale.dtype != torch.uint8
            or w_scale.stride(2) != 1
        ):
            raise ValueError(f"MXFP4: w_scale must be uint8 {(*w.shape[:2], k_dim // 32)}")
    if bias is not None and (bias.shape != w.shape[:2] or bias.stride(1) != 1):
        raise ValueError(f"bias must be {tuple(w.shape[:2])}, rows contiguous")
    kind, alpha, limit = activation
    if kind not in ("silu", "swiglu_oai", "relu2"):
        raise ValueError(f"unknown activation {kind!r} (silu, swiglu_oai, relu2)")
    if kind == "relu2" and gated:
        raise ValueError("relu2 is an ungated activation: its w holds the up rows alone, gated=False")
    if kind == "relu2" and w_mxfp4:
        raise ValueError("relu2 experts in MXFP4 are not supported")

    if w_mxfp4 and w_scale is not None and decode == "v2":
        from overnight.kernels.mxfp4_moe import mxfp4_moe_gemm

        return mxfp4_moe_gemm(
            a, w, w_scale, runs, out, block_n=tiles.block_n, block_k=tiles.block_k, group_m=tiles.group_m,
            num_warps=tiles.num_warps, num_stages=tiles.num_stages, gated=gated,
            topk_weights=topk_weights, bias=bias, activation=activation,
        )  # fmt: skip
    block_m = runs.block_m
    num_tiles_m = runs.sorted_ids.numel() // block_m
    grid = (num_tiles_m * triton.cdiv(n, tiles.block_n),)
    _moe_gemm_kernel[grid](
        a,
        w,
        w_scale if w_scale is not None else out,  # unread without W_FP8
        a_scale if a_scale is not None else out,  # unread without A_FP8
        bias if bias is not None else out,  # unread without HAS_BIAS
        out,
        topk_weights if topk_weights is not None else out,  # unread without MUL_WEIGHT
        runs.sorted_ids,
        runs.expert_ids,
        runs.num_padded,
        n,
        k_dim,
        num_pairs,
        num_tiles_m,
        a.stride(0),
        a.stride(1),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        out.stride(0),
        w_scale.stride(0) if w_scale is not None else 0,
        w_scale.stride(1) if w_mxfp4 and w_scale is not None else 0,
        bias.stride(0) if bias is not None else 0,
        n * w.stride(1),
        float(alpha),
        float(limit),
        A_DIV=num_pairs // a_rows,
        GATED=gated,
        HAS_BIAS=bias is not None,
        ACTIVATION={"silu": 0, "swiglu_oai": 1, "relu2": 2}[kind],
        MUL_WEIGHT=topk_weights is not None,
        W_FP8=w_fp8,
        A_FP8=a_fp8,
        W_MXFP4=w_mxfp4,
        MXFP4_BITS=decode == "bits",
        EVEN_K=k_dim % tiles.block_k == 0,
        # fp32 models get fp32 products (torch's default for fp32 matmuls), not TF32.
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        GROUP_M=tiles.group_m,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out


E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_to_float(w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 rows [..., K/2] uint8 with scales [..., K/32] uint8 -> [..., K] fp32 (the kernel's tile
    decoding, for the reference; kernels import nothing of ours, so quant/mxfp4.py has its own)."""
    lut = torch.tensor(E2M1, dtype=torch.float32, device=w.device)
    values = torch.stack([lut[(w & 15).long()], lut[(w >> 4).long()]], dim=-1).flatten(-2)
    return torch.ldexp(values.unflatten(-1, (-1, 32)), scales.to(torch.int32)[..., None] - 127).flatten(-2)


def moe_gemm_ref(
    a: torch.Tensor,
    w: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    gated: bool = False,
    topk_weights: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    activation: tuple[str, float, float] = ("silu", 0.0, 0.0),
    a_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """What moe_gemm computes, pair by pair in fp32 (one matmul per expert), rounded once at the end
    (to out_dtype, by default a's dtype; e4m3 rows are scaled by a_scale first)."""
    if w.dtype == torch.uint8 and w_scale is not None:  # MXFP4
        w = mxfp4_to_float(w, w_scale)
    elif w_scale is not None:
        w = w.float() * w_scale[:, :, None]
    ids = topk_ids.flatten().long()
    num_pairs = ids.numel()
    source = a.float() if a_scale is None else a.float() * a_scale[:, None]
    rows = source[torch.arange(num_pairs, device=a.device) // (num_pairs // a.shape[0])]
    n = w.shape[1] // 2 if gated else w.shape[1]
    out = torch.zeros(num_pairs, n, dtype=torch.float32, device=a.device)
    for expert in torch.unique(ids).tolist():
        sel = ids == expert
        y = rows[sel] @ w[expert].float().T
        if bias is not None:
            y = y + bias[expert].float()
        if not gated and activation[0] == "relu2":
            y = torch.relu(y).square()
        elif gated and activation[0] == "silu":
            y = torch.nn.functional.silu(y[:, :n]) * y[:, n:]
        elif gated:
            _, alpha, limit = activation
            g, u = y[:, :n].clamp(max=limit), y[:, n:].clamp(-limit, limit)
            y = g * torch.sigmoid(alpha * g) * (u + 1)
        out[sel] = y
    if topk_weights is not None:
        out *= topk_weights.flatten().float()[:, None]
    return out.to(out_dtype or a.dtype)
