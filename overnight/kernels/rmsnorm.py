"""RMSNorm in one pass over each row: plain, fused with the residual add before it, and per attention head.

Reference: rms_norm_ref and add_rms_norm_ref in overnight/layers/norm.py (the layer's CPU path).

One program normalizes everything of one token t, seen as H rows of D elements:

    x[t, h, d]  at  x_ptr + t * stride_t + h * stride_h + d        (unit stride along d)

H = 1 for the hidden-state norm ([T, N] -> D = N); H = heads for Qwen3's q/k norm over [T, H, D], where
q and k are views into the fused qkv projection output (stride_t = (Hq + 2 Hkv) * D, stride_h = D).

Rounding follows the reference step by step (statistics in fp32; the residual sum rounded to the
activation dtype before its statistics; the normalized value rounded before the weight multiply, the
product rounded again), so low-precision outputs equal the reference's in nearly every element.
With an FP8 output (rms_norm_fp8, add_rms_norm_fp8: the input of an FP8 linear layer) the program
quantizes its normalized row, as rounded above, before storing it: e4m3 data and one float32 scale per
token, the arithmetic of quantize_activation_ref in overnight/quant/fp8.py (kernels/fp8_quant.py's
quantize_tile). The row is already in registers, so the quantization costs no memory traffic and the
store is half the bytes of a bf16 one.

The offset form (offset_rms_norm: Qwen3.5 / Qwen3-Next, reference OffsetRMSNorm in layers/norm.py)
multiplies by (1 + w) in float32 and rounds once, as HF does for those models: the normalized value is
not rounded before the multiply. With an FP8 output it can store the rounded rows too (dense_out), for
an output that also feeds layers kept in the compute dtype.

Launches depend only on shapes, strides and pointers: safe to capture in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from overnight.kernels.fp8_quant import FP8, quantize_tile

# A whole row (H * D elements) lives in registers; past this, registers spill.
MAX_ROW_ELEMENTS = 32768


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    scale_ptr,
    dense_ptr,
    stride_xt,
    stride_xh,
    stride_rt,
    stride_rh,
    stride_ot,
    stride_oh,
    stride_rot,
    stride_roh,
    eps,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    FP8_OUT: tl.constexpr,
    OFFSET: tl.constexpr,  # weight (1 + w), the normalized value kept in fp32 (the offset form)
    DENSE_OUT: tl.constexpr,  # with FP8_OUT: the rows in x's dtype too, at dense_ptr (out's layout)
):
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < H) & (offs_d[None, :] < D)
    x = tl.load(x_ptr + t * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :], mask=mask, other=0.0)
    dtype = x.dtype
    if HAS_RESIDUAL:
        r = tl.load(
            res_ptr + t * stride_rt + offs_h[:, None] * stride_rh + offs_d[None, :], mask=mask, other=0.0
        )
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(res_out_ptr + t * stride_rot + offs_h[:, None] * stride_roh + offs_d[None, :], x, mask=mask)

    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=1) / D  # masked lanes hold 0
    rstd = tl.math.rsqrt(variance + eps)
    w = tl.load(w_ptr + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
    if OFFSET:
        y = (xf * rstd[:, None] * (1.0 + w[None, :])).to(dtype)
    else:
        normed = (xf * rstd[:, None]).to(dtype).to(tl.float32)
        y = (w[None, :] * normed).to(dtype)
    if FP8_OUT:  # masked lanes hold 0 and leave the amax alone
        data, scale = quantize_tile(y.to(tl.float32))
        tl.store(out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :], data, mask=mask)
        tl.store(scale_ptr + t * H + offs_h, scale, mask=offs_h < H)
        if DENSE_OUT:
            tl.store(dense_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :], y, mask=mask)
    else:
        tl.store(out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :], y, mask=mask)


def _num_warps(elements: int) -> int:
    # About 8 elements (16 bytes of bf16) per thread, 1 to 16 warps.
    # Triton needs a power of two (hidden sizes like 576 would give 5 or 9 warps otherwise).
    want = max(1, min(16, elements // 256))
    return 1 << (want.bit_length() - 1)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """x as [T, H, D] without copying when it is 2-D or 3-D with unit stride along D (the shapes the
    models pass); other ranks, and 3-D ones whose H x D exceed one program's MAX_ROW_ELEMENTS (a
    vision tower's [images, tokens, width]: no heads, just rows), are flattened to [T, 1, D] (a copy
    only where a view is impossible)."""
    if (
        x.dim() == 3
        and triton.next_power_of_2(x.shape[1]) * triton.next_power_of_2(x.shape[2]) <= MAX_ROW_ELEMENTS
    ):
        return x
    if x.dim() == 2:
        return x.unsqueeze(1)
    return x.reshape(-1, 1, x.shape[-1])


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight must be [{x.shape[-1]}], got {tuple(weight.shape)}")
    if weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"weight ({weight.dtype}, {weight.device}) must match x ({x.dtype}, {x.device})")
    if x.stride(-1) != 1 or weight.stride(0) != 1:
        raise ValueError("x and weight must have unit stride along the normalized dimension")


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    num_warps: int | None,
    fp8_out: bool = False,
    offset: bool = False,
    dense_out: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(normed, new residual or None, per-token scale [T, 1] when fp8_out else None, the rows in x's
    dtype when fp8_out and dense_out else None)."""
    rows = _as_rows(x)
    num_tokens, num_heads, dim = rows.shape
    block_h, block_d = triton.next_power_of_2(num_heads), triton.next_power_of_2(dim)
    if block_h * block_d > MAX_ROW_ELEMENTS:
        raise ValueError(f"a row of {num_heads} x {dim} elements exceeds {MAX_ROW_ELEMENTS}")
    out = torch.empty(rows.shape, dtype=FP8 if fp8_out else x.dtype, device=x.device)
    scale = torch.empty((num_tokens, num_heads), dtype=torch.float32, device=x.device) if fp8_out else None
    dense = torch.empty(rows.shape, dtype=x.dtype, device=x.device) if fp8_out and dense_out else None
    res_rows = res_out = rows  # unused placeholders without a residual
    if residual is not None:
        res_rows = _as_rows(residual)
        res_out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if num_tokens > 0:
        _rms_norm_kernel[(num_tokens,)](
            rows,
            res_rows,
            weight,
            out,
            res_out,
            scale if scale is not None else out,
            dense if dense is not None else out,
            rows.stride(0),
            rows.stride(1),
            res_rows.stride(0),
            res_rows.stride(1),
            out.stride(0),
            out.stride(1),
            res_out.stride(0),
            res_out.stride(1),
            eps,
            H=num_heads,
            D=dim,
            BLOCK_H=block_h,
            BLOCK_D=block_d,
            HAS_RESIDUAL=residual is not None,
            FP8_OUT=fp8_out,
            OFFSET=offset,
            DENSE_OUT=dense is not None,
            num_warps=num_warps or _num_warps(block_h * block_d),
        )
    new_residual = res_out.view(x.shape) if residual is not None else None
    return out.view(x.shape), new_residual, scale, dense.view(x.shape) if dense is not None else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, num_warps: int | None = None) -> torch.Tensor:
    """weight * x / rms(x) over the last dimension; returns a new contiguous tensor shaped like x.

    x: [T, N], or [T, H, D] to normalize each head separately (Qwen3's q/k norm); any row and head
    strides, unit stride along the last dimension. weight: [last dim], x's dtype.
    """
    _check(x, weight)
    return _launch(x, None, weight, eps, num_warps)[0]


