"""Qwen3 (dense): the Llama decoder with an RMSNorm over each head of q and k, applied before RoPE."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from overnight.attention.metadata import AttentionBatch
from overnight.config import ModelArch
from overnight.layers.norm import RMSNorm
from overnight.layers.rotary import RotaryEmbedding
from overnight.models.llama import (
    PACKED_MODULES_MAPPING,
    LlamaModel,
    load_packed_weights,
    make_lm_head,
    split_qkv,
)


class Qwen3Attention(nn.Module):
    def __init__(self, arch: ModelArch, layer_idx: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = arch.num_attention_heads
        self.num_kv_heads = arch.num_key_value_heads
        self.head_dim = arch.head_dim
        self.scale = arch.head_dim**-0.5
        self.qkv_proj = nn.Linear(arch.hidden_size, arch.q_size + 2 * arch.kv_size, bias=arch.attention_bias)
        self.o_proj = nn.Linear(arch.q_size, arch.hidden_size, bias=arch.attention_bias)
        # Over head_dim only, so the weights are shared by all heads and survive head sharding.
        self.q_norm = RMSNorm(arch.head_dim, eps=arch.rms_norm_eps)
        self.k_norm = RMSNorm(arch.head_dim, eps=arch.rms_norm_eps)
        self.rotary_emb = rotary_emb

    def forward(self, positions: torch.Tensor, x: torch.Tensor, attn: AttentionBatch) -> torch.Tensor:
        q, k, v = split_qkv(self.qkv_proj(x), self.num_heads, self.num_kv_heads, self.head_dim)
        # The norms run inside the rotary layer, so the GPU path fuses norm + rotation into one kernel.
        q, k = self.rotary_emb(positions, q, k, q_norm=self.q_norm, k_norm=self.k_norm)
        o = attn(self.layer_idx, q, k, v, self.scale)
        return self.o_proj(o.flatten(1))


class Qwen3ForCausalLM(nn.Module):
    packed_modules_mapping = PACKED_MODULES_MAPPING

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.arch = arch
        self.model = LlamaModel(arch, Qwen3Attention)
        self.lm_head = make_lm_head(arch, self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBatch) -> torch.Tensor:
        return self.model(input_ids, positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_packed_weights(self, weights)
