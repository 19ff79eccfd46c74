"""ModernBERT (gte-modernbert, ModernBERT-embed, gte-reranker-modernbert): an encoder with pre-norm
blocks, RoPE instead of learned positions, a GeGLU MLP, and attention that alternates between global
layers (every global_attn_every_n_layers-th, from layer 0) and local ones, which see only the tokens
within local_attention // 2 positions either side:

    x = norm(tok_embeddings(ids))
    per layer i:  x = x + Wo(attention(rope_i(q), rope_i(k), v)),  q|k|v = Wqkv(attn_norm(x))  (no attn_norm
                  in layer 0) ; x = x + Wo(gelu(a) * g),  a|g = Wi(mlp_norm(x))
    out = final_norm(x)

Global layers rotate with global_rope_theta, local ones with local_rope_theta. LayerNorms and linears
have biases only where config.json says (norm_bias, attention_bias, mlp_bias). It runs packed, as
BERT does (models/bert.py: EncoderBatch, encoder_attention); attribute names are the checkpoint's.

ModernBertForSequenceClassification pools (the first token, or the mean over the prompt:
classifier_pooling), then head = norm(gelu(dense(pooled))) and classifier, as transformers computes it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from overnight.arch import ModelArch
from overnight.errors import ModelLoadError
from overnight.layers.gemma import GeluAndMul
from overnight.layers.rotary import RotaryEmbedding
from overnight.models.bert import EncoderBatch, encoder_attention
from overnight.models.checkpoint import load_packed_weights
from overnight.models.llama import split_qkv

# Tensors of other ModernBERT heads (masked LM) that an embedding model leaves unused.
_LM_HEAD = ("head.", "decoder.")


def _layer_norm(arch: ModelArch) -> nn.LayerNorm:
    return nn.LayerNorm(arch.hidden_size, eps=arch.layer_norm_eps, bias=arch.norm_bias)


class ModernBertEmbeddings(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.norm = _layer_norm(arch)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.norm(self.tok_embeddings(input_ids))


class ModernBertAttention(nn.Module):
    def __init__(self, arch: ModelArch, layer_idx: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = arch.num_attention_heads
        self.head_dim = arch.head_dim
        self.window = arch.layer_window(layer_idx)
        self.Wqkv = nn.Linear(arch.hidden_size, 3 * arch.q_size, bias=arch.attention_bias)
        self.Wo = nn.Linear(arch.q_size, arch.hidden_size, bias=arch.attention_bias)
        self.rotary_emb = rotary_emb

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        q, k, v = split_qkv(self.Wqkv(x), self.num_heads, self.num_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        return self.Wo(encoder_attention(q, k, v, batch, self.head_dim**-0.5, self.window))


class ModernBertMLP(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.Wi = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=arch.mlp_bias)
        self.act = GeluAndMul("none")  # gelu(first half) * second half, as HF chunks Wi's output
        self.Wo = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=arch.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.Wo(self.act(self.Wi(x)))


class ModernBertEncoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, layer_idx: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        # Layer 0's input is the embedding norm's output: it has no attn_norm (nor its tensors).
        self.attn_norm: nn.Module = nn.Identity() if layer_idx == 0 else _layer_norm(arch)
        self.attn = ModernBertAttention(arch, layer_idx, rotary_emb)
        self.mlp_norm = _layer_norm(arch)
        self.mlp = ModernBertMLP(arch)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        x = x + self.attn(positions, self.attn_norm(x), batch)
        return x + self.mlp(self.mlp_norm(x))


class ModernBertModel(nn.Module):
    """Hidden states [T, hidden] of a packed batch of prompts (pooling is the caller's)."""

    packed_modules_mapping: dict[str, tuple[str, str | int]] = {}  # Wqkv is fused in the checkpoint

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.arch = arch
        self.checkpoint_kv_scales: dict[int, tuple[float, float]] = {}  # no KV cache: always empty
        self.embeddings = ModernBertEmbeddings(arch)
        local_theta = arch.local_rope_theta if arch.local_rope_theta is not None else arch.rope_theta
        rotary = {
            None: RotaryEmbedding(arch.head_dim, arch.max_position_embeddings, arch.rope_theta),
            "local": RotaryEmbedding(arch.head_dim, arch.max_position_embeddings, local_theta),
        }
        self.layers = nn.ModuleList(
            ModernBertEncoderLayer(arch, i, rotary[None if arch.layer_window(i) is None else "local"])
            for i in range(arch.num_hidden_layers)
        )
        self.final_norm = _layer_norm(arch)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: EncoderBatch,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """token_type_ids: unused (ModernBERT has no segments; the runner never builds them here)."""
        x = self.embeddings(input_ids)
        for layer in self.layers:
            x = layer(positions, x, batch)
        return self.final_norm(x)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """ModernBertModel tensors; a ModernBertFor* checkpoint's ("model."-prefixed, its head left out)
        load too."""

        def used() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if not name.startswith(_LM_HEAD):
                    yield name.removeprefix("model."), tensor

        load_packed_weights(self, used())


class ModernBertPredictionHead(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.dense = nn.Linear(arch.hidden_size, arch.hidden_size, bias=arch.classifier_bias)
        self.norm = _layer_norm(arch)


class ModernBertForSequenceClassification(nn.Module):
    packed_modules_mapping: dict[str, tuple[str, str | int]] = {}

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        assert arch.num_labels > 0, "a sequence classifier has labels"
        self.arch = arch
        self.checkpoint_kv_scales: dict[int, tuple[float, float]] = {}
        self.model = ModernBertModel(arch)
        self.head = ModernBertPredictionHead(arch)
        self.classifier = nn.Linear(arch.hidden_size, arch.num_labels)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: EncoderBatch,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, batch)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """The logits [B, num_labels] of pooled rows [B, H] float32 (pooled as arch.classifier_pooling
        says), in float32 as the BERT head runs (models/bert_classifier.py)."""
        dense, norm, out = self.head.dense, self.head.norm, self.classifier

        def f32(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.float()

        x = F.gelu(F.linear(pooled, dense.weight.float(), f32(dense.bias)))
        x = F.layer_norm(x, x.shape[-1:], f32(norm.weight), f32(norm.bias), norm.eps)
        return F.linear(x, out.weight.float(), f32(out.bias))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_packed_weights(self, weights)


def modernbert_arch(cfg: dict[str, Any], num_labels: int) -> ModelArch:
    """ModelArch of a ModernBERT config.json: transformers 5's (layer_types, rope_parameters per layer
    kind) or the published checkpoints' (global_attn_every_n_layers, global/local_rope_theta)."""
    for key, allowed in (("hidden_activation", "gelu"), ("classifier_activation", "gelu")):
        if cfg.get(key, allowed) != allowed:
            raise ModelLoadError(f"unsupported {key} {cfg[key]!r} for ModernBERT (only {allowed})")
    pooling = str(cfg.get("classifier_pooling", "cls"))
    if pooling not in ("cls", "mean"):
        raise ModelLoadError(f"unsupported classifier_pooling {pooling!r} for ModernBERT (cls, mean)")
    try:
        n = int(cfg["num_hidden_layers"])
        every = int(cfg.get("global_attn_every_n_layers", 3))
        types = tuple(
            cfg.get("layer_types")
            or ("sliding_attention" if i % every else "full_attention" for i in range(n))
        )
        kinds = ("full_attention", "sliding_attention")
        if len(types) != n or any(t not in kinds for t in types):
            raise ModelLoadError(f"layer_types must name {n} layers, each one of {', '.join(kinds)}")
        rope = cfg.get("rope_parameters") or {}
        theta = {"full_attention": float(cfg.get("global_rope_theta", 160000.0))}
        theta["sliding_attention"] = float(cfg.get("local_rope_theta", 10000.0))
        for kind in kinds:
            params = rope.get(kind) or {}
            if params.get("rope_type", "default") != "default" or cfg.get("rope_scaling"):
                raise ModelLoadError("unsupported: RoPE scaling in a ModernBERT config")
            theta[kind] = float(params.get("rope_theta", theta[kind]))
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return ModelArch(
            architecture="modernbert",
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=n,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            head_dim=hidden // heads,
            rope_theta=theta["full_attention"],
            local_rope_theta=theta["sliding_attention"],
            max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            o_proj_bias=bool(cfg.get("attention_bias", False)),
            layer_types=types,
            sliding_window=int(cfg.get("local_attention", 128)),
            is_encoder=True,
            layer_norm_eps=float(cfg.get("norm_eps", 1e-5)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            norm_bias=bool(cfg.get("norm_bias", False)),
            num_labels=num_labels,
            classifier_pooling=pooling.upper(),
            classifier_bias=bool(cfg.get("classifier_bias", False)),
        )
    except KeyError as e:
        raise ModelLoadError(f"config.json lacks required field {e.args[0]!r}") from None
