"""Nemotron-H's feed-forward blocks (models/nemotron_h.py builds the stack): the MLP block ("-") and the
mixture-of-experts block ("E", Nemotron 3: NVIDIA-Nemotron-3-Nano-30B-A3B and its siblings).

    "-"  up_proj -> relu(x)^2 -> down_proj, no gate, of intermediate_size
    "E"  x --> gate (float32 router) --> (weights, ids)
                                                 v
         x --> [fc1_latent_proj] --> experts (stacked, ungated: up -> relu^2 -> down) --> [fc2_latent_proj]
                                                                                                 + --> out
         x --> shared_experts (one "-" MLP of moe_shared_expert_intermediate_size) ------------------+

    The latent projections (H -> moe_latent_size -> H, no bias) exist with moe_latent_size only
    (Nemotron 3 Super): the experts then run at that width; the router and shared expert never do.

The router is GLM-4.5's (models/glm4_moe.py, layers/moe_grouped_router.py), as transformers'
NemotronHTopkRouter computes it: sigmoid scores of float32 logits; the scores plus
e_score_correction_bias choose the experts (among the topk_group best of n_group groups, each scored by
its two best), the unbiased scores weigh them, renormalized (norm_topk_prob) and times
routed_scaling_factor. The routed experts are layers/moe.py's stack with the ungated "relu2" activation
(the fused Triton path on the GPU, the per-expert torch loop on the CPU); their checkpoint tensors are
experts.{e}.up_proj / down_proj (the published layout; transformers 5 stacks them as experts.up_proj
[E, I, H]), which load into gate_up_proj (the up rows alone here) and down_proj.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from overnight.arch import ModelArch
from overnight.errors import ModelLoadError
from overnight.layers.moe import Experts
from overnight.layers.moe_grouped_router import GroupedRouting
from overnight.models.glm4_moe import Glm4MoeTopkRouter

# checkpoint projection of one expert -> (stacked parameter, shard): the up rows fill all of gate_up_proj
EXPERT_PACKING: dict[str, tuple[str, str | int]] = {"up_proj": ("gate_up_proj", 0)}
# An FP8 checkpoint's per-expert tensors (and the router) are dequantized as they load, then the
# experts are quantized per row into their e4m3 stacks (quant/checkpoint.py, quant/apply.py).
EXPERT_TENSORS = r"re:.*\.mixer\.experts\.\d+\.(up|down)_proj$"


class NemotronHMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up_proj(x)  # a fresh [T, I] tensor: the activation runs in place on it, no copies
        return self.down_proj(torch.relu_(h).square_())


class NemotronHMoE(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.gate = Glm4MoeTopkRouter(arch)
        h, latent = arch.hidden_size, arch.moe_latent_size
        self.experts = Experts(arch.num_experts, latent or h, arch.moe_intermediate_size, activation="relu2")
        self.shared_experts = NemotronHMLP(h, arch.shared_expert_intermediate_size)
        self.fc1_latent_proj = nn.Linear(h, latent, bias=False) if latent else None
        self.fc2_latent_proj = nn.Linear(latent, h, bias=False) if latent else None
        # Tensor parallelism (parallel/tp_mamba2.py) sets it: the experts and the shared expert's
        # down_proj then return each rank's partial sums, and their total is all-reduced here, once.
        # Fixed once built: the branch is the same in capture and replay.
        self.reduce_output: Callable[[torch.Tensor], object] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)  # the router reads the full width, latent or not
        if self.fc1_latent_proj is None or self.fc2_latent_proj is None:
            out = self.experts(x, weights, ids) + self.shared_experts(x)
        else:  # fc2 is linear: on a rank's partial sum it gives that rank's share of the output
            routed = self.fc2_latent_proj(self.experts(self.fc1_latent_proj(x), weights, ids))
            out = routed + self.shared_experts(x)
        if self.reduce_output is not None:
            self.reduce_output(out)  # in place
        return out


def nemotron_h_moe_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The ModelArch fields of a pattern's MoE blocks, from config.json (defaults: transformers'
    NemotronHConfig's). Raises ModelLoadError naming what does not fit or is not supported."""
    latent = int(cfg.get("moe_latent_size") or 0)
    if latent < 0:
        raise ModelLoadError(f"moe_latent_size must be positive (or null: none), got {latent}")
    experts = int(cfg.get("n_routed_experts", cfg.get("num_local_experts", 8)))
    top_k = int(cfg.get("num_experts_per_tok", 2))
    inter = int(cfg.get("moe_intermediate_size", 7688))
    shared = int(cfg.get("moe_shared_expert_intermediate_size", 7688))
    if min(experts, top_k, inter, shared) <= 0:
        raise ModelLoadError(
            f"n_routed_experts ({experts}), num_experts_per_tok ({top_k}), moe_intermediate_size ({inter}) "
            f"and moe_shared_expert_intermediate_size ({shared}) must be positive"
        )
    n_group, topk_group = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    try:  # the router's own checks: groups of 2 or more, top_k within the kept groups
        GroupedRouting(top_k, experts, n_group, topk_group)
    except ValueError as e:
        raise ModelLoadError(str(e)) from None
    return dict(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=inter,
        shared_expert_intermediate_size=shared,
        shared_expert_gated=False,
        experts_gated=False,
        router_scoring="sigmoid",
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        moe_latent_size=latent,
    )
