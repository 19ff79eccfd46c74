"""Gemma's layers on the kernel path (the GPU's), under the Triton interpreter on the CPU (conftest.py):
Gemma 4's experts (a GeGLU gate: gelu with the tanh approximation) in the fused MoE against the layer's
PyTorch reference, and whole tiny models with every kernel on (norms with the folded (1 + w) weights,
q/k norm + rotary with the per-kind and proportional tables, router, fused experts) against the PyTorch
path; attention on the torch backend on both sides."""

from __future__ import annotations

import pytest
import torch

from overnight.kernels import dispatch
from overnight.kernels.fused_moe import fused_experts
from overnight.kernels.moe_configs import MoeConfig
from overnight.kernels.moe_gemm import GemmTiles
from overnight.layers.moe import ExpertActivation, fused_experts_ref, router_topk_ref
from overnight.loader.model_loader import load_model
from overnight.loader.resolve import resolve_source
from tests.kernel_helpers import DEVICE, run_steps
from tests.test_gemma import tiny_gemma

pytestmark = pytest.mark.slow  # Triton-interpreter runs

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
    out = fused_experts(
        x, w13, w2, weights, ids, MoeConfig(16, TILES, TILES), activation=("gelu_tanh", 0.0, 0.0)
    )
    gelu = ExpertActivation("gelu_tanh")
    ref = fused_experts_ref(x.float(), w13.float(), w2.float(), weights, ids, activation=gelu)
    silu = fused_experts_ref(x.float(), w13.float(), w2.float(), weights, ids)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol * float(ref.abs().max()))
    assert not torch.allclose(ref, silu, atol=1e-3)  # the activation does change the result


@pytest.mark.parametrize("variant", ["gemma2", "gemma3", "gemma4", "gemma4-moe"])
def test_model_forward_with_kernels_matches_pytorch_path(variant, tmp_path, monkeypatch):
    tiny_gemma(variant).save_pretrained(tmp_path)
    model = load_model(resolve_source(str(tmp_path)), torch.float32, DEVICE)
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", False)
    expected = run_steps(model, max_id=320)  # past the window of 7
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", True)
    got = run_steps(model, max_id=320)  # past the window of 7
    # fp32 sums in another order (kernel vs torch): the bound scales with the logits.
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * max(1.0, float(expected.abs().max())))
