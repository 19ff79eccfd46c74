"""MiniMax-M2 / M2.1 (MiniMaxM2ForCausalLM): the dense decoder's blocks with GLM-4.5's sigmoid router.

Every layer is Llama's pre-norm block (models/llama.py) with a sparse MLP; what differs is carried by
ModelArch flags (models/hf_config.py's _minimax_m2_fields):

    attention   no biases; q_norm / k_norm are RMSNorms over the whole q and k projections (all heads'
                channels together, qk_norm_type "per_layer", as OLMo 2 does: qk_norm_whole), then
                rotate-half RoPE on the first rotary_dim dims of each head (partial_rotary_factor)
    sparse MLP  Glm4MoeMoE without shared experts: sigmoid scores, the correction bias only choosing,
                one group, the chosen scores renormalized, no scaling (layers/moe_grouped_router.py);
                num_local_experts experts of intermediate_size (layers/moe.py)

Under tensor parallelism each rank holds its heads' rows of q_norm / k_norm, and the per-token sums of
squares of its q and k shares are all-reduced before the mean (parallel/tp.py, layers/norm.py
sharded_rms_norm_pair), so the norm is the whole vector's on every rank, not one rank's heads'.

Checkpoints keep Mixtral's names, rewritten by rename_checkpoint before FP8 conversion and tensor-
parallel slicing see them (loader/model_loader.checkpoint_weights):

    model.layers.N.block_sparse_moe.gate.weight             -> model.layers.N.mlp.gate.weight
    model.layers.N.block_sparse_moe.e_score_correction_bias -> model.layers.N.mlp.gate.e_score_correction_bias
    model.layers.N.block_sparse_moe.experts.E.w1 / w3 / w2  -> mlp.experts.E.gate_proj / up_proj / down_proj
    model.layers.N.* for N >= num_hidden_layers             the num_mtp_modules multi-token-prediction
                                                            layers, dropped (generation does not use them)

The published FP8 checkpoints (quant_method fp8, float8_e4m3fn in 128 x 128 blocks with
weight_scale_inv, router and bias left float) load as GLM-4.5's: attention projections stay block-FP8
layers, the experts are dequantized with their scales and requantized per row as each tensor loads
(quant/apply.py), the router stays float32.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from overnight.models.glm4_moe import Glm4MoeForCausalLM, without_mtp_layers
from overnight.models.mixtral import mixtral_names

_BIAS = re.compile(r"(.*)\.block_sparse_moe\.e_score_correction_bias$")


def minimax_m2_names(
    weights: Iterable[tuple[str, torch.Tensor]], num_layers: int
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in mixtral_names(without_mtp_layers(weights, num_layers)):
        match = _BIAS.fullmatch(name)
        yield (f"{match.group(1)}.mlp.gate.e_score_correction_bias" if match else name), tensor


class MiniMaxM2ForCausalLM(Glm4MoeForCausalLM):
    """Glm4MoeForCausalLM's model (float32 router, e4m3 experts from the load on under FP8) under
    MiniMax-M2's ModelArch; only the checkpoint names differ."""

    def rename_checkpoint(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        return minimax_m2_names(weights, self.arch.num_hidden_layers)
