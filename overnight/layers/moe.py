"""The experts of a sparse (mixture-of-experts) MLP and the router's top-k choice.

Every expert is a gated MLP like the dense one; their weights are stacked, one tensor per projection,
in the layout transformers keeps in memory (the checkpoint's per-expert tensors are copied in by the
loader):

    gate_up_proj  [E, 2I, H]   rows of expert e: [gate | up]
    down_proj     [E, H, I]

A token t goes through the experts topk_ids[t, :] and its output is sum_j topk_weights[t, j] *
expert_j(x_t). Path choice as for the small ops (norm.py's use_kernels): the fused Triton path
(overnight/kernels/fused_moe.py) on CUDA; on the CPU the PyTorch code here, which is also the kernels'
reference. The PyTorch path loops over the experts that were hit (a host sync per layer), so it cannot
be captured in a CUDA graph; the fused path can.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from overnight.kernels.dispatch import use_kernels


def router_topk_ref(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int32), heaviest first.

    Softmax over all experts in fp32, the k largest kept, and with `renormalize` rescaled to sum to 1
    (Qwen3-MoE's norm_topk_prob), as the HF router computes them."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def fused_experts_ref(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """x [T, H]; gate_up_proj [E, 2I, H]; down_proj [E, H, I]; topk_weights [T, k]; topk_ids [T, k].
    Returns [T, H] in x's dtype.

    The HF computation step for step (so fp32 results match it to the last bit on the same rows): each
    expert that was hit runs on its tokens in x's dtype, its output is scaled by the routing weight
    (cast to x's dtype) and added into the result."""
    out = torch.zeros_like(x)
    weights = topk_weights.to(x.dtype)
    ids = topk_ids.long()
    for expert in torch.unique(ids).tolist():
        token, slot = torch.where(ids == expert)
        gate, up = F.linear(x[token], gate_up_proj[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down_proj[expert]) * weights[token, slot, None]
        out.index_add_(0, token, y)
    return out


def select_experts(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's choice for each token: (weights [T, k] float32, ids [T, k] int32)."""
    if use_kernels(logits):
        from overnight.kernels.moe_router import router_topk  # triton loads on first use

        return router_topk(logits, top_k, renormalize)
    return router_topk_ref(logits, top_k, renormalize)


def run_experts(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The experts' weighted sum for each token, on the path use_kernels(x) picks."""
    if use_kernels(x):
        from overnight.kernels.fused_moe import fused_experts  # triton loads on first use

        return fused_experts(x, gate_up_proj, down_proj, topk_weights, topk_ids)
    return fused_experts_ref(x, gate_up_proj, down_proj, topk_weights, topk_ids)


class Experts(nn.Module):
    """num_experts gated MLPs of hidden_size -> intermediate_size -> hidden_size, stacked.

    Tensor parallelism shrinks intermediate_size (each rank keeps every expert's slice of it) and sums
    the ranks' outputs from outside (parallel/tp.py)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return run_experts(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids)

    def extra_repr(self) -> str:
        e, two_i, h = self.gate_up_proj.shape
        return f"num_experts={e}, hidden_size={h}, intermediate_size={two_i // 2}"
