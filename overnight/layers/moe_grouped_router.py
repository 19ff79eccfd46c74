"""The sigmoid router with a correction bias and grouped choice (GLM-4.5 / 4.6; DeepSeek-V3's shape).

Beside layers/moe.py's softmax router (Qwen3-MoE, Mixtral, gpt-oss), the other router family: for
each token, from its router logits [E] (float32),

    scores  = sigmoid(logits)                                 what the chosen experts are weighted by
    choice  = scores + e_score_correction_bias                what chooses them (the bias is learned for
                                                              load balance; it never enters a weight)
    groups  = the E experts in n_group runs of E / n_group; a group's score is the sum of its two
              largest choice values; the topk_group best groups stay, the other experts drop out
    ids     = the top_k largest choice values among the experts left
    weights = scores[ids], divided by their sum (+ renorm_eps: GLM's 1e-20, LFM2-MoE's 1e-6) when
              renormalize, times scaling

as transformers' Glm4MoeTopkRouter computes them. The result is (weights [T, k] float32, ids [T, k]
int32), ids by decreasing choice value (the experts' weighted sum does not depend on the order).
Path choice as for the softmax router: the Triton kernel (kernels/moe_router.py) on CUDA, this file's
reference elsewhere. Both are free of host syncs (CUDA graphs capture either).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from overnight.kernels.dispatch import use_kernels


@dataclass(frozen=True)
class GroupedRouting:
    """The router's constants (ModelArch's num_experts_per_tok, num_experts, n_group, topk_group,
    norm_topk_prob, routed_scaling_factor)."""

    top_k: int
    num_experts: int
    n_group: int = 1
    topk_group: int = 1
    renormalize: bool = True
    scaling: float = 1.0
    renorm_eps: float = 1e-20

    def __post_init__(self) -> None:
        e, g = self.num_experts, self.n_group
        if g < 1 or e % g or e // g < 2:
            raise ValueError(f"n_group {g} must split num_experts {e} into groups of 2 or more experts")
        if not 1 <= self.topk_group <= g:
            raise ValueError(f"topk_group must be in 1..n_group ({g}), got {self.topk_group}")
        if not 1 <= self.top_k <= self.topk_group * (e // g):
            raise ValueError(
                f"num_experts_per_tok must be in 1..{self.topk_group * (e // g)} (the experts of "
                f"topk_group {self.topk_group} groups of {e // g}), got {self.top_k}"
            )


def grouped_router_topk_ref(
    logits: torch.Tensor, bias: torch.Tensor, routing: GroupedRouting
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E], bias [E] -> (weights [T, k] float32, expert ids [T, k] int32); see the module
    docstring. Ties go as torch.topk breaks them (the kernel: to the lower index)."""
    scores = torch.sigmoid(logits.float())
    choice = scores + bias.float()
    if routing.topk_group < routing.n_group:
        grouped = choice.view(-1, routing.n_group, routing.num_experts // routing.n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, n_group]
        best = group_scores.topk(routing.topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        choice = grouped.masked_fill(~keep[:, :, None], float("-inf")).flatten(1)
    ids = choice.topk(routing.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if routing.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + routing.renorm_eps)
    return weights * routing.scaling, ids.to(torch.int32)


def select_grouped_experts(
    logits: torch.Tensor, bias: torch.Tensor, routing: GroupedRouting
) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's choice for each token, on the path use_kernels(logits) picks."""
    if use_kernels(logits):
        from overnight.kernels.moe_router import grouped_router_topk  # triton loads on first use

        return grouped_router_topk(
            logits,
            bias,
            routing.top_k,
            routing.n_group,
            routing.topk_group,
            routing.renormalize,
            routing.scaling,
            routing.renorm_eps,
        )
    return grouped_router_topk_ref(logits, bias, routing)
