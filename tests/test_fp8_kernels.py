"""FP8 weights' arithmetic and kernels: the references in overnight/quant/fp8.py, and the Triton kernels
(per-token quantization, RMSNorm / SiLU-and-mul with FP8 outputs, the scaled GEMM) against them.

Without a GPU the kernels run in the Triton interpreter, fp32/fp16 inputs, with its fp8 conversion made
exact (tests/triton_fp8.py says why). Quantized outputs are compared as e4m3 codes: equal where the
kernel quantizes exactly what the reference quantizes, within one code where the value quantized comes
from a different (equally correct) fp32 summation order.
"""

from __future__ import annotations

import pytest
import torch

from overnight.kernels import dispatch
from overnight.kernels.activation import silu_and_mul, silu_and_mul_fp8
from overnight.kernels.fp8_gemm import GemmConfig, fp8_gemm
from overnight.kernels.fp8_quant import quantize_fp8
from overnight.kernels.rmsnorm import add_rms_norm, add_rms_norm_fp8, rms_norm, rms_norm_fp8
from overnight.layers.activation import silu_and_mul_ref
from overnight.layers.norm import add_rms_norm_ref, rms_norm_ref
from overnight.quant.fp8 import (
    FP8_DTYPE,
    QuantizedActivation,
    dequantize_activation_ref,
    dequantize_weight,
    expand_block_scales,
    quantize_activation_ref,
    quantize_weight,
    quantize_weight_blocks,
    quantize_weight_per_channel,
    requantize_per_channel,
    scaled_matmul_ref,
)
from overnight.quant.linear import Fp8Linear, scaled_mm_rowwise
from tests.triton_fp8 import exact_fp8_casts

pytestmark = pytest.mark.slow  # long Triton-interpreter runs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
EPS = 1e-6
# Small tiles for the interpreter; the kernel's own defaults are for the GPU.
TINY = GemmConfig(16, 16, 32, group_m=2, num_warps=4, num_stages=2)


@pytest.fixture(autouse=True)
def _exact_casts():
    with exact_fp8_casts():
        yield


