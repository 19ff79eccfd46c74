"""OLMo 2 and OLMo 3: the dense decoder with its norms after each sub-block instead of before.

    h = h + post_attention_layernorm(attn(h))
    h = h + post_feedforward_layernorm(mlp(h))

and q_norm / k_norm over the whole q and k projections (every head together) before RoPE. OLMo 3 adds
sliding-window layers (layer_types) with their own RoPE; all of that is ModelArch's per-layer
description (models/llama.py's LayerSpec), so only the block wiring lives here.
"""

from __future__ import annotations

import torch
from torch import nn

from overnight.arch import ModelArch
from overnight.attention.metadata import AttentionBatch
from overnight.layers.norm import RMSNorm
from overnight.layers.rotary import RotaryEmbedding
from overnight.models.layer_spec import LayerSpec
from overnight.models.llama import Attention, LlamaForCausalLM, MlpFactory, dense_mlp


class OlmoDecoderLayer(nn.Module):
    def __init__(
        self,
        arch: ModelArch,
        layer_idx: int,
        spec: LayerSpec,
        rotary_emb: RotaryEmbedding | None,
        make_mlp: MlpFactory = dense_mlp,
    ) -> None:
        super().__init__()
        self.self_attn = Attention(arch, layer_idx, spec, rotary_emb)
        self.mlp = make_mlp(arch, layer_idx)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, eps=arch.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(arch.hidden_size, eps=arch.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, attn: AttentionBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Same contract as LlamaDecoderLayer: the hidden state is x + residual (x alone for the first
        # layer); the returned pair is added by the next layer or the final norm.
        h = x if residual is None else x + residual
        h = h + self.post_attention_layernorm(self.self_attn(positions, h, attn))
        return self.post_feedforward_layernorm(self.mlp(h)), h


class OlmoForCausalLM(LlamaForCausalLM):
    """OLMo 2 (Olmo2ForCausalLM), OLMo 3 (Olmo3ForCausalLM) and EXAONE 4.0 (Exaone4ForCausalLM: per-head
    q/k norms, its hybrid layers' full ones without RoPE; models/dense_config._exaone4_fields)."""

    # No norm feeds a projection directly (the norms sit after them), so no producer hands over its
    # output already quantized.
    linear_input_producers: dict[str, str] = {"mlp.act_fn": "mlp.down_proj"}

    make_layer = OlmoDecoderLayer
