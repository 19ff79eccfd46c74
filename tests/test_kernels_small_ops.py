"""Small-op Triton kernels (RMSNorm, residual add + RMSNorm, RoPE with Qwen3's q/k norm, SiLU-and-mul)
against their PyTorch references in overnight/layers/, and whole models with the kernels on.

Without a GPU, conftest.py turns on the Triton interpreter (fp32/fp16 only); with one, bf16 runs too.
Inputs are strided the way the models produce them (q/k views into a fused qkv row).
"""

from __future__ import annotations

import pytest
import torch

from overnight.kernels import dispatch
from overnight.kernels.activation import silu_and_mul
from overnight.kernels.rmsnorm import add_rms_norm, rms_norm
from overnight.kernels.rotary import qk_norm_rotary_inplace, rotary_inplace
from overnight.layers.activation import SiluAndMul, silu_and_mul_ref
from overnight.layers.norm import RMSNorm, add_rms_norm_ref, rms_norm_ref, use_kernels
from overnight.layers.rotary import RotaryEmbedding, rotary_ref
from overnight.loader.model_loader import load_model
from overnight.loader.resolve import resolve_source
from tests.kernel_helpers import DEVICE, run_steps
from tests.tiny_models import make_tiny_checkpoint

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
EPS = 1e-6


def rand(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(DEVICE, dtype)


def norm_weight(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (1.0 + 0.4 * (torch.rand(n, generator=gen) - 0.5)).to(DEVICE, dtype)


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32: within a few ulps. fp16/bf16: the kernels round where the reference does, so outputs are
    equal except where an fp32 ulp of difference (rsqrt, summation order) crosses a rounding boundary;
    such a flip moves a result by about an ulp of the op's inputs (more ulps of the result where the
    rotation cancels), hence a bound relative to |ref| plus the mean magnitude."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=2e-6, atol=2e-6)
        return
    out, ref, eps = out.float(), ref.float(), torch.finfo(out.dtype).eps
    assert ((out - ref).abs() <= 2 * eps * (ref.abs() + ref.abs().mean())).all()
    assert (out == ref).float().mean() >= 0.99


def qkv_views(
    num_tokens: int, hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fused qkv projection output [T, (Hq + 2 Hkv) * D] and its q [T, Hq, D], k [T, Hkv, D] views."""
    qkv = rand(num_tokens, (hq + 2 * hkv) * d, dtype=dtype, seed=seed, scale=2.0)
    q = qkv[:, : hq * d].view(num_tokens, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(num_tokens, hkv, d)
    return qkv, q, k


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [64, 96])  # a power of two, and one that needs masking
def test_rms_norm_matches_reference(dtype: torch.dtype, n: int) -> None:
    wide = rand(9, n + 32, dtype=dtype, seed=1, scale=3.0)
    x = wide[:, :n]  # row stride n + 32
    w = norm_weight(n, dtype, seed=2)
    out = rms_norm(x, w, EPS)
    assert out.is_contiguous()
    assert_matches(out, rms_norm_ref(x, w, EPS))
    # Leading dimensions beyond one are flattened.
    x3 = rand(2, 3, 4, n, dtype=dtype, seed=3)
    assert_matches(rms_norm(x3, w, EPS), rms_norm_ref(x3, w, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_3d_activations_wider_than_one_program(dtype: torch.dtype) -> None:
    """A vision tower's [images, tokens, width] (Gemma 3's projector: 256 x 1152) is rows, not heads:
    more than MAX_ROW_ELEMENTS per leading index are normalized row by row, as the reference does."""
    from overnight.kernels.rmsnorm import MAX_ROW_ELEMENTS

    x = rand(2, 129, 260, dtype=dtype, seed=6)  # 256 x 512 padded: past MAX_ROW_ELEMENTS
    assert 256 * 512 > MAX_ROW_ELEMENTS
    w = norm_weight(260, dtype, seed=7)
    out = rms_norm(x, w, EPS)
    assert out.shape == x.shape
    assert_matches(out, rms_norm_ref(x, w, EPS))
    residual = rand(2, 129, 260, dtype=dtype, seed=8)
    normed, new_residual = add_rms_norm(x, residual, w, EPS)
    ref_normed, ref_residual = add_rms_norm_ref(x, residual, w, EPS)
    assert_matches(normed, ref_normed)
    assert_matches(new_residual, ref_residual)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 16), (3, 1, 24)])
def test_rms_norm_per_head_on_qkv_views(dtype: torch.dtype, hq: int, hkv: int, d: int) -> None:
    qkv, q, k = qkv_views(7, hq, hkv, d, dtype, seed=4)
    before = qkv.clone()
    w = norm_weight(d, dtype, seed=5)
    assert_matches(rms_norm(q, w, EPS), rms_norm_ref(q, w, EPS))
    assert_matches(rms_norm(k, w, EPS), rms_norm_ref(k, w, EPS))
    assert torch.equal(qkv, before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_offset_rms_norm_matches_reference(dtype: torch.dtype) -> None:
    """The (1 + w) form of the hybrids (OffsetRMSNorm): hidden rows with and without a residual,
    and per head on q/k views, against the layer's PyTorch code."""
    from overnight.kernels.rmsnorm import offset_rms_norm
    from overnight.layers.norm import OffsetRMSNorm

    n = 80
    norm = OffsetRMSNorm(n, EPS).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(norm_weight(n, dtype, seed=9) - 1.0)  # stored centred on 0
    x = rand(11, 2 * n, dtype=dtype, seed=10)[:, n:]  # strided
    residual = rand(11, n, dtype=dtype, seed=11, scale=4.0)
    out, scale, dense, new_residual = offset_rms_norm(x, norm.weight, EPS)
    assert scale is None and dense is None and new_residual is None
    assert_matches(out, norm._norm(x))
    out, _, _, new_residual = offset_rms_norm(x, norm.weight, EPS, residual)
    assert new_residual is not None and torch.equal(new_residual, x + residual)
    assert_matches(out, norm._norm(x + residual))
    _, q, k = qkv_views(7, 4, 2, 16, dtype, seed=12)
    head = OffsetRMSNorm(16, EPS).to(DEVICE, dtype)
    with torch.no_grad():
        head.weight.copy_(norm_weight(16, dtype, seed=13) - 1.0)
    for view in (q, k):
        assert_matches(offset_rms_norm(view, head.weight, EPS)[0], head._norm(view))


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_matches_reference(dtype: torch.dtype) -> None:
    n = 80
    x = rand(11, 2 * n, dtype=dtype, seed=6)[:, n:]  # strided
    residual = rand(11, n, dtype=dtype, seed=7, scale=4.0)
    x0, r0 = x.clone(), residual.clone()
    w = norm_weight(n, dtype, seed=8)
    normed, new_residual = add_rms_norm(x, residual, w, EPS)
    ref_normed, ref_residual = add_rms_norm_ref(x, residual, w, EPS)
    assert torch.equal(new_residual, ref_residual)  # one rounded add, bit for bit
    assert_matches(normed, ref_normed)
    assert torch.equal(x, x0) and torch.equal(residual, r0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 16), (3, 1, 24)])
