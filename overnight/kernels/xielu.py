"""xIELU (Apertus' MLP activation) as one elementwise pass: [..., I] -> [..., I] in x's dtype.

Reference: xielu_ref in overnight/layers/xielu.py (the layer's CPU path, transformers' arithmetic).

Each program handles BLOCK consecutive elements of the contiguous input. The two learned scalars are
read from device memory (softplus taken in the kernel), so launches depend only on shapes and pointers:
safe to capture in a CUDA graph, no host sync. Everything is computed in fp32 and rounded once at the
store (the reference rounds after each of its ops in the input dtype: bf16 results may differ in the
last bit). expm1 of the clamped negative input uses its series near 0, where exp(x) - 1 would
lose the small difference expm1(x) - x that the negative branch is made of (its quartic series above
-0.01).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

XIELU_BLOCK = 1024


@triton.jit
def _softplus(a):
    return tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))  # torch's threshold 20


@triton.jit
def _xielu_kernel(x_ptr, out_ptr, alpha_p_ptr, alpha_n_ptr, n, beta, eps, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x_in = tl.load(x_ptr + offs, mask=mask, other=0.0)
    x = x_in.to(tl.float32)
    a_p = _softplus(tl.load(alpha_p_ptr).to(tl.float32))
    a_n = beta + _softplus(tl.load(alpha_n_ptr).to(tl.float32))
    m = tl.minimum(x, eps)
    series = m + m * m * (0.5 + m * (1.0 / 6.0 + m * (1.0 / 24.0)))  # |error| < 1e-12 above -0.01
    em1 = tl.where(m > -1e-2, series, tl.exp(m) - 1.0)
    y = tl.where(x > 0, a_p * x * x + beta * x, (em1 - x) * a_n + beta * x)
    tl.store(out_ptr + offs, y.to(x_in.dtype), mask=mask)


def xielu(
    x: torch.Tensor, alpha_p: torch.Tensor, alpha_n: torch.Tensor, beta: float, eps: float
) -> torch.Tensor:
    """x contiguous; alpha_p, alpha_n: one-element tensors on x's device (the raw, pre-softplus
    parameters). Returns xIELU(x) in x's dtype."""
    if not x.is_contiguous():
        raise ValueError("x must be contiguous")
    for name, a in (("alpha_p", alpha_p), ("alpha_n", alpha_n)):
        if a.numel() != 1 or a.device != x.device:
            raise ValueError(f"{name} must be one element on {x.device}, got {tuple(a.shape)} on {a.device}")
    out = torch.empty_like(x)
    n = x.numel()
    if n:
        grid = (triton.cdiv(n, XIELU_BLOCK),)
        _xielu_kernel[grid](x, out, alpha_p, alpha_n, n, float(beta), float(eps), BLOCK=XIELU_BLOCK)
    return out
