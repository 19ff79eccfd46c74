"""Baidu ERNIE 4.5 MoE (Ernie4_5_MoeForCausalLM: ERNIE-4.5-21B-A3B, ERNIE-4.5-300B-A47B).

The dense decoder's blocks (models/llama.py) with ModelArch flags (models/hf_config.py's
_ernie4_5_moe_fields): RoPE in interleaved pairs (2i, 2i + 1), as the dense ERNIE 4.5 (family
"ernie4_5", LlamaForCausalLM) has too; the layers from moe_layer_start_index to moe_layer_end_index,
every moe_layer_interval-th, are sparse, the others keep the dense MLP (as mlp_only_layers):

    x --> gate (float32 logits) --> softmax --+--> + moe_statics bias --> top-k ids
                                              \\--> the chosen probabilities / their sum --> weights
    x --> experts (stacked, layers/moe.py) weighted + shared_experts(x) (ungated, summed) --> out

The per-expert correction bias (mlp.moe_statics.e_score_correction_bias, [1, E] float32) only chooses
the experts; the weights are the unbiased softmax probabilities, renormalized (ERNIE's
moe_norm_min 1e-12 guards the sum). Router and bias stay float32 whatever the compute dtype, as
transformers keeps them (_keep_in_fp32_modules_strict): a bf16 router would move near-tied choices.
Under FP8 they stay so; the shared experts are quantized like the dense projections, the routed
experts per row as each checkpoint tensor loads.

Checkpoints of the 300B model carry a multi-token-prediction block (num_nextn_predict_layers) for
speculative decoding; generation does not use it and rename_checkpoint drops its tensors.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from overnight.arch import ModelArch
from overnight.layers.moe import Experts, router_softmax_biased_topk
from overnight.models.checkpoint import EXPERT_TENSORS
from overnight.models.llama import LlamaForCausalLM, dense_mlp
from overnight.models.qwen3_next import SplitMLP

logger = logging.getLogger(__name__)


class Float32Router(nn.Module):
    """mlp.gate: one float32 logit per expert, from float32 inputs (ERNIE 4.5's and Hunyuan's routers,
    which transformers keeps in float32 whatever the compute dtype)."""

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(arch.num_experts, arch.hidden_size, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)


class Ernie4_5_MoeStatics(nn.Module):
    """mlp.moe_statics: the correction bias added to the probabilities for the choice alone."""

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.e_score_correction_bias = nn.Parameter(torch.empty(1, arch.num_experts, dtype=torch.float32))


class Ernie4_5_MoeSparseMoeBlock(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.top_k = arch.num_experts_per_tok
        self.gate = Float32Router(arch)
        self.moe_statics = Ernie4_5_MoeStatics(arch)
        self.experts = Experts(arch.num_experts, arch.hidden_size, arch.moe_intermediate_size)
        shared = arch.shared_expert_intermediate_size
        self.shared_experts = SplitMLP(arch.hidden_size, shared) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.moe_statics.e_score_correction_bias[0]
        weights, ids = router_softmax_biased_topk(self.gate(x), bias, self.top_k)
        out = self.experts(x, weights, ids)
        return out if self.shared_experts is None else out + self.shared_experts(x)


def ernie4_5_moe_mlp(arch: ModelArch, layer_idx: int) -> nn.Module:
    return Ernie4_5_MoeSparseMoeBlock(arch) if arch.is_moe_layer(layer_idx) else dense_mlp(arch, layer_idx)


class Ernie4_5_MoeForCausalLM(LlamaForCausalLM):
    # The router and its bias are no nn.Linear: quantization leaves them in float32. An FP8
    # checkpoint's expert (and router) tensors are dequantized with their scales as they load
    # (quant/checkpoint.py), then quantized per row into the e4m3 stacks (quant/apply.py).
    unquantized_linear: tuple[str, ...] = ("mlp.gate",)
    dequantized_at_load: tuple[str, ...] = (EXPERT_TENSORS, "mlp.gate")
    linear_input_producers: dict[str, str] = {}  # no FP8 hand-over from the norms (not measured here)

    make_mlp = staticmethod(ernie4_5_moe_mlp)

    @staticmethod
    def rename_checkpoint(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint without its multi-token-prediction block (model.mtp_*); applied before FP8
        conversion and tensor-parallel slicing (loader/model_loader.checkpoint_weights)."""
        skipped = 0
        for name, tensor in weights:
            if name.startswith("model.mtp"):
                skipped += 1
                continue
            yield name, tensor
        if skipped:
            logger.info("skipped %d multi-token-prediction tensor(s): generation does not use them", skipped)
