"""The Mamba2 gated output norm's kernel (kernels/mamba2_gated_norm.py) against mamba_gated_norm_ref
(layers/mamba2.py): one group over the whole width (Granite 4.0) and several (Nemotron-H), group sizes
that are not powers of two, the gate a strided view into a wider projection as the mixer hands it over,
and the layer taking the kernel path; the tensor-parallel passes (each share's sums of squares written
into a column, the summed statistics read back) against the whole norm; the wrapper's checks.

On a CPU-only machine conftest.py turns on the Triton interpreter (fp32/fp16, tiny shapes)."""

from __future__ import annotations

import pytest
import torch

from overnight.kernels.mamba2_gated_norm import gated_sum_squares, mamba_gated_norm
from overnight.layers.mamba2 import MambaGatedRMSNorm, mamba_gated_norm_ref
from tests.kernel_helpers import DEVICE, DTYPES, TOL


def _inputs(t: int, width: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    y = torch.randn(t, width, generator=gen)
    y[:, : width // 2] *= 3.0  # the groups' scales differ, so a whole-width norm would not match
    proj = torch.randn(t, 7 + 2 * width, generator=gen).to(DEVICE, dtype)
    z = proj[:, 7 : 7 + width]  # a view at an offset into a wider row
    w = torch.rand(width, generator=gen) + 0.5
    return y.to(DEVICE, dtype), z, w.to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("width", "groups"), [(48, 1), (48, 2), (60, 4), (40, 8)])
def test_matches_the_reference(dtype: torch.dtype, width: int, groups: int) -> None:
    y, z, w = _inputs(5, width, dtype)
    assert z.stride(0) != width  # a strided gate, as the mixer passes it
    got = mamba_gated_norm(y, z, w, 1e-5, groups)
    want = mamba_gated_norm_ref(y, z, w, 1e-5, groups)
    assert got.dtype == dtype and got.shape == y.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype])
    if groups > 1:  # the grouping is what is computed: the whole-width norm differs
        whole = mamba_gated_norm_ref(y, z, w, 1e-5, 1)
        assert not torch.allclose(got.float(), whole.float(), atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("world", [2, 3])
def test_given_sums_of_squares_give_the_whole_norm(dtype: torch.dtype, world: int) -> None:
    """Shares of one norm slice: each share's sums go into its column of a [T, world] tensor (a strided
    view), the columns' sum normalizes every share as the whole slice's norm does."""
    width = 20 * world
    y, z, w = _inputs(5, width, dtype)
    share = width // world
    squares = torch.zeros(5, world, dtype=torch.float32, device=DEVICE)
    for r in range(world):
        cols = slice(r * share, (r + 1) * share)
        gated_sum_squares(y[:, cols], z[:, cols], squares[:, r])
    g = y.float() * torch.nn.functional.silu(z.float())
    torch.testing.assert_close(squares.sum(-1), g.pow(2).sum(-1), rtol=1e-5, atol=1e-5)
    total = squares.sum(-1)
    want = mamba_gated_norm_ref(y, z, w, 1e-5, 1)
    for r in range(world):
        cols = slice(r * share, (r + 1) * share)
        got = mamba_gated_norm(y[:, cols], z[:, cols], w[cols], 1e-5, 1, sum_squares=total, count=width)
        torch.testing.assert_close(got.float(), want[:, cols].float(), rtol=TOL[dtype], atol=TOL[dtype])
    with pytest.raises(ValueError, match="given sums need groups 1"):
        mamba_gated_norm(y, z, w, 1e-5, 2, sum_squares=total, count=width)
    with pytest.raises(ValueError, match="not \\(5,\\) float32"):
        gated_sum_squares(y, z, squares)


def test_the_layer_takes_the_kernel_path(monkeypatch) -> None:
    from overnight.kernels import dispatch

    y, z, w = _inputs(3, 40, torch.float32, seed=1)
    norm = MambaGatedRMSNorm(40, 1e-5, groups=4).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(w)
    calls: list[int] = []
    import overnight.kernels.mamba2_gated_norm as kernel

    real = kernel.mamba_gated_norm

    def counted(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(kernel, "mamba_gated_norm", counted)
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", True)
    got = norm(y, z)
    assert calls == [1]
    torch.testing.assert_close(got, mamba_gated_norm_ref(y, z, w, 1e-5, 4), rtol=1e-4, atol=1e-4)


def test_empty_batches_and_bad_inputs() -> None:
    y, z, w = _inputs(2, 48, torch.float32)
    assert mamba_gated_norm(y[:0], z[:0], w, 1e-5, 2).shape == (0, 48)
    with pytest.raises(ValueError, match="does not split into 5 groups"):
        mamba_gated_norm(y, z, w, 1e-5, 5)
    with pytest.raises(ValueError, match="shapes"):
        mamba_gated_norm(y, z[:, :40], w, 1e-5, 2)
    with pytest.raises(ValueError, match="unit stride"):
        mamba_gated_norm(y.t().contiguous().t(), z, w, 1e-5, 2)
    with pytest.raises(ValueError, match="dtypes differ"):
        mamba_gated_norm(y, z.half(), w, 1e-5, 2)
