"""Gemma 2 and Gemma 3 (text; also the language model of Gemma3ForConditionalGeneration checkpoints).

The decoder of both, as HF's modeling_gemma2.py / modeling_gemma3.py compute it:

    x = embed_tokens(ids) * sqrt(hidden)                  (the scale rounded to the compute dtype first)
    per layer i (its kind: full, or a sliding window of W; its own rotary table):
        h = o_proj(attention(rope(q_norm(q)), rope(k_norm(k)), v))      (q/k norms: Gemma 3 only)
        x = x + post_attention_layernorm(h)
        x = x + post_feedforward_layernorm(down(gelu_tanh(gate(y)) * up(y))),  y = pre_feedforward_layernorm(x)
    logits = softcap(lm_head(norm(x)), final_logit_softcapping)

Attention scores are scaled by query_pre_attn_scalar ** -0.5 (ModelArch.attention_scale); Gemma 2 softcaps
them (attn_logit_softcapping), Gemma 3 does not (HF ignores the field there). Sliding layers of Gemma 3
rotate with local_rope_theta, full ones with rope_theta and the linear factor; Gemma 2 has one table.
Every norm is (1 + w): folded into the weights at load (layers/gemma.py). As in models/llama.py, each
residual add is deferred into the next norm (the fused add + norm); the sandwich norm after attention
and after the MLP normalises the sub-block's output alone, before that add.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Iterator
from typing import Protocol

import torch
from torch import nn

from overnight.arch import ModelArch
from overnight.attention.metadata import AttentionBatch
from overnight.attention.spec import FULL_ATTENTION, LayerAttention
from overnight.layers.gemma import GeluAndMul, GemmaRotaryEmbedding, fold_gemma_norms, softcap
from overnight.layers.norm import RMSNorm
from overnight.models.llama import PACKED_MODULES_MAPPING, load_packed_weights, make_lm_head, split_qkv
from overnight.models.vision.interface import VisionRows, merge_image_rows

log = logging.getLogger("overnight")

# Multimodal checkpoints (Gemma3/4ForConditionalGeneration) nest the language model under
# "language_model" (transformers has written "language_model.model.", "model.language_model." and
# "model.language_model.model." prefixes): whatever run of "model" / "language_model" leads a name is
# taken off, and the text model's "model." put back. The towers' tensors are skipped.
_WRAPPERS = ("model", "language_model")
_OTHER_MODALITIES = ("vision_tower", "multi_modal_projector", "embed_vision", "audio_tower", "embed_audio")


def gemma_checkpoint_names(module: str) -> tuple[str, ...]:
    """The names a module of a Gemma model may carry in a checkpoint and in its quantization_config's
    ignore lists, which quantizers write in the names of the model they held in memory: the model's
    own (model.layers.*, vision_tower.*), transformers 4's (language_model.model.*,
    vision_tower.vision_model.*), transformers 5's (model.language_model.*,
    model.vision_tower.vision_model.*, model.multi_modal_projector.*) and the doubly nested
    model.language_model.model.* that text_weights also takes."""
    if module.startswith("model."):
        rest = module.removeprefix("model.")
        return (
            module,
            "language_model." + module,
            "model.language_model." + rest,
            "model.language_model.model." + rest,
        )
    if module == "lm_head" or module.startswith("lm_head."):
        return module, "language_model." + module
    if module.startswith("vision_tower."):
        inner = "vision_tower.vision_model." + module.removeprefix("vision_tower.")
        return module, inner, "model." + inner, "model." + module
    if module.startswith("multi_modal_projector."):
        return module, "model." + module
    return (module,)


def text_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint stream under the text model's names: a multimodal checkpoint's language-model
    tensors renamed, its vision/audio towers left out (one log line says how many)."""
    skipped = 0
    for name, tensor in weights:
        parts = name.split(".")
        while len(parts) > 1 and parts[0] in _WRAPPERS:
            parts.pop(0)
        if parts[0] in _OTHER_MODALITIES:
            skipped += 1
            continue
        yield (".".join(parts) if parts[0] == "lm_head" else "model." + ".".join(parts)), tensor
    if skipped:
        log.info("skipped %d vision/audio tensors of the checkpoint: only text prompts are served", skipped)


