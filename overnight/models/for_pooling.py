"""A decoder run for its hidden states (Qwen3-Embedding and other decoder embedding models): the
family's own model with its LM head taken off, applied from outside like quantization.

Embedding checkpoints are often saved from the bare decoder (sentence-transformers saves Qwen3Model:
"layers.0....", "norm.weight", no "model." prefix and no lm_head); load_weights accepts both that and a
full causal-LM checkpoint, whose LM head it skips.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from overnight.attention.metadata import AttentionBatch
from overnight.config import ModelArch
from overnight.models.interface import as_causal_lm


class DecoderForPooling(nn.Module):
    def __init__(self, causal_lm: nn.Module) -> None:
        super().__init__()
        decoder = as_causal_lm(causal_lm)
        self.arch: ModelArch = decoder.arch
        self.packed_modules_mapping = decoder.packed_modules_mapping
        del causal_lm.lm_head  # never run: no logits are computed
        self.decoder = decoder

    @property
    def checkpoint_kv_scales(self) -> dict[int, tuple[float, float]]:
        return self.decoder.checkpoint_kv_scales

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBatch) -> torch.Tensor:
        return self.decoder(input_ids, positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a model run for pooling has no LM head")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.decoder.load_weights(_decoder_names(weights))


def _decoder_names(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        if name.startswith("lm_head."):
            continue
        yield (name if name.startswith("model.") else "model." + name), tensor
