"""Qwen2 / Qwen2.5: the Llama decoder with a bias on the q/k/v projections (none on o_proj)."""

from __future__ import annotations

import torch
from torch import nn

from overnight.attention.metadata import AttentionBatch
from overnight.config import ModelArch
from overnight.layers.rotary import RotaryEmbedding
from overnight.models.llama import (
    LlamaForCausalLM,
    split_qkv,
)


class Qwen2Attention(nn.Module):
    def __init__(self, arch: ModelArch, layer_idx: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = arch.num_attention_heads
        self.num_kv_heads = arch.num_key_value_heads
        self.head_dim = arch.head_dim
        self.scale = arch.head_dim**-0.5
        self.qkv_proj = nn.Linear(arch.hidden_size, arch.q_size + 2 * arch.kv_size, bias=True)
        self.o_proj = nn.Linear(arch.q_size, arch.hidden_size, bias=False)
        self.rotary_emb = rotary_emb

    def forward(self, positions: torch.Tensor, x: torch.Tensor, attn: AttentionBatch) -> torch.Tensor:
        q, k, v = split_qkv(self.qkv_proj(x), self.num_heads, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        o = attn(self.layer_idx, q, k, v, self.scale)
        return self.o_proj(o.flatten(1))


class Qwen2ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen2Attention
