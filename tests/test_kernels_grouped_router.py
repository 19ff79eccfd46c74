"""The grouped sigmoid router (GLM-4.5 / 4.6): the Triton kernel against its PyTorch reference, and the
reference against transformers' own Glm4MoeTopkRouter on random logits.

Without a GPU, conftest.py turns on the Triton interpreter (small shapes). Logits are random floats with
a spread that leaves no exact ties among the choice values, so both sides pick the same experts and the
only freedom is their order (transformers' topk is unsorted; ours goes by decreasing choice value).
"""

from __future__ import annotations

import pytest
import torch

from overnight.kernels.moe_router import grouped_router_topk
from overnight.layers.moe_grouped_router import GroupedRouting, grouped_router_topk_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (tokens, experts, top_k, n_group, topk_group): GLM-4.5-Air's 128 experts in one group; grouped
# choices of DeepSeek-V3's shape at small sizes; the trivial 2-expert groups.
CASES = [
    (1, 8, 2, 1, 1),
    (37, 8, 2, 2, 1),
    (20, 16, 3, 4, 2),
    (17, 128, 8, 1, 1),
    (19, 64, 6, 8, 3),
    (5, 8, 4, 4, 4),
    (9, 12, 2, 6, 2),  # 6 groups: padded to 8 group lanes
]


def _inputs(t: int, e: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(t, e, generator=gen)
    bias = 0.5 * torch.randn(e, generator=gen)
    return logits.to(DEVICE), bias.to(DEVICE)


def _sorted(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's (ids, weights) ordered by expert id."""
    order = ids.long().argsort(dim=-1)
    return ids.long().gather(1, order), weights.gather(1, order)


@pytest.mark.parametrize("t,e,k,groups,topk_groups", CASES)
@pytest.mark.parametrize("renormalize,scaling", [(True, 2.5), (False, 1.0)])
def test_kernel_matches_reference(t, e, k, groups, topk_groups, renormalize, scaling):
    logits, bias = _inputs(t, e, seed=t + e)
    routing = GroupedRouting(k, e, groups, topk_groups, renormalize, scaling)
    weights, ids = grouped_router_topk(logits, bias, k, groups, topk_groups, renormalize, scaling)
    ref_weights, ref_ids = grouped_router_topk_ref(logits, bias, routing)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    # Both order by decreasing choice value; tie-free inputs leave one order.
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-6)
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.full((t,), scaling, device=DEVICE))


def test_kernel_takes_strided_logits_and_no_tokens():
    wide, bias = _inputs(9, 24, seed=5)
    routing = GroupedRouting(2, 8, 2, 1)
    weights, ids = grouped_router_topk(wide[:, :8], bias[:8].contiguous(), 2, 2, 1, True, 1.0)
    ref_weights, ref_ids = grouped_router_topk_ref(wide[:, :8], bias[:8], routing)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights)
    w0, i0 = grouped_router_topk(wide[:0, :8], bias[:8].contiguous(), 2, 2, 1, True, 1.0)
    assert w0.shape == (0, 2) and i0.shape == (0, 2)


@pytest.mark.parametrize(
    "args,message",
    [
        ((2, 3, 1), "n_group 3 must split"),
        ((2, 8, 1), "groups of 2 or more"),
        ((2, 2, 3), "topk_group must be in 1..2"),
        ((5, 2, 1), "top_k must be in 1..4"),
    ],
)
def test_kernel_refuses_bad_shapes(args, message):
    logits, bias = _inputs(3, 8, seed=0)
    top_k, groups, topk_groups = args
    with pytest.raises(ValueError, match=message):
        grouped_router_topk(logits, bias, top_k, groups, topk_groups, True, 1.0)


@pytest.mark.parametrize("t,e,k,groups,topk_groups", CASES)
@pytest.mark.parametrize("renormalize", [True, False])
def test_reference_matches_transformers_router(t, e, k, groups, topk_groups, renormalize):
    """Our reference against Glm4MoeTopkRouter itself: its router weight set so that its logits are
    ours (identity over the hidden size), its correction bias ours."""
    import transformers
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    config = transformers.Glm4MoeConfig(
        hidden_size=e,
        n_routed_experts=e,
        num_experts_per_tok=k,
        n_group=groups,
        topk_group=topk_groups,
        norm_topk_prob=renormalize,
        routed_scaling_factor=1.5,
    )
    hf = Glm4MoeTopkRouter(config)
    logits, bias = _inputs(t, e, seed=7 * t + e)
    with torch.no_grad():
        hf.weight.copy_(torch.eye(e))
        hf.e_score_correction_bias.copy_(bias.cpu())
        _, hf_weights, hf_ids = hf(logits.cpu())
    routing = GroupedRouting(k, e, groups, topk_groups, renormalize, 1.5)
    weights, ids = grouped_router_topk_ref(logits.cpu(), bias.cpu(), routing)
    got_ids, got_w = _sorted(weights, ids)
    want_ids, want_w = _sorted(hf_weights, hf_ids)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(n_group=3), "n_group 3 must split"),
        (dict(n_group=2, topk_group=3), "topk_group must be in 1..n_group"),
        (dict(top_k=5, n_group=4, topk_group=2), r"num_experts_per_tok must be in 1..4"),
    ],
)
def test_routing_refuses_bad_groups(fields, message):
    with pytest.raises(ValueError, match=message):
        GroupedRouting(**{"top_k": 2, "num_experts": 8, **fields})
