"""kernels/int8_gemm.py against its torch reference: the int8 x int8 GEMM with fused scales (exact int32
accumulation, so equal to the reference up to the last fp32 rounding), the W8A16 small-M path (the
unquantized input through the W4A16 kernel with signed codes) and the layer dispatch by M. Without a GPU
the kernels run in the Triton interpreter (conftest.py sets TRITON_INTERPRET=1), fp32 and fp16.
"""

from __future__ import annotations

import pytest
import torch

from overnight.kernels import int8_gemm as int8_module
from overnight.kernels.int8_gemm import (
    Int8Config,
    default_path,
    int8_gemm,
    int8_gemm_ref,
    int8_linear,
    w8a16_gemm,
)
from overnight.kernels.int8_quant import quantize_int8_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _layer(n: int, k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, generator=gen) * 0.01 + 0.001
    return w.to(DEVICE), scale.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "m,n,k,cfg",
    [
        (3, 40, 96, Int8Config(16, 32, 32)),  # K not a multiple of the step: masked
        (20, 24, 128, Int8Config(16, 16, 64, group_m=2)),  # several row tiles, grouped order
        (5, 48, 64, None),  # the default tiles
    ],
)
def test_int8_gemm_matches_reference(m, n, k, cfg, dtype):
    w, sw = _layer(n, k)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    codes, sx = quantize_int8_ref(x)
    y = int8_gemm(codes, sx, w, sw, dtype, cfg)
    ref = int8_gemm_ref(codes, sx, w, sw, dtype)
    assert y.dtype == dtype and y.shape == (m, n)
    torch.testing.assert_close(
        y.float(), ref.float(), atol=1e-5, rtol=1e-5 if dtype == torch.float32 else 1e-3
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_w8a16_is_the_unquantized_input_times_the_weight(dtype):
    w, sw = _layer(40, 64, seed=1)
    x = torch.randn(3, 64, device=DEVICE).to(dtype)
    ref = x.float() @ (w.float() * sw[:, None]).t()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(w8a16_gemm(x, w, sw).float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("path", ["triton", "w8a16"] + (["int_mm"] if DEVICE == "cuda" else []))
def test_int8_linear_paths(path):
    """Every path gives the layer's product; W8A8 ones equal the reference, W8A16 is off it by the
    activation quantization only."""
    w, sw = _layer(32, 64, seed=2)
    x = torch.randn(4, 64, device=DEVICE)
    codes, sx = quantize_int8_ref(x)
    ref = int8_gemm_ref(codes, sx, w, sw, x.dtype)
    tol = 2e-2 if path == "w8a16" else 1e-5
    torch.testing.assert_close(int8_linear(x, w, sw, path), ref, atol=tol * ref.abs().max().item(), rtol=0)


def test_default_path_by_rows(monkeypatch):
    assert default_path(1) == default_path(int8_module.W8A16_MAX_M) == "w8a16"
    assert default_path(int8_module.W8A16_MAX_M + 1) == int8_module.LARGE_PATH
    monkeypatch.setattr(int8_module, "LARGE_PATH", "int_mm")
    assert default_path(1024) == "int_mm"


def test_bad_inputs_are_refused():
    w, sw = _layer(16, 64)
    x = torch.randn(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="unknown int8 path"):
        int8_linear(x, w, sw, "fp8")
    with pytest.raises(ValueError, match="w_scale"):
        int8_linear(x, w, sw[:8], "triton")
    with pytest.raises(ValueError, match="int8"):
        w8a16_gemm(x, w.int(), sw)
    with pytest.raises(ValueError, match="multiple of 16"):
        w8a16_gemm(torch.randn(2, 36, device=DEVICE), *_layer(16, 36))
