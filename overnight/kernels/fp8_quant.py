"""Dynamic FP8 (e4m3) quantization of activations: one scale per token, or per token and column group.

Reference: quantize_activation_ref in overnight/quant/fp8.py (the arithmetic, step by step: amax of the
row or group in fp32, floored at MIN_AMAX; data = e4m3(clamp(x * (448 / amax))); scale = amax / 448,
both quotients correctly rounded so the output equals the reference bit for bit).

One program quantizes one token, its K columns seen as G groups of GROUP columns:

    x[t, g * GROUP + c]      tile [BLOCK_G, BLOCK_C] in registers, amax per tile row

Per token: G = 1 and GROUP = K. This is the standalone quantization of a linear layer's input that no
fused producer quantized (the attention output before o_proj); RMSNorm and SiLU-and-mul quantize their
own outputs (kernels/rmsnorm.py, kernels/activation.py). Launches depend only on shapes, strides and
pointers: safe to capture in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from overnight.kernels.kv_layout import fp8_max

FP8 = torch.float8_e4m3fn
# Must equal overnight/quant/fp8.py's MIN_AMAX (kernels import nothing outside kernels/).
MIN_AMAX = 1e-12
# The same values as compile-time constants the kernels can read.
_FP8_MAX_C = tl.constexpr(fp8_max(FP8))
_MIN_AMAX_C = tl.constexpr(MIN_AMAX)
# A whole token lives in registers; past this, registers spill.
MAX_ROW_ELEMENTS = 32768


@triton.jit
def quantize_tile(x):
    """x [R, C] float32 -> (e4m3 [R, C], scale [R] float32), one scale per row of the tile. Shared by
    every kernel that quantizes its output (so they all round exactly like the reference)."""
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), _MIN_AMAX_C)
    fp8_max = tl.full(amax.shape, _FP8_MAX_C, tl.float32)
    inv = tl.math.div_rn(fp8_max, amax)  # correctly rounded, as the reference's tensor division
    data = tl.clamp(x * inv[:, None], -_FP8_MAX_C, _FP8_MAX_C).to(tl.float8e4nv)
    return data, tl.math.div_rn(amax, fp8_max)


@triton.jit
def _quantize_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    stride_xt,
    stride_qt,
    stride_st,
    K: tl.constexpr,
    GROUP: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_g = tl.arange(0, BLOCK_G)
    offs_c = tl.arange(0, BLOCK_C)
    col = offs_g[:, None] * GROUP + offs_c[None, :]
    mask = (offs_c[None, :] < GROUP) & (col < K)
    x = tl.load(x_ptr + t * stride_xt + col, mask=mask, other=0.0).to(tl.float32)
    data, scale = quantize_tile(x)
    tl.store(q_ptr + t * stride_qt + col, data, mask=mask)
    tl.store(s_ptr + t * stride_st + offs_g, scale, mask=offs_g < NUM_GROUPS)


def num_warps_for(elements: int) -> int:
    """About 8 elements per thread, 1 to 16 warps, a power of two."""
    want = max(1, min(16, elements // 256))
    return 1 << (want.bit_length() - 1)


def quantize_fp8(x: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (fp32/fp16/bf16, unit stride along K, any row stride) -> (data [T, K] e4m3 contiguous,
    scale [T, G] float32): G = 1 without group_size, else ceil(K / group_size)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, K] with unit stride along K, got {tuple(x.shape)} {x.stride()}")
    num_tokens, k = x.shape
    group = k if group_size is None else group_size
    if group <= 0 or (group_size is not None and group_size & (group_size - 1)):
        raise ValueError(f"group_size must be a power of two, got {group_size}")
    num_groups = -(-k // group) if k else 1
    block_g, block_c = triton.next_power_of_2(num_groups), triton.next_power_of_2(max(group, 1))
    if block_g * block_c > MAX_ROW_ELEMENTS:
        raise ValueError(f"a row of {k} elements exceeds {MAX_ROW_ELEMENTS}")
    data = torch.empty((num_tokens, k), dtype=FP8, device=x.device)
    scale = torch.empty((num_tokens, num_groups), dtype=torch.float32, device=x.device)
    if num_tokens > 0 and k > 0:
        _quantize_kernel[(num_tokens,)](
            x,
            data,
            scale,
            x.stride(0),
            data.stride(0),
            scale.stride(0),
            K=k,
            GROUP=group,
            NUM_GROUPS=num_groups,
            BLOCK_G=block_g,
            BLOCK_C=block_c,
            num_warps=num_warps_for(block_g * block_c),
        )
    return data, scale