def rms_norm_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, num_warps: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm(x) quantized per token: (data [T, N] e4m3, scale [T, 1] float32). x: [T, N]."""
    _check(x, weight)
    _check_2d(x)
    normed, _, scale, _ = _launch(x, None, weight, eps, num_warps, fp8_out=True)
    assert scale is not None
    return normed, scale


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass; the sum is rounded to x's dtype, as the
    reference adds in the activation dtype. Inputs are not modified; both outputs are new tensors."""
    _check_residual(x, residual, weight)
    normed, new_residual, _, _ = _launch(x, residual, weight, eps, num_warps)
    assert new_residual is not None
    return normed, new_residual


def add_rms_norm_fp8(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """add_rms_norm with the normalized rows quantized per token: (data [T, N] e4m3, scale [T, 1]
    float32, x + residual in x's dtype). x, residual: [T, N]."""
    _check_residual(x, residual, weight)
    _check_2d(x)
    normed, new_residual, scale, _ = _launch(x, residual, weight, eps, num_warps, fp8_out=True)
    assert new_residual is not None and scale is not None
    return normed, scale, new_residual


def offset_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    fp8_out: bool = False,
    dense_out: bool = False,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The offset form, x / rms(x) * (1 + w) (see the module docstring), of x or of x + residual.
    Returns (out, scale, dense, new residual): out in x's dtype, or e4m3 with scale [T, 1] float32
    when fp8_out (x then [T, N]); dense, with fp8_out and dense_out, the rows in x's dtype; the new
    residual x + residual when one is given. x may be [T, H, D] as for rms_norm."""
    if residual is None:
        _check(x, weight)
    else:
        _check_residual(x, residual, weight)
    if fp8_out:
        _check_2d(x)
    out, new_residual, scale, dense = _launch(
        x, residual, weight, eps, num_warps, fp8_out=fp8_out, offset=True, dense_out=dense_out
    )
    return out, scale, dense, new_residual


def _check_residual(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> None:
    _check(x, weight)
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError(
            f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}"
        )
    if residual.stride(-1) != 1:
        raise ValueError("residual must have unit stride along the normalized dimension")


def _check_2d(x: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"an FP8 output needs x as [T, N] (one scale per token), got {tuple(x.shape)}")