class Attend(Protocol):
    """What the layers call for attention: the paged AttentionBatch of the decoder engine, or the
    bidirectional attention over whole prompts of the encoder engine (models/gemma_encoder.py)."""

    def __call__(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        scale: float,
        *,
        layer: LayerAttention = FULL_ATTENTION,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


@functools.cache
def embed_scale(hidden_size: int, dtype: torch.dtype) -> float:
    """sqrt(hidden_size) rounded to `dtype`, as HF multiplies it (a tensor cast to the weights' dtype)."""
    return float(torch.tensor(hidden_size**0.5, dtype=torch.float32).to(dtype))


def rotary_tables(arch: ModelArch, head_dims: dict[str, int]) -> dict[str, GemmaRotaryEmbedding]:
    """One table per layer kind, shared by that kind's layers: sliding layers rotate with
    local_rope_theta (None: rope_theta), full ones with rope_theta, rope_factor and rope_proportion."""
    local = arch.local_rope_theta if arch.local_rope_theta is not None else arch.rope_theta
    return {
        "sliding_attention": GemmaRotaryEmbedding(
            head_dims["sliding_attention"], arch.max_position_embeddings, local
        ),
        "full_attention": GemmaRotaryEmbedding(
            head_dims["full_attention"],
            arch.max_position_embeddings,
            arch.rope_theta,
            factor=arch.rope_factor,
            proportion=arch.rope_proportion,
        ),
    }


def layer_kind(arch: ModelArch, layer_idx: int) -> str:
    return "full_attention" if arch.layer_window(layer_idx) is None else "sliding_attention"


class GemmaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act_fn = GeluAndMul("tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class GemmaAttention(nn.Module):
    def __init__(self, arch: ModelArch, layer_idx: int, rotary_emb: GemmaRotaryEmbedding) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = arch.num_attention_heads
        self.num_kv_heads = arch.num_key_value_heads
        self.head_dim = arch.head_dim
        self.scale = arch.attention_scale if arch.attention_scale is not None else arch.head_dim**-0.5
        self.layer = LayerAttention(arch.layer_window(layer_idx), arch.attn_logit_softcapping)
        self.qkv_proj = nn.Linear(arch.hidden_size, arch.q_size + 2 * arch.kv_size, bias=arch.attention_bias)
        self.o_proj = nn.Linear(arch.q_size, arch.hidden_size, bias=arch.attention_bias)
        has_qk_norm = arch.architecture == "gemma3"
        self.q_norm = RMSNorm(arch.head_dim, eps=arch.rms_norm_eps) if has_qk_norm else None
        self.k_norm = RMSNorm(arch.head_dim, eps=arch.rms_norm_eps) if has_qk_norm else None
        self.rotary_emb = rotary_emb

    def forward(self, positions: torch.Tensor, x: torch.Tensor, attn: Attend) -> torch.Tensor:
        q, k, v = split_qkv(self.qkv_proj(x), self.num_heads, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k, q_norm=self.q_norm, k_norm=self.k_norm)
        o = attn(self.layer_idx, q, k, v, self.scale, layer=self.layer)
        return self.o_proj(o.flatten(1))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, layer_idx: int, rotary_emb: GemmaRotaryEmbedding) -> None:
        super().__init__()
        h, eps = arch.hidden_size, arch.rms_norm_eps
        self.self_attn = GemmaAttention(arch, layer_idx, rotary_emb)
        self.mlp = GemmaMLP(h, arch.intermediate_size)
        self.input_layernorm = RMSNorm(h, eps=eps)
        self.post_attention_layernorm = RMSNorm(h, eps=eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps=eps)
        self.post_feedforward_layernorm = RMSNorm(h, eps=eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, attn: Attend
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # In: the previous layer's un-added output and residual (None before the first layer).
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(positions, x, attn))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class GemmaModel(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.hidden_size = arch.hidden_size
        # The whole vocabulary's size: under TP embed_tokens holds only this rank's rows.
        self.vocab_size = arch.vocab_size
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        tables = rotary_tables(arch, {"sliding_attention": arch.head_dim, "full_attention": arch.head_dim})
        if arch.architecture == "gemma2":  # one table for every layer: rope_theta
            tables["sliding_attention"] = tables["full_attention"]
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(arch, i, tables[layer_kind(arch, i)]) for i in range(arch.num_hidden_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, eps=arch.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: Attend,
        vision: VisionRows | None = None,
    ) -> torch.Tensor:
        """vision: the step's image rows (models/gemma_vl.py): their embeddings replace the scaled
        token embeddings of those rows (an image token's id may lie past the vocabulary: read as 0)."""
        if vision is not None:
            input_ids = input_ids.masked_fill(input_ids >= self.vocab_size, 0)
        x = self.embed_tokens(input_ids)
        x = merge_image_rows(x * embed_scale(self.hidden_size, x.dtype), vision)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, attn)
        x, _ = self.norm(x, residual)
        return x


class GemmaForCausalLM(nn.Module):
    """Gemma 2 and Gemma 3 (ModelArch.architecture "gemma2" / "gemma3")."""

    packed_modules_mapping = PACKED_MODULES_MAPPING
    checkpoint_names = staticmethod(gemma_checkpoint_names)  # quant/apply.ignored

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.arch = arch
        self.checkpoint_kv_scales: dict[int, tuple[float, float]] = {}
        self.model = GemmaModel(arch)
        self.lm_head = make_lm_head(arch, self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBatch) -> torch.Tensor:
        return self.model(input_ids, positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return softcap(self.lm_head(hidden), self.arch.final_logit_softcapping)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_packed_weights(self, fold_gemma_norms(text_weights(weights)))
