"""GLM-4.5 / GLM-4.6 / GLM-4.5-Air (Glm4MoeForCausalLM): the dense decoder's blocks with a sparse MLP.

Attention, norms and the layer wiring are the dense decoder's (models/llama.py), driven by ModelArch
flags (models/hf_config.py's _glm4_moe_fields): q/k/v biases and none on o_proj, optional per-head q/k
RMSNorm (use_qk_norm), RoPE on the first half of each head in rotate-half layout (unlike GLM-4's
interleaved pairs). The first first_k_dense_replace layers keep the dense MLP (as mlp_only_layers); the
others have Glm4MoeMoE:

    x --> gate (float32 router) --> (weights, ids) --> experts (stacked, layers/moe.py) --+--> out
      \\-> shared_experts (a plain gated MLP of n_shared_experts * moe_intermediate_size) --/

The router (mlp.gate) holds its weight and e_score_correction_bias in float32 whatever the compute
dtype: its logits are computed in float32 as transformers does (a bf16 router would move near-tied
choices), and the bias only chooses experts (layers/moe_grouped_router.py). FP8 keeps it so and
quantizes the shared experts like the dense projections, the routed experts per row as each checkpoint
tensor loads (quant/apply.py: the compute-dtype stack is never held).

Checkpoints may carry multi-token-prediction layers (num_nextn_predict_layers, numbered from
num_hidden_layers on) for speculative decoding; generation does not use them and rename_checkpoint drops
their tensors before anything else sees them.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from overnight.arch import ModelArch
from overnight.layers.moe import Experts
from overnight.layers.moe_grouped_router import GroupedRouting, select_grouped_experts
from overnight.models.checkpoint import EXPERT_TENSORS
from overnight.models.llama import LlamaForCausalLM, dense_mlp
from overnight.models.qwen3_next import SplitMLP

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


class Glm4MoeTopkRouter(nn.Module):
    """mlp.gate: a logit per expert from a float32 projection, and the grouped sigmoid choice."""

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        e, h = arch.num_experts, arch.hidden_size
        self.weight = nn.Parameter(torch.empty(e, h, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.empty(e, dtype=torch.float32))
        self.routing = GroupedRouting(
            arch.num_experts_per_tok,
            e,
            arch.n_group,
            arch.topk_group,
            arch.norm_topk_prob,
            arch.routed_scaling_factor,
            arch.router_renorm_eps,
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight)
        return select_grouped_experts(logits, self.e_score_correction_bias, self.routing)

    def extra_repr(self) -> str:
        r = self.routing
        return f"experts={r.num_experts}, top_k={r.top_k}, groups={r.topk_group}/{r.n_group}, scaling={r.scaling}"


class Glm4MoeMoE(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.gate = Glm4MoeTopkRouter(arch)
        self.experts = Experts(arch.num_experts, arch.hidden_size, arch.moe_intermediate_size)
        shared = arch.shared_expert_intermediate_size
        self.shared_experts = SplitMLP(arch.hidden_size, shared) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        return out if self.shared_experts is None else out + self.shared_experts(x)


def glm4_moe_mlp(arch: ModelArch, layer_idx: int) -> nn.Module:
    return Glm4MoeMoE(arch) if arch.is_moe_layer(layer_idx) else dense_mlp(arch, layer_idx)


class Glm4MoeForCausalLM(LlamaForCausalLM):
    # Under FP8 the norms before qkv_proj (and the dense layers' gate_up_proj) hand over quantized
    # outputs; a sparse layer's norm feeds the router and the experts, which take the compute dtype.
    # (LlamaForCausalLM's linear_input_producers.)
    # The router is no nn.Linear, so quantization passes leave it (and its bias) in float32. An FP8
    # checkpoint's expert (and router) tensors are dequantized with their scales as they load
    # (quant/checkpoint.py), then quantized per row into the e4m3 stacks (quant/apply.py).
    unquantized_linear: tuple[str, ...] = ("mlp.gate",)
    dequantized_at_load: tuple[str, ...] = (EXPERT_TENSORS, "mlp.gate")

    make_mlp = staticmethod(glm4_moe_mlp)

    def rename_checkpoint(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint without its multi-token-prediction layers (model.layers.N.* for N at or past
        num_hidden_layers) and, with n_shared_experts 0, without the empty shared experts transformers
        still writes; applied before FP8 conversion and tensor-parallel slicing
        (loader/model_loader.checkpoint_weights)."""
        return without_mtp_layers(weights, self.arch.num_hidden_layers)


def without_mtp_layers(
    weights: Iterable[tuple[str, torch.Tensor]], num_layers: int
) -> Iterator[tuple[str, torch.Tensor]]:
    skipped: set[int] = set()
    for name, tensor in weights:
        match = _LAYER.match(name)
        if match and int(match.group(1)) >= num_layers:
            skipped.add(int(match.group(1)))
            continue
        if ".shared_experts." in name and tensor.numel() == 0:
            continue  # n_shared_experts 0: transformers' zero-width shared MLP, nothing to load
        yield name, tensor
    if skipped:
        logger.info(
            "skipped the checkpoint's multi-token-prediction layer(s) %s: generation does not use them",
            ", ".join(map(str, sorted(skipped))),
        )
