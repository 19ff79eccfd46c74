"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): the Qwen3 decoder with a sparse MLP in most layers.

Attention, norms and the layer wiring are the dense decoder's (models/llama.py, with Qwen3's qk-norm
flag); only the MLP differs. Layer i is sparse when ModelArch.is_moe_layer(i) (every
decoder_sparse_step-th layer, minus mlp_only_layers), else it keeps the dense MLP of intermediate_size.

A sparse MLP routes each token to num_experts_per_tok of num_experts experts: a linear router
("mlp.gate") gives a logit per expert, the softmax over all of them (fp32) picks the top k, whose
weights are rescaled to sum to 1 when norm_topk_prob. The experts' weights are stacked
(layers/moe.py); the checkpoint's per-expert tensors (mlp.experts.N.{gate,up,down}_proj.weight) are
copied into them by load_packed_weights.

Qwen1.5-MoE / Qwen2-MoE (model_type "qwen2_moe") is this model with Qwen2's attention (q/k/v biases,
no qk-norm) and a shared expert in every sparse layer (shared_expert_intermediate_size > 0): an MLP all
tokens go through, scaled by sigmoid(shared_expert_gate(x)) and added to the routed experts' sum
(models/qwen3_next.SharedExpertMoe, the same block as Qwen3-Next's).
"""

from __future__ import annotations

import torch
from torch import nn

from overnight.arch import ModelArch
from overnight.layers.moe import Experts, select_experts
from overnight.models.checkpoint import EXPERT_TENSORS
from overnight.models.llama import LlamaForCausalLM, dense_mlp
from overnight.models.qwen3_next import UNQUANTIZED_LINEAR, SharedExpertMoe


class Qwen3MoeSparseMoeBlock(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.top_k = arch.num_experts_per_tok
        self.norm_topk_prob = arch.norm_topk_prob
        self.gate = nn.Linear(arch.hidden_size, arch.num_experts, bias=False)  # the router
        self.experts = Experts(arch.num_experts, arch.hidden_size, arch.moe_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = select_experts(self.gate(x), self.top_k, self.norm_topk_prob)
        return self.experts(x, topk_weights, topk_ids)


def qwen3_moe_mlp(arch: ModelArch, layer_idx: int) -> nn.Module:
    if not arch.is_moe_layer(layer_idx):
        return dense_mlp(arch, layer_idx)
    if arch.shared_expert_intermediate_size:  # Qwen2-MoE
        return SharedExpertMoe(arch)
    return Qwen3MoeSparseMoeBlock(arch)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    # With FP8 weights (quant/): the router stays in the compute dtype, as published FP8 MoE checkpoints
    # keep it (its top-k decides which experts run; its GEMM, hidden x num_experts, is a small share).
    # The stacked experts are not nn.Linear: an FP8 checkpoint's expert (and router) tensors are
    # dequantized with their scales as they load (quant/checkpoint.py), and the experts, e4m3 from the
    # build on, are quantized per row as each tensor arrives (quant/apply.py; the router stays in the
    # compute dtype). Qwen2-MoE's shared expert gate (one output row) stays so too.
    unquantized_linear: tuple[str, ...] = UNQUANTIZED_LINEAR
    dequantized_at_load: tuple[str, ...] = (EXPERT_TENSORS, *UNQUANTIZED_LINEAR)
    # No FP8 hand-over from the norms: a sparse layer's norm feeds the router and the experts, which
    # take the compute dtype.
    linear_input_producers: dict[str, str] = {}

    make_mlp = staticmethod(qwen3_moe_mlp)