@pytest.mark.parametrize("with_norm", [False, True])
def test_rotary_in_place_on_qkv_views(dtype: torch.dtype, hq: int, hkv: int, d: int, with_norm: bool) -> None:
    num_tokens = 9
    rope = RotaryEmbedding(d, 300, 10000.0).to(DEVICE)
    positions = torch.tensor([0, 1, 7, 299, 64, 3, 3, 150, 42], device=DEVICE)
    qkv, q, k = qkv_views(num_tokens, hq, hkv, d, dtype, seed=9)
    before = qkv.clone()
    if with_norm:
        wq, wk = norm_weight(d, dtype, seed=10), norm_weight(d, dtype, seed=11)
        ref_q, ref_k = rotary_ref(
            positions, rms_norm_ref(q, wq, EPS), rms_norm_ref(k, wk, EPS), rope.cos_sin_cache
        )
        qk_norm_rotary_inplace(positions.int(), q, k, rope.cos_sin_cache, wq, wk, EPS)
    else:
        ref_q, ref_k = rotary_ref(positions, q, k, rope.cos_sin_cache)
        rotary_inplace(positions, q, k, rope.cos_sin_cache)
        # Without the norm every op rounds as the reference's does (the kernel forbids fma contraction,
        # which on a GPU left 1 output in 7 an ulp off in fp16/bf16): bit for bit, on any device.
        assert torch.equal(q, ref_q) and torch.equal(k, ref_k)
    assert_matches(q, ref_q)
    assert_matches(k, ref_k)
    assert torch.equal(qkv[:, (hq + hkv) * d :], before[:, (hq + hkv) * d :])  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference(dtype: torch.dtype) -> None:
    inter = 300  # not a multiple of the block: the last block is masked
    x = rand(5, 2 * inter + 16, dtype=dtype, seed=12, scale=4.0)[:, : 2 * inter]  # strided rows
    assert_matches(silu_and_mul(x, block=128), silu_and_mul_ref(x))
    x3 = rand(2, 3, 2 * inter, dtype=dtype, seed=13, scale=4.0)
    out = torch.full((2, 3, inter), float("nan"), dtype=dtype, device=DEVICE)
    assert silu_and_mul(x3, out=out) is out
    assert_matches(out, silu_and_mul_ref(x3))


