"""Mixtral: the Mistral decoder with a sparse MLP in every layer, through the fused MoE path.

Every layer routes each token to num_experts_per_tok of num_local_experts SiLU-gated experts: softmax
over all router logits, the top k kept and renormalized to sum to 1. That is Qwen3-MoE's block with
norm_topk_prob and no dense layers (ModelArch from registry._mixtral_fields), so the model is
Qwen3MoeForCausalLM's; only the checkpoint names differ:

    model.layers.N.block_sparse_moe.gate.weight            -> model.layers.N.mlp.gate.weight
    model.layers.N.block_sparse_moe.experts.E.w1 / w3 / w2 -> mlp.experts.E.gate_proj / up_proj / down_proj
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from overnight.models.llama import load_packed_weights
from overnight.models.qwen3_moe import Qwen3MoeForCausalLM

_EXPERT = re.compile(
    r"(.*)\.block_sparse_moe\.experts\.(\d+)\.w([123])\.(weight|weight_scale|weight_scale_inv)$"
)
_EXPERT_NAMES = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}


def mixtral_names(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        match = _EXPERT.fullmatch(name)
        if match:
            layer, expert, w, leaf = match.groups()
            name = f"{layer}.mlp.experts.{expert}.{_EXPERT_NAMES[w]}.{leaf}"
        else:
            name = name.replace(".block_sparse_moe.gate.", ".mlp.gate.")
        yield name, tensor


class MixtralForCausalLM(Qwen3MoeForCausalLM):
    # An FP8 checkpoint's expert and router tensors, by their names in the checkpoint (quant/checkpoint.py).
    dequantized_at_load: tuple[str, ...] = (
        r"re:.*\.block_sparse_moe\.experts\.\d+\.w[123]$",
        "block_sparse_moe.gate",
    )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_packed_weights(self, mixtral_names(weights))
