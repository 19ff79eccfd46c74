"""Gemma's layers on the kernel path (the GPU's), under the Triton interpreter on the CPU (conftest.py):
Gemma 4's experts (a GeGLU gate: gelu with the tanh approximation) in the fused MoE against the layer's
PyTorch reference, and whole tiny models with every kernel on (norms with the folded (1 + w) weights,
q/k norm + rotary with the per-kind and proportional tables, router, fused experts) against the PyTorch
path; attention on the torch backend on both sides."""

from __future__ import annotations

import pytest
import torch

from overnight.attention.metadata import AttentionBatch
from overnight.attention.torch_backend import TorchAttentionBackend, build_metadata
from overnight.kernels import dispatch
from overnight.kernels.fused_moe import fused_experts
from overnight.kernels.moe_configs import MoeConfig
from overnight.kernels.moe_gemm import GemmTiles
from overnight.layers.moe import ExpertActivation, fused_experts_ref, router_topk_ref
from overnight.loader.model_loader import load_model
from overnight.loader.resolve import resolve_source
from tests.test_gemma import tiny_gemma

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
    out = fused_experts(
        x, w13, w2, weights, ids, MoeConfig(16, TILES, TILES), activation=("gelu_tanh", 0.0, 0.0)
    )
    gelu = ExpertActivation("gelu_tanh")
    ref = fused_experts_ref(x.float(), w13.float(), w2.float(), weights, ids, activation=gelu)
    silu = fused_experts_ref(x.float(), w13.float(), w2.float(), weights, ids)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol * float(ref.abs().max()))
    assert not torch.allclose(ref, silu, atol=1e-3)  # the activation does change the result


def _run_steps(model: torch.nn.Module) -> torch.Tensor:
    """Logits of a two-request prefill (9 and 12 tokens, past the window of 7), then one decode step
    of both; blocks of 4; each layer's own cache shape, KV-shared layers on their source's tensor."""
    arch = model.arch
    caches: list[torch.Tensor] = []
    for i in range(arch.num_hidden_layers):
        source = arch.kv_source_layer(i)
        shape = (2, 32, 4, arch.layer_num_kv_heads(i), arch.layer_head_dim(i))
        caches.append(caches[source] if source != i else torch.zeros(shape, device=DEVICE))
    tables = [[5, 2, 9, 0], [7, 1, 3, 11]]
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, 320, (21,), generator=gen).to(DEVICE)
    logits = []
    with torch.inference_mode():
        meta = build_metadata([9, 12], [9, 12], tables, 4, device=DEVICE)
        batch = AttentionBatch(meta, caches, TorchAttentionBackend())
        positions = torch.cat([torch.arange(9), torch.arange(12)]).to(DEVICE)
        logits.append(model.compute_logits(model(input_ids, positions, batch)))
        meta = build_metadata([1, 1], [10, 13], tables, 4, num_decodes=2, device=DEVICE)
        batch = AttentionBatch(meta, caches, TorchAttentionBackend())
        next_ids = logits[0][[8, 20]].argmax(-1)
        logits.append(model.compute_logits(model(next_ids, torch.tensor([9, 12], device=DEVICE), batch)))
    return torch.cat(logits)


@pytest.mark.parametrize("variant", ["gemma2", "gemma3", "gemma4", "gemma4-moe"])
def test_model_forward_with_kernels_matches_pytorch_path(variant, tmp_path, monkeypatch):
    tiny_gemma(variant).save_pretrained(tmp_path)
    model = load_model(resolve_source(str(tmp_path)), torch.float32, DEVICE)
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", False)
    expected = _run_steps(model)
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", True)
    got = _run_steps(model)
    # fp32 sums in another order (kernel vs torch): the bound scales with the logits.
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * max(1.0, float(expected.abs().max())))
