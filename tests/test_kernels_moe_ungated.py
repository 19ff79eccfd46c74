"""The grouped expert GEMMs with ungated squared-ReLU experts (Nemotron-H's: up -> relu^2 -> down, the
first projection [E, I, H] holding the up rows alone) against their PyTorch references: moe_gemm_ref,
and the layer's CPU path fused_experts_ref, in the compute dtype and as e4m3 experts. Triton interpreter
on the CPU."""

from __future__ import annotations

import pytest
import torch

from overnight.kernels.fused_moe import fused_experts
from overnight.kernels.moe_align import moe_align
from overnight.kernels.moe_configs import MoeConfig
from overnight.kernels.moe_gemm import GemmTiles, moe_gemm, moe_gemm_ref
from overnight.layers.moe import ExpertActivation, fused_experts_ref
from overnight.layers.moe_grouped_router import GroupedRouting, grouped_router_topk_ref
from overnight.quant.fp8 import quantize_stacked_per_channel
from tests.test_kernels_moe import DEVICE, SMALL, assert_close, randn, random_ids

pytestmark = pytest.mark.slow  # Triton-interpreter runs

RELU2 = ("relu2", 0.0, 0.0)


def ungated_weights(
    e: int, n: int, h: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return randn(e, n, h, seed=seed, scale=h**-0.5, dtype=dtype), randn(
        e, h, n, seed=seed + 1, scale=n**-0.5, dtype=dtype
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_ungated_relu2_gemm_matches_reference(dtype):
    """K and N not multiples of the tile; about half the pre-activations negative, so a missing ReLU or
    square (or the silu of a gated epilogue) shows."""
    num_tokens, top_k, num_experts, hidden, inter = 11, 2, 6, 40, 24
    x = randn(num_tokens, hidden, seed=1, dtype=dtype)
    w1, w2 = ungated_weights(num_experts, inter, hidden, dtype, seed=2)
    ids = random_ids(num_tokens, top_k, num_experts, seed=3)
    weights = torch.rand(num_tokens, top_k, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    runs = moe_align(ids, num_experts, 16)
    h = moe_gemm(x, w1, runs, SMALL, activation=RELU2)
    ref_h = moe_gemm_ref(x, w1, ids, activation=RELU2)
    assert h.shape == (num_tokens * top_k, inter)
    assert_close(h, ref_h)
    plain = moe_gemm_ref(x, w1, ids)  # the same GEMM without an activation
    assert float((plain < 0).float().mean()) > 0.3
    torch.testing.assert_close(ref_h.float(), torch.relu(plain.float()).square(), rtol=1e-2, atol=1e-3)
    y = moe_gemm(h, w2, runs, SMALL, topk_weights=weights)
    assert_close(y, moe_gemm_ref(h, w2, ids, topk_weights=weights))
    with pytest.raises(ValueError, match="relu2 is an ungated activation"):
        moe_gemm(x, w1, runs, SMALL, gated=True, activation=RELU2)


@pytest.mark.parametrize("fp8", [False, True], ids=["float", "fp8"])
def test_fused_ungated_experts_match_the_layer_reference(fp8):
    """The whole fused layer (alignment, the relu^2 GEMM, the weighted down GEMM, the sum) against
    layers/moe.py's CPU path, with routing weights from the grouped sigmoid router (scaled past 1);
    e4m3 experts with their per-row scales against the same path dequantizing them."""
    num_tokens, num_experts, top_k, hidden, inter = 17, 8, 2, 32, 16
    x = randn(num_tokens, hidden, seed=10)
    w1, w2 = ungated_weights(num_experts, inter, hidden, torch.float32, seed=11)
    routing = GroupedRouting(top_k, num_experts, 2, 1, True, 2.5)
    logits, bias = randn(num_tokens, num_experts, seed=12), randn(num_experts, seed=13, scale=0.3)
    weights, ids = grouped_router_topk_ref(logits, bias, routing)
    config = MoeConfig(16, SMALL, GemmTiles(16, 16, 1, 4, 2))
    scales: tuple[torch.Tensor | None, ...] = (None, None)
    if fp8:
        (w1, s1), (w2, s2) = quantize_stacked_per_channel(w1), quantize_stacked_per_channel(w2)
        scales = (s1, s2)
    out = fused_experts(x, w1, w2, weights, ids, config, *scales, activation=RELU2)
    ref = fused_experts_ref(x, w1, w2, weights, ids, *scales, activation=ExpertActivation("relu2"))
    assert_close(out, ref)
    with pytest.raises(ValueError, match="down_proj must be"):
        fused_experts(x, w1, w2, weights, ids, config, *scales)  # read as gated: [E, 2N, H] halves
