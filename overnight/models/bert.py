"""The BERT encoder (BERT, BGE, E5, MiniLM, ...; XLM-RoBERTa too: the same blocks, with positions that
start past the padding id, ModelArch.position_offset): bidirectional attention over whole prompts,
learned absolute positions, token-type embeddings, post-LayerNorm blocks, GELU.

Attribute names follow the HF checkpoint keys, except q/k/v, which load_weights fuses into one
projection (as the decoders do) through packed_modules_mapping. The model runs on a packed batch: the
tokens of every prompt back to back ([T, hidden], no padding), so the projections and the MLP never
compute padding; only attention sees the prompts as a padded [batch, longest, ...] block, which is where
the prompts must be kept apart (EncoderBatch says how they are laid out).

    packed rows   a0 a1 a2 b0 b1 c0 c1 c2 c3          (T = 9)
    padded slots  a0 a1 a2 __ | b0 b1 __ __ | c0 c1 c2 c3   (batch 3 x longest 4; __ never attended to)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from overnight.arch import ModelArch
from overnight.models.llama import load_packed_weights, split_qkv

PACKED_MODULES_MAPPING: dict[str, tuple[str, str | int]] = {
    "query": ("qkv", "q"),
    "key": ("qkv", "k"),
    "value": ("qkv", "v"),
}
# Checkpoint tensors a sentence embedding does not use: the masked-LM head and a position-id buffer some
# files store; and the pooler (dense + tanh over CLS, a next-sentence-prediction head), which only a
# sequence classifier's head uses (models/classifier.py).
_UNUSED_PREFIXES = ("cls.", "embeddings.position_ids", "embeddings.token_type_ids")
_MODEL_PREFIXES = ("bert.", "roberta.")  # a BertFor* / XLMRobertaFor* checkpoint's encoder


@dataclass
class EncoderBatch:
    """How the packed prompts of one forward pass are laid out (see the module docstring)."""

    seq_lens: list[int]
    max_len: int
    # Slot of each packed row in the padded [batch * max_len] layout; None when every prompt has the
    # same length (the padded layout is then the packed one).
    slots: torch.Tensor | None
    key_mask: torch.Tensor | None  # [batch, 1, 1, max_len] bool, True where a key is a real token
    # Masks of the windowed layers (models/modernbert.py, gemma_encoder.py), by window, built once a
    # batch: [batch or 1, 1, max_len, max_len] bool.
    _window_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def mask(self, window: int | None, device: torch.device) -> torch.Tensor | None:
        """The attention mask of a layer: the padding mask, and for a sliding layer (window W) the band
        |i - j| <= W // 2 around each query (ModelArch.sliding_window)."""
        if window is None:
            return self.key_mask
        if window not in self._window_masks:
            pos = torch.arange(self.max_len, device=device)
            band = ((pos[:, None] - pos[None, :]).abs() <= window // 2)[None, None]
            self._window_masks[window] = band if self.key_mask is None else band & self.key_mask
        return self._window_masks[window]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @classmethod
    def build(cls, seq_lens: list[int], device: torch.device) -> EncoderBatch:
        longest = max(seq_lens)
        if all(n == longest for n in seq_lens):
            return cls(seq_lens, longest, None, None)
        lens = torch.tensor(seq_lens)
        starts = torch.arange(len(seq_lens)) * longest
        offsets = torch.arange(int(lens.sum())) - torch.repeat_interleave(lens.cumsum(0) - lens, lens)
        slots = torch.repeat_interleave(starts, lens) + offsets
        mask = torch.arange(longest)[None, :] < lens[:, None]
        return cls(seq_lens, longest, slots.to(device), mask[:, None, None, :].to(device))


def encoder_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: EncoderBatch,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Bidirectional attention of each prompt over itself (within the window of a sliding layer:
    EncoderBatch.mask). q: [T, heads, head_dim], k, v: [T, kv_heads, head_dim] packed (kv_heads divides
    heads: grouped-query attention); returns [T, heads * head_dim]."""
    b, n, (_, h, d) = batch.num_seqs, batch.max_len, q.shape

    def padded(x: torch.Tensor) -> torch.Tensor:
        if batch.slots is not None:
            x = x.new_zeros(b * n, *x.shape[1:]).index_copy_(0, batch.slots, x)
        return x.view(b, n, *x.shape[1:]).transpose(1, 2)

    o = F.scaled_dot_product_attention(
        padded(q),
        padded(k),
        padded(v),
        attn_mask=batch.mask(window, q.device),
        scale=scale,
        enable_gqa=k.shape[1] != h,
    )
    o = o.transpose(1, 2).reshape(b * n, h * d)
    return o if batch.slots is None else o.index_select(0, batch.slots)


class BertEmbeddings(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.position_offset = arch.position_offset
        self.word_embeddings = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.position_embeddings = nn.Embedding(
            arch.max_position_embeddings + arch.position_offset, arch.hidden_size
        )
        self.token_type_embeddings = nn.Embedding(arch.type_vocab_size, arch.hidden_size)
        self.LayerNorm = nn.LayerNorm(arch.hidden_size, eps=arch.layer_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """positions count from 0 in each prompt; token_type_ids None: one segment (type 0) throughout."""
        if self.position_offset:
            positions = positions + self.position_offset
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        if token_type_ids is None:
            return self.LayerNorm(x + self.token_type_embeddings.weight[0])
        return self.LayerNorm(x + self.token_type_embeddings(token_type_ids))


class BertSelfAttention(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.num_heads = arch.num_attention_heads
        self.head_dim = arch.head_dim
        self.qkv = nn.Linear(arch.hidden_size, 3 * arch.hidden_size)

    def forward(self, x: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        q, k, v = split_qkv(self.qkv(x), self.num_heads, self.num_heads, self.head_dim)
        return encoder_attention(q, k, v, batch, self.head_dim**-0.5)


class BertSelfOutput(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.dense = nn.Linear(arch.hidden_size, arch.hidden_size)
        self.LayerNorm = nn.LayerNorm(arch.hidden_size, eps=arch.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.self = BertSelfAttention(arch)
        self.output = BertSelfOutput(arch)

    def forward(self, x: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        return self.output(self.self(x, batch), x)


class BertIntermediate(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.dense = nn.Linear(arch.hidden_size, arch.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(x))


class BertOutput(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.dense = nn.Linear(arch.intermediate_size, arch.hidden_size)
        self.LayerNorm = nn.LayerNorm(arch.hidden_size, eps=arch.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertLayer(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.attention = BertAttention(arch)
        self.intermediate = BertIntermediate(arch)
        self.output = BertOutput(arch)

    def forward(self, x: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        x = self.attention(x, batch)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(arch) for _ in range(arch.num_hidden_layers))

    def forward(self, x: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x, batch)
        return x


class BertPooler(nn.Module):
    """dense + tanh over a prompt's first token: a sequence classifier's head runs on it."""

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.dense = nn.Linear(arch.hidden_size, arch.hidden_size)

    def forward(self, first: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(first))


class BertModel(nn.Module):
    """Hidden states [T, hidden] of a packed batch of prompts. Pooling is the caller's; the pooler
    (BertPooler) is built only for a sequence classifier (arch.num_labels), whose head runs it."""

    packed_modules_mapping = PACKED_MODULES_MAPPING

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.arch = arch
        self.checkpoint_kv_scales: dict[int, tuple[float, float]] = {}  # no KV cache: always empty
        self.embeddings = BertEmbeddings(arch)
        self.encoder = BertEncoder(arch)
        self.pooler = BertPooler(arch) if arch.num_labels else None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: EncoderBatch,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.encoder(self.embeddings(input_ids, positions, token_type_ids), batch)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF BertModel / XLMRobertaModel tensors; those of a BertFor* / XLMRobertaFor* checkpoint
        (prefixed "bert." / "roberta.") load too."""
        unused = _UNUSED_PREFIXES if self.pooler is not None else (*_UNUSED_PREFIXES, "pooler.")

        def used() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                for prefix in _MODEL_PREFIXES:
                    name = name.removeprefix(prefix)
                if not name.startswith(unused):
                    yield name, tensor

        load_packed_weights(self, used())
