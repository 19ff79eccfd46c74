"""Rotary position embedding applied in place to q and k, optionally after Qwen3's per-head RMSNorm.

Reference: rotary_ref in overnight/layers/rotary.py, preceded for Qwen3 by rms_norm_ref of
overnight/layers/norm.py on each head of q and of k.

One program rotates every head of q and of k of one token t. cos_sin_cache row p holds
[ cos(p f_0 .. p f_{R-1}) | sin(same) ] for the first 2R = rotary_dim <= D dims of a head; the other dims
pass untouched (partial rotary). Element pairs (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin):

    rotate-half:  x1 = q[t, h, i],   x2 = q[t, h, i + R]     (STEP 1, OFF R)
    interleaved:  x1 = q[t, h, 2i],  x2 = q[t, h, 2i + 1]    (STEP 2, OFF 1; GLM-4)

(unit stride along D; any token and head strides).

q and k are views into the fused qkv projection output, so rows are strided and the kernel writes back
into that buffer (v, the rest of each row, is untouched). Rounding follows the reference step by step
(cos/sin rounded to q's dtype, each product rounded, then the sum; no fma contraction: COMPILE_OPTIONS), so
without the norm the outputs equal the reference bit for bit; Qwen3's norm is computed as rmsnorm.py
does. Launches depend only on shapes, strides and pointers: safe to capture in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Each product is rounded to q's dtype before the sum, as in the reference: left to fuse, the compiler
# narrows the fp32 ops to fp16/bf16 ones and contracts x1 * c - x2 * s into one fma, skipping that
# rounding (on an H200 1 output in 7 then differed from the reference by an ulp). Two ops instead of one
# cost nothing in a kernel bound by memory. tests/test_kernels_sm90_rounding.py reads the PTX.
COMPILE_OPTIONS = {"enable_fp_fusion": False}


@triton.jit
def _rotate_heads(
    base,
    stride_h,
    cos,
    sin,
    w_ptr,
    eps,
    H: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    NORM: tl.constexpr,
    STEP: tl.constexpr,
    OFF: tl.constexpr,
    WIDE: tl.constexpr,
):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < H) & (offs_d[None, :] < HALF)
    p1 = base + offs_h[:, None] * stride_h + offs_d[None, :] * STEP
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p1 + OFF, mask=mask, other=0.0)
    dtype = x1.dtype
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    if NORM:
        variance = (tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / (2 * HALF)
        rstd = tl.math.rsqrt(variance + eps)[:, None]
        # NORM only with full rotation (the wrapper checks it): x1 and x2 then cover the whole head.
        w1 = tl.load(w_ptr + offs_d * STEP, mask=offs_d < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + OFF + offs_d * STEP, mask=offs_d < HALF, other=0.0).to(tl.float32)[None, :]
        f1 = (w1 * (f1 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        f2 = (w2 * (f2 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    if WIDE:  # fp32 from the load to the store, cos and sin unrounded (the vision towers' reference)
        c = cos.to(tl.float32)[None, :]
        s = sin.to(tl.float32)[None, :]
        o1 = f1 * c - f2 * s
        o2 = f2 * c + f1 * s
    else:
        c = cos.to(dtype).to(tl.float32)[None, :]
        s = sin.to(dtype).to(tl.float32)[None, :]
        o1 = (f1 * c).to(dtype).to(tl.float32) - (f2 * s).to(dtype).to(tl.float32)
        o2 = (f2 * c).to(dtype).to(tl.float32) + (f1 * s).to(dtype).to(tl.float32)
    tl.store(p1, o1.to(dtype), mask=mask)
    tl.store(p1 + OFF, o2.to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    cache_ptr,
    q_w_ptr,
    k_w_ptr,
    eps,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cache,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    NORM: tl.constexpr,
    STEP: tl.constexpr,
    OFF: tl.constexpr,
    WIDE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    row = cache_ptr + pos * stride_cache + offs_d
    cos = tl.load(row, mask=offs_d < HALF, other=0.0)
    sin = tl.load(row + HALF, mask=offs_d < HALF, other=0.0)
    _rotate_heads(
        q_ptr + t * stride_qt,
        stride_qh,
        cos,
        sin,
        q_w_ptr,
        eps,
        HQ,
        HALF,
        BLOCK_HQ,
        BLOCK_HALF,
        NORM,
        STEP,
        OFF,
        WIDE,
    )
    _rotate_heads(
        k_ptr + t * stride_kt,
        stride_kh,
        cos,
        sin,
        k_w_ptr,
        eps,
        HKV,
        HALF,
        BLOCK_HKV,
        BLOCK_HALF,
        NORM,
        STEP,
        OFF,
        WIDE,
    )


def _num_warps(elements: int) -> int:
    # About 8 elements of q and k together per thread, 1 to 8 warps.
    # Triton needs a power of two (hidden sizes like 576 would give 5 or 9 warps otherwise).
    want = max(1, min(8, elements // 256))
    return 1 << (want.bit_length() - 1)


def _check(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"q [T, Hq, D] and k [T, Hkv, D] expected, got {tuple(q.shape)}, {tuple(k.shape)}")
    if q.shape[2] % 2:
        raise ValueError(f"head_dim must be even, got {q.shape[2]}")
    if q.dtype != k.dtype or q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError("q and k must share a dtype and have unit stride along head_dim")
    if positions.shape != (q.shape[0],) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be [{q.shape[0]}] int32/int64, got {tuple(positions.shape)}")
    rot = cos_sin_cache.shape[1] if cos_sin_cache.dim() == 2 else -1
    if rot <= 0 or rot % 2 or rot > q.shape[2] or cos_sin_cache.stride(1) != 1:
        raise ValueError(
            f"cos_sin_cache must be [max_position, rotary_dim] with rotary_dim even and <= {q.shape[2]}, "
            f"got {tuple(cos_sin_cache.shape)}"
        )
    if not (positions.device == q.device == k.device == cos_sin_cache.device):
        raise ValueError("positions, q, k and cos_sin_cache must be on one device")


def _launch(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    num_warps: int | None,
    interleaved: bool,
    wide: bool = False,
) -> None:
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    half = cos_sin_cache.shape[1] // 2
    block_hq, block_hkv = triton.next_power_of_2(num_heads), triton.next_power_of_2(k.shape[1])
    block_half = triton.next_power_of_2(half)
    norm = q_weight is not None
    _rotary_kernel[(num_tokens,)](
        positions,
        q,
        k,
        cos_sin_cache,
        q_weight if norm else q,  # placeholders without the norm
        k_weight if norm else k,
        eps,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        HQ=num_heads,
        HKV=k.shape[1],
        HALF=half,
        BLOCK_HQ=block_hq,
        BLOCK_HKV=block_hkv,
        BLOCK_HALF=block_half,
        NORM=norm,
        STEP=2 if interleaved else 1,
        OFF=1 if interleaved else half,
        WIDE=wide,
        num_warps=num_warps or _num_warps(2 * (block_hq + block_hkv) * block_half),
        **COMPILE_OPTIONS,
    )


def rotary_inplace(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    num_warps: int | None = None,
    *,
    interleaved: bool = False,
    wide: bool = False,
) -> None:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place by positions [T]; cos_sin_cache [max_pos, rotary_dim]
    (fp32; the first rotary_dim dims of each head rotate, the rest pass); interleaved: pairs (2i, 2i + 1)
    instead of (i, i + rotary_dim / 2); wide: every step in fp32 and only the result rounded to q's
    dtype, as the vision towers' reference computes (models/vision/qwen_vit.py), instead of the decoder
    reference's rounding after each step. Positions are not range-checked (that would need a host
    sync): they must be < max_pos."""
    _check(positions, q, k, cos_sin_cache)
    _launch(positions, q, k, cos_sin_cache, None, None, 0.0, num_warps, interleaved, wide)


def qk_norm_rotary_inplace(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    num_warps: int | None = None,
    *,
    interleaved: bool = False,
) -> None:
    """Qwen3: RMSNorm each head of q (weight q_weight [D]) and k (k_weight [D]) over D, then rotate
    both in place as rotary_inplace does; one launch for all of it."""
    _check(positions, q, k, cos_sin_cache)
    head_dim = q.shape[2]
    if cos_sin_cache.shape[1] != head_dim:
        raise ValueError("the fused per-head norm needs a full rotation (rotary_dim == head_dim)")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w.shape != (head_dim,) or w.dtype != q.dtype or w.device != q.device or w.stride(0) != 1:
            raise ValueError(f"{name} must be a contiguous [{head_dim}] {q.dtype} tensor on {q.device}")
    _launch(positions, q, k, cos_sin_cache, q_weight, k_weight, eps, num_warps, interleaved)
