"""Cohere Command R (CohereForCausalLM) and Command R7B / A (Cohere2ForCausalLM): one bias-free
LayerNorm feeds attention and the MLP side by side,

    h = x + attn(n) + mlp(n),   n = norm(x)

with Llama's attention (RoPE in interleaved pairs, as GLM-4's) and gated MLP, tied embeddings and the
logits times logit_scale. Cohere 2's windowed layers and RoPE-less full layers are ModelArch's per-layer
description (models/layer_spec.py), read by models/dense_config._cohere_fields.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from overnight.attention.metadata import AttentionBatch
from overnight.config import ModelArch
from overnight.layers.layer_norm import LayerNormNoBias
from overnight.layers.rotary import RotaryEmbedding
from overnight.models.checkpoint import load_packed_weights
from overnight.models.layer_spec import LayerSpec
from overnight.models.llama import (
    PACKED_MODULES_MAPPING,
    Attention,
    LlamaModel,
    MlpFactory,
    dense_mlp,
    make_lm_head,
    scaled_logits,
)


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


class CohereForCausalLM(nn.Module):
    packed_modules_mapping = PACKED_MODULES_MAPPING
    # The one norm feeds two projections (qkv and gate/up) and hands over no quantized output.
    linear_input_producers: dict[str, str] = {"mlp.act_fn": "mlp.down_proj"}

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.arch = arch
        self.checkpoint_kv_scales: dict[int, tuple[float, float]] = {}
        self.model = LlamaModel(arch, make_layer=CohereDecoderLayer)
        self.lm_head = make_lm_head(arch, self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBatch) -> torch.Tensor:
        return self.model(input_ids, positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return scaled_logits(self.arch, self.lm_head(hidden))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_packed_weights(self, weights)
