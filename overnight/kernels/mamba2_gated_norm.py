"""The gated RMSNorm at the end of a Mamba2 mixer, in one pass: out = w * rms_norm(y * silu(z)), the
statistics over each of G equal groups of the width on its own (G = 1: the whole width, Granite 4.0;
G = n_groups: Nemotron-H).

Reference: mamba_gated_norm_ref in overnight/layers/mamba2.py (the layer's CPU path). Rounding follows
it: the gated value and its statistics in fp32, the normalized value rounded to y's dtype before the
weight multiply, the product rounded again.

    y [T, W]  (unit stride along W)          z [T, W]  (a view into in_proj's output: any row stride)
    program (t, g) reads y[t, g*D:(g+1)*D] and z[t, g*D:(g+1)*D], D = W / G, and writes out[t, same]

Launches depend only on shapes, strides and pointers: safe to capture in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# One group (D elements) lives in registers; past this, registers spill.
MAX_GROUP_ELEMENTS = 32768


@triton.jit
def _gated_norm_kernel(
    y_ptr,
    z_ptr,
    w_ptr,
    out_ptr,
    stride_yt,
    stride_zt,
    stride_ot,
    eps,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * D + tl.arange(0, BLOCK_D)
    mask = tl.arange(0, BLOCK_D) < D
    y = tl.load(y_ptr + t * stride_yt + offs, mask=mask, other=0.0)
    z = tl.load(z_ptr + t * stride_zt + offs, mask=mask, other=0.0).to(tl.float32)
    dtype = y.dtype
    g = y.to(tl.float32) * (z / (1.0 + tl.exp(-z)))
    rstd = 1.0 / tl.sqrt(tl.sum(g * g, axis=0) / D + eps)
    normed = (g * rstd).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + offs, (w * normed).to(dtype), mask=mask)


def mamba_gated_norm(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, groups: int
) -> torch.Tensor:
    """[T, W] y and z (same dtype; unit stride along W), weight [W] -> [T, W] in y's dtype."""
    if y.dim() != 2 or z.shape != y.shape or weight.shape != (y.shape[1],):
        raise ValueError(
            f"gated norm shapes: y {tuple(y.shape)}, z {tuple(z.shape)}, weight {tuple(weight.shape)}"
        )
    if y.stride(1) != 1 or z.stride(1) != 1:
        raise ValueError("gated norm: y and z need unit stride along the width")
    if z.dtype != y.dtype or weight.dtype != y.dtype:
        raise ValueError(f"gated norm dtypes differ: y {y.dtype}, z {z.dtype}, weight {weight.dtype}")
    t, width = y.shape
    if groups <= 0 or width % groups:
        raise ValueError(f"gated norm: width {width} does not split into {groups} groups")
    d = width // groups
    if d > MAX_GROUP_ELEMENTS:
        raise ValueError(f"gated norm: a group of {d} elements is over {MAX_GROUP_ELEMENTS}")
    out = torch.empty_like(y, memory_format=torch.contiguous_format)
    if t == 0:
        return out
    block = triton.next_power_of_2(d)
    _gated_norm_kernel[(t, groups)](
        y,
        z,
        weight,
        out,
        y.stride(0),
        z.stride(0),
        out.stride(0),
        eps,
        D=d,
        BLOCK_D=block,
        num_warps=max(1, min(16, block // 512)),
    )
    return out