def rand(*shape: int, dtype: torch.dtype = torch.float32, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(DEVICE, dtype)


def codes(x: torch.Tensor) -> torch.Tensor:
    """e4m3 values as integers ordered like the values they encode (sign-magnitude -> signed)."""
    bits = x.view(torch.uint8).to(torch.int32)
    magnitude = bits & 0x7F
    return torch.where(bits >= 0x80, -magnitude, magnitude)


def assert_same_codes(out: torch.Tensor, ref: torch.Tensor, ulps: int = 0) -> None:
    assert out.dtype == ref.dtype == FP8_DTYPE and out.shape == ref.shape
    apart = (codes(out) - codes(ref)).abs()
    assert int(apart.max()) <= ulps, f"{int((apart > ulps).sum())} codes differ by more than {ulps}"


# -- the references ------------------------------------------------------------------------------------


@pytest.mark.parametrize("group", [None, 32])
def test_activation_round_trip_within_half_a_step(group):
    x = rand(9, 100, seed=1, scale=3.0)
    x[4] = 0.0  # an all-zero row: zero data, a finite scale
    data, scale = quantize_activation_ref(x, group)
    assert data.dtype == FP8_DTYPE and scale.dtype == torch.float32
    assert scale.shape == (9, 1 if group is None else 4)
    back = dequantize_activation_ref(QuantizedActivation(data, scale))
    # e4m3 keeps 3 mantissa bits: half a step is 2^-4 relative, 2^-10 of the scale among subnormals
    step = scale.repeat_interleave(group or 100, dim=1)[:, :100] * 2.0**-10
    assert ((back - x).abs() <= x.abs() * 2.0**-4 + step).all()
    assert not data[4].float().any() and torch.isfinite(scale).all()
    # each row's (group's) largest magnitude lands on the format's maximum
    rows = data.float().abs().view(9, -1) if group is None else data.float().abs()[:, :96].view(9, 3, 32)
    assert (rows.amax(-1)[torch.arange(9) != 4] == 448).all()


def test_weight_layouts_round_trip():
    w = rand(40, 100, seed=2)
    data, scale = quantize_weight_per_channel(w)
    assert scale.shape == (40,)
    assert ((dequantize_weight(data, scale) - w).abs() <= w.abs() * 2.0**-4 + scale[:, None] * 2.0**-10).all()

    data, grid = quantize_weight_blocks(w, (16, 32))  # 40 x 100: partial blocks on both edges
    assert grid.shape == (3, 4)
    rows = expand_block_scales(grid, 16, 40)
    assert rows.shape == (40, 4) and torch.equal(rows[16:32], grid[1].expand(16, 4))
    back = dequantize_weight(data, rows)
    assert ((back - w).abs() <= w.abs() * 2.0**-4 + 2.0**-10 * rows.repeat_interleave(32, 1)[:, :100]).all()
    # the model's own block layout: one row per block row
    data1, scale1 = quantize_weight(w, 32)
    assert scale1.shape == (40, 4)
    # requantized per channel: a second rounding, so at most two half-steps away from the original
    again, per_row = requantize_per_channel(data, rows)
    assert per_row.shape == (40,)
    err = (dequantize_weight(again, per_row) - w).abs()
    assert (err <= w.abs() * 2.0**-3 + 2.0**-9 * per_row[:, None]).all()


def test_scaled_matmul_ref_is_dequantized_matmul():
    qa = QuantizedActivation(*quantize_activation_ref(rand(5, 64, seed=3)))
    w, s = quantize_weight_per_channel(rand(24, 64, seed=4))
    bias = rand(24, seed=5)
    y = scaled_matmul_ref(qa, w, s, bias, torch.float32)
    expected = (qa.data.double() * qa.scale.double()) @ (w.double() * s.double()[:, None]).T + bias.double()
    torch.testing.assert_close(y.double(), expected, rtol=1e-6, atol=1e-5)


# -- kernels against the references ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,group", [(64, None), (100, None), (96, 32), (100, 32)])
def test_quantize_kernel_is_bit_exact(dtype, k, group):
    wide = rand(7, k + 8, dtype=dtype, seed=6, scale=4.0)
    x = wide[:, 3 : 3 + k]  # a row stride wider than the row
    x[2] = 0
    data, scale = quantize_fp8(x, group)
    ref_data, ref_scale = quantize_activation_ref(x, group)
    assert_same_codes(data, ref_data)
    assert torch.equal(scale, ref_scale)


def test_quantize_kernel_edge_cases():
    data, scale = quantize_fp8(torch.empty(0, 64, device=DEVICE))
    assert data.shape == (0, 64) and scale.shape == (0, 1)
    huge = torch.tensor([[3e38, -1.0, 0.5, 1e-30]], device=DEVICE).repeat(1, 4)
    data, scale = quantize_fp8(huge)
    assert torch.isfinite(data.float()).all() and torch.equal(data, quantize_activation_ref(huge)[0])
    with pytest.raises(ValueError, match="unit stride"):
        quantize_fp8(rand(8, 4, seed=7).t())
    with pytest.raises(ValueError, match="power of two"):
        quantize_fp8(rand(4, 96, seed=7), 48)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_fp8_quantizes_the_normalized_row(dtype):
    x = rand(11, 96, dtype=dtype, seed=8)
    residual = rand(11, 96, dtype=dtype, seed=9, scale=4.0)
    w = (1.0 + 0.4 * rand(96, seed=10)).to(dtype)
    data, scale = rms_norm_fp8(x, w, EPS)
    # bit for bit what quantizing the unfused kernel's output gives ...
    ref_data, ref_scale = quantize_activation_ref(rms_norm(x, w, EPS))
    assert_same_codes(data, ref_data)
    assert torch.equal(scale, ref_scale)
    # ... and within one code of the PyTorch chain (rsqrt and sums may round differently)
    assert_same_codes(data, quantize_activation_ref(rms_norm_ref(x, w, EPS))[0], ulps=1)

    data, scale, new_residual = add_rms_norm_fp8(x, residual, w, EPS)
    normed, ref_residual = add_rms_norm(x, residual, w, EPS)
    assert torch.equal(new_residual, ref_residual)
    assert torch.equal(new_residual, add_rms_norm_ref(x, residual, w, EPS)[1])
    ref_data, ref_scale = quantize_activation_ref(normed)
    assert_same_codes(data, ref_data)
    assert torch.equal(scale, ref_scale)
    assert_same_codes(data, quantize_activation_ref(add_rms_norm_ref(x, residual, w, EPS)[0])[0], ulps=1)
    with pytest.raises(ValueError, match=r"\[T, N\]"):
        rms_norm_fp8(x.view(11, 6, 16), w[:16], EPS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_offset_rms_norm_fp8_and_dense_outputs(dtype):
    """The hybrids' (1 + w) norm quantizing its rows (and storing them too, dense_out) in one pass:
    bit for bit what quantizing the kernel's own unquantized output gives, within one code of the
    PyTorch chain (OffsetRMSNorm, then quantize_activation_ref)."""
    from overnight.kernels.rmsnorm import offset_rms_norm
    from overnight.layers.norm import OffsetRMSNorm

    x = rand(11, 96, dtype=dtype, seed=8)
    residual = rand(11, 96, dtype=dtype, seed=9, scale=4.0)
    norm = OffsetRMSNorm(96, EPS).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(0.4 * rand(96, seed=10))
    for res in (None, residual):
        plain, _, _, plain_residual = offset_rms_norm(x, norm.weight, EPS, res)
        for dense_out in (False, True):
            data, scale, dense, new_residual = offset_rms_norm(
                x, norm.weight, EPS, res, fp8_out=True, dense_out=dense_out
            )
            ref_data, ref_scale = quantize_activation_ref(plain)
            assert_same_codes(data, ref_data)
            assert scale is not None and torch.equal(scale, ref_scale)
            assert (dense is not None) == dense_out and (dense is None or torch.equal(dense, plain))
            assert (new_residual is None) == (res is None)
            if res is not None:
                assert new_residual is not None and plain_residual is not None
                assert torch.equal(new_residual, plain_residual)
            chain = norm._norm(x if res is None else x + res)
            assert_same_codes(data, quantize_activation_ref(chain)[0], ulps=1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [64, 80])
def test_silu_and_mul_fp8_quantizes_the_product(dtype, inter):
    x = rand(9, 2 * inter, dtype=dtype, seed=11, scale=3.0)
    data, scale = silu_and_mul_fp8(x)
    ref_data, ref_scale = quantize_activation_ref(silu_and_mul(x))
    assert_same_codes(data, ref_data)
    assert torch.equal(scale, ref_scale)
    assert_same_codes(data, quantize_activation_ref(silu_and_mul_ref(x))[0], ulps=1)
    empty = silu_and_mul_fp8(x[:0])
    assert empty[0].shape == (0, inter) and empty[1].shape == (0, 1)


def assert_gemm_close(out: torch.Tensor, ref: torch.Tensor, qa: QuantizedActivation, w: torch.Tensor) -> None:
    """An FP8 GEMM's fp32 output against the reference's (fp32 accumulation, w the dequantized weight).
    The interpreter accumulates in fp32 too: within 1e-5. A GPU's FP8 MMA does not: Hopper adds the
    products of each K step into an accumulator of about 14 significant bits (the kernel promotes to
    fp32 between steps); on an H200 outputs moved by up to 2^-13 of the products' absolute sum, so the
    bound there is 2^-11 of that sum: far below what a wrong scale, row or group would do."""
    err = (out.float() - ref.float()).abs()
    slack = 1e-5 * (1 + ref.float().abs())
    if out.is_cuda:
        slack = slack + 2**-11 * (dequantize_activation_ref(qa).abs() @ w.float().abs().T)
    assert (err <= slack).all(), f"{int((err > slack).sum())} outputs off, worst {float(err.max()):.3g}"


def _gemm_case(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return rand(m, k, seed=seed, scale=2.0), rand(n, k, seed=seed + 1) / k**0.5


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,n,k", [(7, 40, 96), (33, 48, 100)])  # partial tiles; K not a multiple of 32
def test_gemm_per_channel(out_dtype, m, n, k):
    x, w = _gemm_case(m, n, k, seed=12)
    qa = QuantizedActivation(*quantize_activation_ref(x))
    data, scale = quantize_weight_per_channel(w)
    bias = rand(n, seed=14)
    y = fp8_gemm(qa.data, qa.scale, data, scale, out_dtype, bias=bias, config=TINY)
    ref = scaled_matmul_ref(qa, data, scale, bias, torch.float32)
    assert y.dtype == out_dtype
    torch.testing.assert_close(y.float(), ref, rtol=2e-3 if out_dtype == torch.float16 else 1e-5, atol=1e-4)


@pytest.mark.parametrize("act_group", [None, 64])
def test_gemm_block_scaled(act_group):
    """Weight blocks of 64 columns (BLOCK_K 32 divides them: two K steps per block; 32 is the smallest
    K step the GPU's FP8 MMA compiles), activations per token or per token and group."""
    x, w = _gemm_case(19, 40, 192, seed=15)
    qa = QuantizedActivation(*quantize_activation_ref(x, act_group))
    data, grid = quantize_weight_blocks(w, (16, 64))
    rows = expand_block_scales(grid, 16, 40)
    cfg = GemmConfig(16, 16, 32, group_m=2, num_warps=4, num_stages=2)
    y = fp8_gemm(qa.data, qa.scale, data, rows, torch.float32, group_k=64, config=cfg)
    assert_gemm_close(
        y, scaled_matmul_ref(qa, data, rows, None, torch.float32), qa, dequantize_weight(data, rows)
    )
    with pytest.raises(ValueError, match="b_scale"):
        fp8_gemm(qa.data, qa.scale, data, rows[:, :2], torch.float32, group_k=64, config=cfg)
    with pytest.raises(ValueError, match="a_scale"):
        fp8_gemm(qa.data, qa.scale[:, :1].expand(19, 2), data, rows, torch.float32, group_k=64, config=cfg)
    if DEVICE == "cuda":  # the interpreter takes any K; a compiled FP8 dot needs K >= 32
        with pytest.raises(ValueError, match="BLOCK_K 16 is below 32"):
            small = GemmConfig(16, 16, 16, group_m=2, num_warps=4, num_stages=2)
            fp8_gemm(qa.data, qa.scale, data, rows, torch.float32, group_k=64, config=small)


def test_scaled_mm_call_matches_reference():
    """The CUDA per-channel path's torch._scaled_mm call (operand layouts, scale shapes), run by
    torch's own CPU implementation when it has one."""
    x, w = _gemm_case(12, 48, 64, seed=16)
    qa = QuantizedActivation(*quantize_activation_ref(x))
    data, scale = quantize_weight_per_channel(w)
    try:
        y = scaled_mm_rowwise(qa, data, scale)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch._scaled_mm unavailable here: {e}")
    ref = scaled_matmul_ref(qa, data, scale, None, torch.float32)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref, rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("block_k", [None, 32])
def test_fp8_linear_kernel_path_matches_reference_path(monkeypatch, block_k):
    dense = torch.nn.Linear(96, 48, bias=True).to(DEVICE)
    with torch.no_grad():
        dense.weight.copy_(rand(48, 96, seed=17) / 10)
    layer = Fp8Linear.replacing(dense, block_k)
    x = rand(6, 96, seed=18)
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", False)
    ref = layer(x)
    ref_given = layer(QuantizedActivation(*quantize_activation_ref(x)))
    assert torch.equal(ref, ref_given)  # quantizing itself = being handed the same quantization
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", True)
    out = layer(x)
    assert_gemm_close(out, ref, QuantizedActivation(*quantize_activation_ref(x)), layer.dequantized_weight())
    # against the float layer: e4m3 rounds each input and weight by up to 2^-4 (about 2.5% rms for
    # uniformly placed values), so the products' error is a few percent of the output's norm
    expected = dense(x).detach() - dense.bias.detach()
    err = (out - dense.bias.detach() - expected).norm() / expected.norm()
    assert 0.005 < float(err) < 0.06
