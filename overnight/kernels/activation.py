"""SiLU-and-mul of the gated MLP: [T, 2I] laid out [gate | up] -> silu(gate) * up, [T, I].

Reference: silu_and_mul_ref in overnight/layers/activation.py (the layer's CPU path).

Program (t, j) handles columns j * BLOCK .. (j + 1) * BLOCK of row t. silu is computed in fp32 as
x / (1 + exp(-x)), rounded to the input dtype, then multiplied by up and rounded again, the rounding
points of the reference's two elementwise ops. Launches depend only on shapes, strides and pointers:
safe to capture in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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
