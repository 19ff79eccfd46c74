"""A decoder run for its hidden states (Qwen3-Embedding and other decoder embedding models): the
family's own model with its LM head taken off, applied from outside like quantization. A decoder
sequence classifier (Qwen3ForSequenceClassification, LlamaForSequenceClassification: arch.num_labels)
keeps its `score` head, a linear map without bias applied to the last token's state.

HF's classifiers pool the last token that is not the pad token; a prompt here is never padded, so that
is its last token (a prompt that itself ends in the pad id is the one case where HF looks further back).

Embedding checkpoints are often saved from the bare decoder (sentence-transformers saves Qwen3Model:
"layers.0....", "norm.weight", no "model." prefix and no lm_head); load_weights accepts both that and a
full causal-LM checkpoint, whose LM head it skips.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from overnight.attention.metadata import AttentionBatch
from overnight.config import ModelArch
from overnight.errors import ModelLoadError
from overnight.models.interface import as_causal_lm


class DecoderForPooling(nn.Module):
    def __init__(self, causal_lm: nn.Module) -> None:
        super().__init__()
        decoder = as_causal_lm(causal_lm)
        self.arch: ModelArch = decoder.arch
        self.packed_modules_mapping = decoder.packed_modules_mapping
        del causal_lm.lm_head  # never run: no logits are computed
        self.decoder = decoder
        # The classifier's head; built in the caller's dtype and device context, as the decoder is.
        labels = self.arch.num_labels
        self.score = nn.Linear(self.arch.hidden_size, labels, bias=False) if labels else None

    @property
    def checkpoint_kv_scales(self) -> dict[int, tuple[float, float]]:
        return self.decoder.checkpoint_kv_scales

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBatch) -> torch.Tensor:
        return self.decoder(input_ids, positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a model run for pooling has no LM head")

    def classify(self, rows: torch.Tensor) -> torch.Tensor:
        """The classifier's logits [B, num_labels] (float32) of last-token states rows [B, hidden]."""
        assert self.score is not None, "not a sequence classifier"
        return F.linear(rows.float(), self.score.weight.float())

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        head: list[torch.Tensor] = []
        self.decoder.load_weights(_decoder_names(weights, head if self.score is not None else None))
        if self.score is not None:
            if not head:
                raise ModelLoadError("the sequence classifier's checkpoint has no score.weight")
            if tuple(head[0].shape) != tuple(self.score.weight.shape):
                raise ModelLoadError(
                    f"score.weight has shape {tuple(head[0].shape)}, expected {tuple(self.score.weight.shape)}"
                )
            with torch.no_grad():
                self.score.weight.copy_(head[0])


def _decoder_names(
    weights: Iterable[tuple[str, torch.Tensor]], head: list[torch.Tensor] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The decoder's tensors, as the decoder names them; a classifier's score.weight goes to `head`."""
    for name, tensor in weights:
        if name.startswith("lm_head."):
            continue
        if head is not None and name == "score.weight":
            head.append(tensor)
            continue
        yield (name if name.startswith("model.") else "model." + name), tensor
