"""Gemma 4's experts (a GeGLU gate: gelu with the tanh approximation): the fused MoE path against the
layer's PyTorch reference, under the Triton interpreter on the CPU (conftest.py), fp32 and fp16."""

from __future__ import annotations

import pytest
import torch

from overnight.kernels.fused_moe import fused_experts
from overnight.kernels.moe_configs import MoeConfig
from overnight.kernels.moe_gemm import GemmTiles
from overnight.layers.moe import fused_experts_ref, router_topk_ref

pytestmark = pytest.mark.slow  # Triton-interpreter runs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TILES = GemmTiles(block_n=16, block_k=16, group_m=1, num_warps=4, num_stages=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gelu_experts_kernel_path_matches_reference(dtype):
    gen = torch.Generator().manual_seed(0)
    num_tokens, num_experts, top_k, hidden, inter = 5, 6, 2, 32, 16
    x = torch.randn(num_tokens, hidden, generator=gen).to(DEVICE, dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(DEVICE, dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5).to(DEVICE, dtype)
    weights, ids = router_topk_ref(torch.randn(num_tokens, num_experts, generator=gen), top_k, True)
    weights, ids = weights.to(DEVICE), ids.to(DEVICE)
    out = fused_experts(x, w13, w2, weights, ids, MoeConfig(16, TILES, TILES), activation="gelu_tanh")
    ref = fused_experts_ref(x.float(), w13.float(), w2.float(), weights, ids, activation="gelu_tanh")
    silu = fused_experts_ref(x.float(), w13.float(), w2.float(), weights, ids)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol * float(ref.abs().max()))
    assert not torch.allclose(ref, silu, atol=1e-3)  # the activation does change the result
