"""SiLU-and-mul of the gated MLP: [T, 2I] laid out [gate | up] -> silu(gate) * up, [T, I].

Reference: silu_and_mul_ref in overnight/layers/activation.py (the layer's CPU path).

Program (t, j) handles columns j * BLOCK .. (j + 1) * BLOCK of row t. silu is computed in fp32 as
x / (1 + exp(-x)), rounded to the input dtype, then multiplied by up and rounded again, the rounding
points of the reference's two elementwise ops. Launches depend only on shapes, strides and pointers:
safe to capture in a CUDA graph.

silu_and_mul_fp8 feeds an FP8 down projection: one program holds a whole row (the amax of the row
decides its scale), rounds the product to the input dtype as above, then quantizes it per token (the
arithmetic of quantize_activation_ref in overnight/quant/fp8.py, via kernels/fp8_quant.py's
quantize_tile) and stores e4m3 data plus one float32 scale: 1 byte per output element instead of 2,
and no second pass over the activation to quantize it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from overnight.kernels.fp8_quant import FP8, MAX_ROW_ELEMENTS, num_warps_for, quantize_tile

SILU_BLOCK = 1024
SILU_NUM_WARPS = 4  # 8 elements (16 bytes of bf16) per thread


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_xt, stride_ot, INTER: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    row = x_ptr + t * stride_xt
    gate = tl.load(row + offs, mask=mask, other=0.0)
    up = tl.load(row + INTER + offs, mask=mask, other=0.0)
    dtype = gate.dtype
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + offs, (act * up.to(tl.float32)).to(dtype), mask=mask)


def silu_and_mul(
    x: torch.Tensor,
    out: torch.Tensor | None = None,
    block: int = SILU_BLOCK,
    num_warps: int = SILU_NUM_WARPS,
) -> torch.Tensor:
    """x: [..., 2I] with unit stride along the last dimension (any row stride when 2-D); returns
    silu(x[..., :I]) * x[..., I:], shaped [..., I], in x's dtype (into `out` when given, [..., I])."""
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"last dimension must be even (gate | up), got {tuple(x.shape)}")
    if x.stride(-1) != 1:
        raise ValueError("x must have unit stride along its last dimension")
    inter = x.shape[-1] // 2
    rows = x if x.dim() == 2 else x.reshape(-1, 2 * inter)
    if out is None:
        out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    if out.shape != (*x.shape[:-1], inter) or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(
            f"out must be {(*x.shape[:-1], inter)} {x.dtype}, got {tuple(out.shape)} {out.dtype}"
        )
    out_rows = out if out.dim() == 2 else out.view(-1, inter)
    if out_rows.stride(-1) != 1:
        raise ValueError("out must have unit stride along its last dimension")
    if rows.shape[0] > 0 and inter > 0:
        grid = (rows.shape[0], triton.cdiv(inter, block))
        _silu_and_mul_kernel[grid](
            rows, out_rows, rows.stride(0), out_rows.stride(0), INTER=inter, BLOCK=block, num_warps=num_warps
        )
    return out


@triton.jit
def _silu_and_mul_fp8_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    stride_xt,
    stride_qt,
    INTER: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < INTER
    row = x_ptr + t * stride_xt
    gate = tl.load(row + offs[None, :], mask=mask[None, :], other=0.0)
    up = tl.load(row + INTER + offs[None, :], mask=mask[None, :], other=0.0)
    dtype = gate.dtype
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    y = (act * up.to(tl.float32)).to(dtype).to(tl.float32)  # masked lanes: silu(0) * 0 = 0
    data, scale = quantize_tile(y)
    tl.store(q_ptr + t * stride_qt + offs[None, :], data, mask=mask[None, :])
    tl.store(s_ptr + t + tl.arange(0, 1), scale)


def silu_and_mul_fp8(x: torch.Tensor, num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, 2I] ([gate | up], unit stride along the last dimension) -> silu(gate) * up rounded to
    x's dtype and quantized per token: (data [T, I] e4m3, scale [T, 1] float32)."""
    if x.dim() != 2 or x.shape[-1] % 2:
        raise ValueError(f"x must be [T, 2I] (gate | up), got {tuple(x.shape)}")
    if x.stride(-1) != 1:
        raise ValueError("x must have unit stride along its last dimension")
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    block = triton.next_power_of_2(max(inter, 1))
    if block > MAX_ROW_ELEMENTS:
        raise ValueError(f"a row of {inter} elements exceeds {MAX_ROW_ELEMENTS}")
    data = torch.empty((num_tokens, inter), dtype=FP8, device=x.device)
    scale = torch.empty((num_tokens, 1), dtype=torch.float32, device=x.device)
    if num_tokens > 0 and inter > 0:
        _silu_and_mul_fp8_kernel[(num_tokens,)](
            x,
            data,
            scale,
            x.stride(0),
            data.stride(0),
            INTER=inter,
            BLOCK=block,
            num_warps=num_warps or num_warps_for(block),
        )
    return data, scale
