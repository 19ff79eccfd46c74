"""Tencent Hunyuan (HunYuanDenseV1ForCausalLM, HunYuanMoEV1ForCausalLM: Hunyuan-A13B, Hunyuan 0.5B-7B).

The dense decoder's blocks (models/llama.py) with ModelArch flags (models/hf_config.py's
_hunyuan_fields): an RMSNorm over each head of q and k applied after RoPE (qk_norm_after_rope, unlike
Qwen3's before it), and RoPE's base raised by the dynamic-NTK alpha, theta * alpha^(d / (d - 2)), as
transformers computes it once (rope_theta holds the result). In the MoE model every layer is sparse:

    x --> gate (float32 logits) --> softmax --> top-k, renormalized --> experts (stacked) --+--> out
      \\-> shared_mlp (a gated MLP of intermediate_size, unscaled) ----------------------------/

Checkpoint names differ from the dense decoder's in three places, renamed as they stream in (before
FP8 conversion and tensor-parallel slicing):

    self_attn.query_layernorm / key_layernorm  -> self_attn.q_norm / k_norm
    mlp.gate.wg.weight                         -> mlp.gate.weight (the float32 router)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from overnight.arch import ModelArch
from overnight.layers.moe import Experts, select_experts
from overnight.models.checkpoint import EXPERT_TENSORS
from overnight.models.ernie4_5_moe import Float32Router
from overnight.models.llama import LlamaForCausalLM, dense_mlp
from overnight.models.qwen3_next import SplitMLP

_RENAMES = (
    (".self_attn.query_layernorm.", ".self_attn.q_norm."),
    (".self_attn.key_layernorm.", ".self_attn.k_norm."),
    (".mlp.gate.wg.", ".mlp.gate."),
)


class HunYuanMoEV1Moe(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.top_k = arch.num_experts_per_tok
        self.gate = Float32Router(arch)
        self.experts = Experts(arch.num_experts, arch.hidden_size, arch.moe_intermediate_size)
        self.shared_mlp = SplitMLP(arch.hidden_size, arch.shared_expert_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.gate(x), self.top_k, True)
        return self.experts(x, weights, ids) + self.shared_mlp(x)


def hunyuan_mlp(arch: ModelArch, layer_idx: int) -> nn.Module:
    return HunYuanMoEV1Moe(arch) if arch.is_moe_layer(layer_idx) else dense_mlp(arch, layer_idx)


class HunYuanForCausalLM(LlamaForCausalLM):
    """Both families: without experts (num_experts 0) every layer keeps the dense MLP."""

    # The float32 router is no nn.Linear: quantization leaves it. An FP8 checkpoint's expert (and
    # router) tensors are dequantized with their scales as they load, then quantized per row.
    unquantized_linear: tuple[str, ...] = ("mlp.gate",)
    dequantized_at_load: tuple[str, ...] = (EXPERT_TENSORS, "mlp.gate")
    linear_input_producers: dict[str, str] = {}  # no FP8 hand-over from the norms (not measured here)

    make_mlp = staticmethod(hunyuan_mlp)

    @staticmethod
    def rename_checkpoint(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            for old, new in _RENAMES:
                name = name.replace(old, new)
            yield name, tensor