def test_empty_batches_and_bad_inputs() -> None:
    w = norm_weight(16, torch.float32, seed=0)
    assert rms_norm(torch.empty(0, 16, device=DEVICE), w, EPS).shape == (0, 16)
    assert silu_and_mul(torch.empty(0, 32, device=DEVICE)).shape == (0, 16)
    with pytest.raises(ValueError, match="unit stride"):
        rms_norm(torch.zeros(16, 4, device=DEVICE).t(), torch.ones(16, device=DEVICE), EPS)
    with pytest.raises(ValueError, match="must match"):
        rms_norm(torch.zeros(3, 16, device=DEVICE, dtype=torch.float16), w, EPS)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        q, k = torch.zeros(2, 4, 16, device=DEVICE), torch.zeros(2, 2, 16, device=DEVICE)
        rotary_inplace(
            torch.zeros(2, dtype=torch.long, device=DEVICE), q, k, torch.zeros(8, 32, device=DEVICE)
        )


# ---------------------------------------------------------------------------------------------------
# The layers' path choice, and whole models with the kernels on.


def test_path_choice(monkeypatch) -> None:
    assert not use_kernels(torch.zeros(1))  # CPU: the PyTorch path
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", True)
    assert use_kernels(torch.zeros(1))
    if DEVICE == "cuda":
        assert use_kernels(torch.zeros(1, device=DEVICE))
        monkeypatch.setattr(dispatch, "FORCE_KERNELS", False)
        assert not use_kernels(torch.zeros(1, device=DEVICE))


def test_layers_dispatch_to_kernels(monkeypatch) -> None:
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", True)
    torch.manual_seed(0)
    hq, hkv, d = 4, 2, 16
    norm, q_norm, k_norm = RMSNorm(64).to(DEVICE), RMSNorm(d).to(DEVICE), RMSNorm(d).to(DEVICE)
    for m in (norm, q_norm, k_norm):
        torch.nn.init.uniform_(m.weight, 0.8, 1.2)
    x, residual = torch.randn(6, 64, device=DEVICE), torch.randn(6, 64, device=DEVICE)
    out, new_residual = norm(x, residual)
    ref_out, ref_residual = add_rms_norm_ref(x, residual, norm.weight, norm.variance_epsilon)
    assert torch.equal(new_residual, ref_residual)
    assert_matches(out, ref_out)

    rope = RotaryEmbedding(d, 64, 10000.0).to(DEVICE)
    positions = torch.arange(6, device=DEVICE) * 7
    qkv = torch.randn(6, (hq + 2 * hkv) * d, device=DEVICE)
    q, k = qkv[:, : hq * d].view(6, hq, d), qkv[:, hq * d : (hq + hkv) * d].view(6, hkv, d)
    ref_q, ref_k = rotary_ref(positions, q_norm(q), k_norm(k), rope.cos_sin_cache)
    out_q, out_k = rope(positions, q, k, q_norm=q_norm, k_norm=k_norm)
    assert out_q.data_ptr() == q.data_ptr()  # rotated in place
    assert_matches(out_q, ref_q)
    assert_matches(out_k, ref_k)

    y = torch.randn(6, 2 * 40, device=DEVICE)
    assert_matches(SiluAndMul()(y), silu_and_mul_ref(y))


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_model_forward_with_kernels_matches_pytorch_path(family: str, tmp_path, monkeypatch) -> None:
    folder = make_tiny_checkpoint(tmp_path, family)
    model = load_model(resolve_source(str(folder)), torch.float32, DEVICE)
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", False)
    expected = run_steps(model)
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", True)
    got = run_steps(model)
    # fp32 sums in another order (kernel vs torch) move logits of size ~10 by ~1e-5: the bound scales.
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * max(1.0, float(expected.abs().max())))


def test_default_num_warps_are_powers_of_two():
    # SmolLM2 (hidden 576, 9 q / 3 kv heads, head_dim 64) once asked the GPU for 5 warps.
    from overnight.kernels import rmsnorm, rotary

    for elements in range(1, 40000, 37):
        for fn in (rmsnorm._num_warps, rotary._num_warps):
            w = fn(elements)
            assert w >= 1 and w & (w - 1) == 0, (fn.__module__, elements, w)
