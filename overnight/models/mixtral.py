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

from overnight.models.qwen3_moe import Qwen3MoeForCausalLM

_EXPERT = re.compile(r"(.*)\.block_sparse_moe\.experts\.(\d+)\.w([123])\.(\w+)$")
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
    # Applied to the checkpoint stream before FP8 conversion and tensor-parallel slicing
    # (loader/model_loader.checkpoint_weights), which then see Qwen3-MoE's names.
    rename_checkpoint = staticmethod(mixtral_names)
