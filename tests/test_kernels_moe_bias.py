"""The grouped expert GEMMs with per-expert biases and gpt-oss's clamped SwiGLU, against their PyTorch
references (moe_gemm_ref, and the layer's CPU path fused_experts_ref). Triton interpreter on the CPU."""

from __future__ import annotations

import pytest
import torch

from overnight.kernels.fused_moe import fused_experts
from overnight.kernels.moe_align import moe_align
from overnight.kernels.moe_configs import MoeConfig
from overnight.kernels.moe_gemm import GemmTiles, moe_gemm, moe_gemm_ref
from overnight.layers.moe import ExpertActivation, fused_experts_ref, router_topk_ref
from tests.test_kernels_moe import DEVICE, SMALL, assert_close, experts_weights, randn, random_ids

pytestmark = pytest.mark.slow  # Triton-interpreter runs

OAI = ("swiglu_oai", 1.702, 7.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gated_gemm_with_bias_and_clamped_swiglu(dtype):
    num_tokens, top_k, num_experts, hidden, inter = 9, 2, 5, 32, 24
    x = randn(num_tokens, hidden, seed=1, dtype=dtype)
    w13, w2 = experts_weights(num_experts, inter, hidden, dtype, seed=2)
    # Large pre-activations, so the clamps at +-limit really cut.
    w13 = w13 * 40
    b13 = randn(num_experts, 2 * inter, seed=3, scale=3.0, dtype=dtype)
    b2 = randn(num_experts, hidden, seed=4, dtype=dtype)
    ids = random_ids(num_tokens, top_k, num_experts, seed=5)
    weights = torch.rand(num_tokens, top_k, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    runs = moe_align(ids, num_experts, 16)
    h = moe_gemm(x, w13, runs, SMALL, gated=True, bias=b13, activation=OAI)
    ref_h = moe_gemm_ref(x, w13, ids, gated=True, bias=b13, activation=OAI)
    assert float(ref_h.float().abs().max()) > 7.0  # the limit was reached somewhere
    assert_close(h, ref_h)
    y = moe_gemm(h, w2, runs, SMALL, topk_weights=weights, bias=b2)
    assert_close(y, moe_gemm_ref(h, w2, ids, topk_weights=weights, bias=b2))
    with pytest.raises(ValueError, match="bias must be"):
        moe_gemm(x, w13, runs, SMALL, gated=True, bias=b13[:, :-1])
    with pytest.raises(ValueError, match="unknown activation"):
        moe_gemm(x, w13, runs, SMALL, gated=True, activation=("gelu", 0.0, 0.0))


def test_fused_layer_with_biases_matches_the_layer_reference():
    num_tokens, num_experts, top_k, hidden, inter = 13, 6, 3, 32, 16
    x = randn(num_tokens, hidden, seed=10)
    w13, w2 = experts_weights(num_experts, inter, hidden, torch.float32, seed=11)
    w13 = w13 * 20
    b13 = randn(num_experts, 2 * inter, seed=12)
    b2 = randn(num_experts, hidden, seed=13)
    weights, ids = router_topk_ref(randn(num_tokens, num_experts, seed=14), top_k, renormalize=True)
    config = MoeConfig(16, SMALL, GemmTiles(16, 16, 1, 4, 2))
    act = ExpertActivation("swiglu_oai", 1.702, 7.0)
    out = fused_experts(x, w13, w2, weights, ids, config, gate_up_bias=b13, down_bias=b2, activation=OAI)
    ref = fused_experts_ref(x, w13, w2, weights, ids, gate_up_bias=b13, down_bias=b2, activation=act)
    assert_close(out, ref)
