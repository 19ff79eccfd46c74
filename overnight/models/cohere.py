"""Cohere Command R (CohereForCausalLM) and Command R7B / A (Cohere2ForCausalLM): one bias-free
LayerNorm feeds attention and the MLP side by side,

    h = x + attn(n) + mlp(n),   n = norm(x)

with Llama's attention (RoPE in interleaved pairs, as GLM-4's) and gated MLP, tied embeddings and the
logits times logit_scale. Cohere 2's windowed layers and RoPE-less full layers are ModelArch's per-layer
description (models/layer_spec.py), read by models/dense_config._cohere_fields.
"""

from __future__ import annotations

import torch
from torch import nn

from overnight.arch import ModelArch
from overnight.attention.metadata import AttentionBatch
from overnight.layers.layer_norm import LayerNormNoBias
from overnight.layers.rotary import RotaryEmbedding
from overnight.models.layer_spec import LayerSpec
from overnight.models.llama import Attention, LlamaForCausalLM, MlpFactory, dense_mlp


class CohereDecoderLayer(nn.Module):
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
        self.input_layernorm = LayerNormNoBias(arch.hidden_size, eps=arch.layer_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, attn: AttentionBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # LlamaDecoderLayer's contract: the hidden state is x + residual (x alone for the first layer);
        # the returned pair is added by the next layer or the final norm.
        if residual is None:
            residual, n = x, self.input_layernorm(x)
        else:
            n, residual = self.input_layernorm(x, residual)
        return self.self_attn(positions, n, attn) + self.mlp(n), residual


class CohereForCausalLM(LlamaForCausalLM):
    # The one norm feeds two projections (qkv and gate/up) and hands over no quantized output.
    linear_input_producers: dict[str, str] = {"mlp.act_fn": "mlp.down_proj"}

    make_layer = CohereDecoderLayer
