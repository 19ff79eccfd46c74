"""The gated RMSNorm at the end of a Mamba2 mixer, in one pass: out = w * rms_norm(y * silu(z)), the
statistics over each of G equal groups of the width on its own (G = 1: the whole width, Granite 4.0;
G = n_groups: Nemotron-H).

Reference: mamba_gated_norm_ref in overnight/layers/mamba2.py (the layer's CPU path). Rounding follows
it: the gated value and its statistics in fp32, the normalized value rounded to y's dtype before the
weight multiply, the product rounded again.

    y [T, W]  (unit stride along W)          z [T, W]  (a view into in_proj's output: any row stride)
    program (t, g) reads y[t, g*D:(g+1)*D] and z[t, g*D:(g+1)*D], D = W / G, and writes out[t, same]

Under tensor parallelism a norm slice may span several ranks (Granite's whole width; layers/mamba2.py
sharded_gated_norm): gated_sum_squares writes each token's sum of squares of its share (one float32 a
token, at any stride), the ranks sum them, and mamba_gated_norm(..., sum_squares=, count=) normalizes
by the given sums instead of its own.

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
    sums_ptr,  # MODE 1: written, MODE 2: read (one float32 a token); unused in MODE 0
    stride_st,
    eps,
    count,  # MODE 2: the elements the given sums cover
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MODE: tl.constexpr,  # 0: normalize by own statistics; 1: write the sums of squares; 2: read them
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * D + tl.arange(0, BLOCK_D)
    mask = tl.arange(0, BLOCK_D) < D
    y = tl.load(y_ptr + t * stride_yt + offs, mask=mask, other=0.0)
    z = tl.load(z_ptr + t * stride_zt + offs, mask=mask, other=0.0).to(tl.float32)
    dtype = y.dtype
    g = y.to(tl.float32) * (z / (1.0 + tl.exp(-z)))
    if MODE == 1:
        tl.store(sums_ptr + t * stride_st, tl.sum(g * g, axis=0))
    else:
        if MODE == 2:
            rstd = 1.0 / tl.sqrt(tl.load(sums_ptr + t * stride_st) / count + eps)
        else:
            rstd = 1.0 / tl.sqrt(tl.sum(g * g, axis=0) / D + eps)
        normed = (g * rstd).to(dtype).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * stride_ot + offs, (w * normed).to(dtype), mask=mask)


def _group_size(y: torch.Tensor, z: torch.Tensor, groups: int) -> int:
    """The group size D, after refusing inputs the kernel cannot take."""
    if y.dim() != 2 or z.shape != y.shape:
        raise ValueError(f"gated norm shapes: y {tuple(y.shape)}, z {tuple(z.shape)}")
    if y.stride(1) != 1 or z.stride(1) != 1:
        raise ValueError("gated norm: y and z need unit stride along the width")
    if z.dtype != y.dtype:
        raise ValueError(f"gated norm dtypes differ: y {y.dtype}, z {z.dtype}")
    width = y.shape[1]
    if groups <= 0 or width % groups:
        raise ValueError(f"gated norm: width {width} does not split into {groups} groups")
    d = width // groups
    if d > MAX_GROUP_ELEMENTS:
        raise ValueError(f"gated norm: a group of {d} elements is over {MAX_GROUP_ELEMENTS}")
    return d


def _check_sums(sums: torch.Tensor, t: int) -> None:
    if sums.shape != (t,) or sums.dtype != torch.float32:
        raise ValueError(f"gated norm sums of squares: {tuple(sums.shape)} {sums.dtype}, not ({t},) float32")


def mamba_gated_norm(
    y: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    groups: int,
    sum_squares: torch.Tensor | None = None,
    count: int = 0,
) -> torch.Tensor:
    """[T, W] y and z (same dtype; unit stride along W), weight [W] -> [T, W] in y's dtype.
    sum_squares [T] float32 (groups 1 only): each token's statistics given, summed over `count`
    elements (the whole norm slice, of which y is a share)."""
    d = _group_size(y, z, groups)
    if weight.shape != (y.shape[1],):
        raise ValueError(f"gated norm shapes: y {tuple(y.shape)}, weight {tuple(weight.shape)}")
    if weight.dtype != y.dtype:
        raise ValueError(f"gated norm dtypes differ: y {y.dtype}, weight {weight.dtype}")
    if sum_squares is not None:
        _check_sums(sum_squares, y.shape[0])
        if groups != 1 or count < y.shape[1]:
            raise ValueError(f"gated norm: given sums need groups 1 and count >= the width {y.shape[1]}")
    out = torch.empty_like(y, memory_format=torch.contiguous_format)
    if y.shape[0]:
        sums = out if sum_squares is None else sum_squares  # MODE 0 never reads it
        mode = 0 if sum_squares is None else 2
        _launch(y, z, weight, out, sums, eps, count, groups, d, mode)
    return out


def gated_sum_squares(y: torch.Tensor, z: torch.Tensor, out: torch.Tensor) -> None:
    """Each token's sum of squares of y * silu(z) ([T, W], unit stride along W) into out [T] float32
    (any stride: a column of a [T, world] tensor), in fp32 as mamba_gated_norm computes it."""
    d = _group_size(y, z, 1)
    _check_sums(out, y.shape[0])
    if y.shape[0]:
        _launch(y, z, y, y, out, 0.0, 0, 1, d, 1)  # MODE 1 reads no weight and writes only `out`


def _launch(
    y: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    sums: torch.Tensor,
    eps: float,
    count: int,
    groups: int,
    d: int,
    mode: int,
) -> None:
    block = triton.next_power_of_2(d)
    _gated_norm_kernel[(y.shape[0], groups)](
        y,
        z,
        weight,
        out,
        y.stride(0),
        z.stride(0),
        out.stride(0),
        sums,
        sums.stride(0),
        eps,
        float(count),
        D=d,
        BLOCK_D=block,
        MODE=mode,
        num_warps=max(1, min(16, block // 512)),
    )
