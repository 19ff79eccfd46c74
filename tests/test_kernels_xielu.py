"""The xIELU kernel (kernels/xielu.py) against its PyTorch reference (layers/xielu.py), on the GPU or
through the Triton interpreter: both signs, the clamp at eps, values near 0 (the expm1 series), the
softplus threshold of the learned scalars, and a ragged length."""

from __future__ import annotations

import pytest
import torch

from overnight.layers.xielu import XIELU_BETA, XIELU_EPS, xielu_ref
from tests.kernel_helpers import DEVICE, DTYPES, TOL


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("alphas", [(0.3, -1.2), (25.0, 21.0), (-4.0, 0.0)])
def test_kernel_matches_reference(dtype, alphas):
    from overnight.kernels.xielu import xielu

    gen = torch.Generator().manual_seed(0)
    x = torch.cat([
        torch.randn(1500, generator=gen) * 4,
        torch.tensor([0.0, -1e-7, 1e-7, -1e-6, -2e-6, -5e-4, -2e-3, 30.0, -30.0]),
    ]).reshape(3, -1).to(DEVICE, dtype)  # fmt: skip
    alpha_p = torch.tensor([alphas[0]], device=DEVICE, dtype=dtype)
    alpha_n = torch.tensor([alphas[1]], device=DEVICE, dtype=dtype)
    got = xielu(x, alpha_p, alpha_n, XIELU_BETA, XIELU_EPS)
    # The reference in float32 (the kernel's arithmetic), rounded once like the kernel's store.
    want = xielu_ref(x.float(), alpha_p.float(), alpha_n.float(), XIELU_BETA, XIELU_EPS).to(dtype)
    assert got.shape == x.shape and got.dtype == dtype
    tol = TOL[dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * float(want.abs().max()) / 100)


def test_kernel_refuses_strided_input():
    from overnight.kernels.xielu import xielu

    x = torch.randn(4, 6, device=DEVICE).t()
    with pytest.raises(ValueError, match="contiguous"):
        xielu(x, torch.zeros(1, device=DEVICE), torch.zeros(1, device=DEVICE), XIELU_BETA, XIELU_EPS)


def test_kernel_is_accurate_just_below_zero():
    """Where exp(x) - 1 would lose expm1(x) - x (the negative branch's curvature), in float32."""
    from overnight.kernels.xielu import xielu

    x = -torch.logspace(-6, -3, 64, device=DEVICE)
    alpha_p, alpha_n = torch.zeros(1, device=DEVICE), torch.full((1,), 3.0, device=DEVICE)
    got = xielu(x, alpha_p, alpha_n, XIELU_BETA, XIELU_EPS)
    want = xielu_ref(x.double(), alpha_p.double(), alpha_n.double(), XIELU_BETA, XIELU_EPS)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-12)
