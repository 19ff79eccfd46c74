"""Dynamic symmetric int8 quantization of activations, one scale per token (the W8A8 layers' input).

Reference: quantize_int8_ref below (Int8Linear's reference path): amax of the row in fp32, floored at 1e-12; scale = amax / 127; codes = round-half-even(x /
scale) clamped to [-127, 127]. Both quotients are correctly rounded (div_rn) and the rounding is the
fp32 magic-number trick (adding and subtracting 1.5 * 2^23 rounds half to even for |v| < 2^22, and
|x / scale| <= 127), so the kernel's codes and scales equal the reference's bit for bit.

One program quantizes one token (its K values in registers). Launches depend only on shapes: safe in a
CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MIN_AMAX = 1e-12
MAX_ROW_ELEMENTS = 32768


@triton.jit
def _int8_quant_kernel(x_ptr, q_ptr, s_ptr, stride_xt, stride_qt, K, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(x_ptr + t * stride_xt + offs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12)
    scale = tl.math.div_rn(amax, 127.0)
    v = tl.math.div_rn(x, scale)
    v = (v + 12582912.0) - 12582912.0  # + and - 1.5 * 2^23: round half to even
    v = tl.clamp(v, -127.0, 127.0)
    tl.store(q_ptr + t * stride_qt + offs, v.to(tl.int8), mask=mask)
    tl.store(s_ptr + t, scale)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (unit stride along K) -> (codes [T, K] int8, scale [T, 1] float32)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, K] with unit stride along K, got {tuple(x.shape)} {x.stride()}")
    t, k = x.shape
    if k > MAX_ROW_ELEMENTS:
        raise ValueError(f"rows of {k} values are more than one program holds ({MAX_ROW_ELEMENTS})")
    codes = torch.empty(t, k, dtype=torch.int8, device=x.device)
    scale = torch.empty(t, 1, dtype=torch.float32, device=x.device)
    if t == 0:
        return codes, scale
    block = triton.next_power_of_2(k)
    warps = 1 << (max(1, min(16, block // 256)).bit_length() - 1)
    _int8_quant_kernel[(t,)](x, codes, scale, x.stride(0), codes.stride(0), k, BLOCK=block, num_warps=warps)
    return codes, scale


def quantize_int8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The arithmetic in torch: (codes [T, K] int8, scale [T, 1] float32), x ~ codes * scale."""
    amax = x.float().abs().amax(dim=-1, keepdim=True).clamp_min(MIN_AMAX)
    scale = amax / 127.0
    codes = torch.round(x.float() / scale).clamp_(-127, 127).to(torch.int8)
    return codes, scale
