"""NomicBERT (nomic-embed-text-v1 / v1.5, CodeRankEmbed): BERT's post-norm blocks with RoPE instead of
learned positions, a SwiGLU MLP and no biases on the projections:

    x = emb_ln(word_embeddings(ids) + token_type_embeddings(types))
    per layer:  x = norm1(x + out_proj(attention(rope(q), rope(k), v))),  q|k|v = Wqkv(x)
                x = norm2(x + fc2(silu(fc12(x)) * fc11(x)))

Attribute names are the checkpoint's (the published remote-code names, which transformers' own
NomicBertModel also writes on save_pretrained); fc12 (the gate) and fc11 (up) load into one fused fc1,
as the decoders fuse gate and up. It runs packed, as BERT does (models/bert.py). config.json comes in
two spellings: the published GPT-2-style one (n_embd, n_head, rotary_emb_base, ...) and transformers'
(hidden_size, num_attention_heads, rope_parameters); nomic_arch reads both and refuses the options
these blocks do not implement (biases, pre-norm, dynamic RoPE scaling).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from overnight.arch import ModelArch
from overnight.errors import ModelLoadError
from overnight.layers.activation import SiluAndMul
from overnight.layers.rotary import RotaryEmbedding
from overnight.models.bert import EncoderBatch, encoder_attention
from overnight.models.checkpoint import load_packed_weights
from overnight.models.llama import split_qkv

PACKED_MODULES_MAPPING: dict[str, tuple[str, str | int]] = {"fc12": ("fc1", 0), "fc11": ("fc1", 1)}
_UNUSED = ("lm_head.", "cls.", "pooler.", "embeddings.position_ids", "embeddings.token_type_ids")


class NomicBertEmbeddings(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.token_type_embeddings = nn.Embedding(arch.type_vocab_size, arch.hidden_size)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None) -> torch.Tensor:
        x = self.word_embeddings(input_ids)
        if token_type_ids is None:
            return x + self.token_type_embeddings.weight[0]
        return x + self.token_type_embeddings(token_type_ids)


class NomicBertAttention(nn.Module):
    def __init__(self, arch: ModelArch, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = arch.num_attention_heads
        self.head_dim = arch.head_dim
        self.Wqkv = nn.Linear(arch.hidden_size, 3 * arch.q_size, bias=False)
        self.out_proj = nn.Linear(arch.q_size, arch.hidden_size, bias=False)
        self.rotary_emb = rotary_emb

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        q, k, v = split_qkv(self.Wqkv(x), self.num_heads, self.num_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        return self.out_proj(encoder_attention(q, k, v, batch, self.head_dim**-0.5))


class NomicBertMLP(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.fc1 = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)  # [fc12 | fc11]
        self.act = SiluAndMul()
        self.fc2 = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class NomicBertBlock(nn.Module):
    def __init__(self, arch: ModelArch, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.attn = NomicBertAttention(arch, rotary_emb)
        self.norm1 = nn.LayerNorm(arch.hidden_size, eps=arch.layer_norm_eps)
        self.mlp = NomicBertMLP(arch)
        self.norm2 = nn.LayerNorm(arch.hidden_size, eps=arch.layer_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        x = self.norm1(x + self.attn(positions, x, batch))
        return self.norm2(x + self.mlp(x))


class NomicBertEncoder(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        rotary = RotaryEmbedding(
            arch.head_dim,
            arch.max_position_embeddings,
            arch.rope_theta,
            rotary_dim=int(arch.head_dim * arch.partial_rotary_factor),
            interleaved=arch.rope_interleaved,
        )
        self.layers = nn.ModuleList(NomicBertBlock(arch, rotary) for _ in range(arch.num_hidden_layers))


class NomicBertModel(nn.Module):
    """Hidden states [T, hidden] of a packed batch of prompts (pooling is the caller's)."""

    packed_modules_mapping = PACKED_MODULES_MAPPING

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.arch = arch
        self.checkpoint_kv_scales: dict[int, tuple[float, float]] = {}  # no KV cache: always empty
        self.embeddings = NomicBertEmbeddings(arch)
        self.emb_ln = nn.LayerNorm(arch.hidden_size, eps=arch.layer_norm_eps)
        self.encoder = NomicBertEncoder(arch)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: EncoderBatch,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = self.emb_ln(self.embeddings(input_ids, token_type_ids))
        for layer in self.encoder.layers:
            x = layer(positions, x, batch)
        return x

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_packed_weights(self, ((n, t) for n, t in weights if not n.startswith(_UNUSED)))


def _field(cfg: dict[str, Any], published: str, hf: str, default: Any = None) -> Any:
    value = cfg.get(published, cfg.get(hf, default))
    if value is None:
        raise ModelLoadError(f"config.json lacks required field {hf!r} ({published!r})")
    return value


def nomic_arch(cfg: dict[str, Any]) -> ModelArch:
    """ModelArch of a NomicBERT config.json (either spelling: see the module docstring)."""
    act = cfg.get("activation_function", cfg.get("hidden_act", "swiglu"))
    if act not in ("swiglu", "silu"):
        raise ModelLoadError(f"unsupported activation {act!r} for NomicBERT (only swiglu)")
    refused = {
        "qkv_proj_bias": "biases on Wqkv",
        "mlp_fc1_bias": "biases on fc11 / fc12",
        "mlp_fc2_bias": "a bias on fc2",
        "prenorm": "pre-norm blocks",
        "use_rms_norm": "RMSNorm",
        "causal": "causal attention",
        "rotary_scaling_factor": "dynamic RoPE scaling (rotary_scaling_factor)",
    }
    for key, what in refused.items():
        if cfg.get(key):
            raise ModelLoadError(f"unsupported in NomicBERT: {what}")
    if cfg.get("scale_attn_weights") is False:
        raise ModelLoadError("unsupported in NomicBERT: unscaled attention (scale_attn_weights false)")
    fraction = float(cfg.get("rotary_emb_fraction", 1.0))
    rope = cfg.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ModelLoadError(f"unsupported RoPE type {rope['rope_type']!r} for NomicBERT (default only)")
    hidden = int(_field(cfg, "n_embd", "hidden_size"))
    heads = int(_field(cfg, "n_head", "num_attention_heads"))
    head_dim = hidden // heads
    if not 0 < fraction <= 1 or int(head_dim * fraction) % 2:
        raise ModelLoadError(f"rotary_emb_fraction must turn an even share of head_dim, got {fraction}")
    return ModelArch(
        architecture="nomic_bert",
        vocab_size=int(_field(cfg, "vocab_size", "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(_field(cfg, "n_inner", "intermediate_size", 4 * hidden)),
        num_hidden_layers=int(_field(cfg, "n_layer", "num_hidden_layers")),
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=head_dim,
        rope_theta=float(cfg.get("rotary_emb_base", rope.get("rope_theta", 1000.0))),
        partial_rotary_factor=fraction,
        rope_interleaved=bool(cfg.get("rotary_emb_interleaved", False)),
        max_position_embeddings=int(_field(cfg, "n_positions", "max_position_embeddings", 2048)),
        is_encoder=True,
        type_vocab_size=int(cfg.get("type_vocab_size", 2)),
        layer_norm_eps=float(_field(cfg, "layer_norm_epsilon", "layer_norm_eps", 1e-12)),
    )
