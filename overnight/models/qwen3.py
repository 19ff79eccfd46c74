"""Qwen3 (dense): the Llama decoder with an RMSNorm over each head of q and k, applied before RoPE."""

from __future__ import annotations

import torch
from torch import nn

from overnight.attention.metadata import AttentionBatch
from overnight.config import ModelArch
from overnight.layers.norm import RMSNorm
from overnight.layers.rotary import RotaryEmbedding
from overnight.models.llama import (
    LlamaForCausalLM,
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


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
