"""A decoder run for its hidden states (Qwen3-Embedding and other decoder embedding models): the
family's own model with its LM head taken off, applied from outside like quantization. A decoder
sequence classifier (Qwen3ForSequenceClassification, LlamaForSequenceClassification: arch.num_labels)
keeps its `score` head, a linear map without bias applied to the last token's state.

HF's classifiers pool the last token that is not the pad token; a prompt here is never padded, so that
is its last token (a prompt that itself ends in the pad id is the one case where HF looks further back).

A sequence classifier over a causal-LM checkpoint (Qwen3-Reranker loaded with hf_overrides'
classifier_from_token, config.LMHeadClassifier) has no score.weight: its head is made at load from the
LM head's rows of those tokens (the embedding's rows when tied), read as the tensor streams past; the
full LM head is never kept. A 2-way head [false, true] is the one row row_true - row_false, so the
sigmoid of its logit is the softmax over the two tokens' logits at the true token. Heads are float32
(vLLM's head dtype): the difference of two bf16 rows keeps its precision.

Embedding checkpoints are often saved from the bare decoder (sentence-transformers saves Qwen3Model:
"layers.0....", "norm.weight", no "model." prefix and no lm_head); load_weights accepts both that and a
full causal-LM checkpoint, whose LM head it skips.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from overnight.arch import ModelArch
from overnight.attention.metadata import AttentionBatch
from overnight.config import LMHeadClassifier
from overnight.errors import ModelLoadError
from overnight.models.interface import as_causal_lm


class DecoderForPooling(nn.Module):
    def __init__(self, causal_lm: nn.Module, from_tokens: LMHeadClassifier | None = None) -> None:
        """from_tokens: the classifier's head is made from the LM head's rows of these tokens."""
        super().__init__()
        decoder = as_causal_lm(causal_lm)
        self.arch: ModelArch = decoder.arch
        self.packed_modules_mapping = decoder.packed_modules_mapping
        del causal_lm.lm_head  # never run: no logits are computed
        self.decoder = decoder
        labels = self.arch.num_labels
        if from_tokens is not None and from_tokens.num_labels != labels:
            raise ModelLoadError(
                f"classifier_from_token makes {from_tokens.num_labels} label(s), the config says {labels}"
            )
        self.from_tokens = from_tokens
        # The classifier's head, float32, on the caller's device context as the decoder is.
        self.score = (
            nn.Linear(self.arch.hidden_size, labels, bias=False, dtype=torch.float32) if labels else None
        )

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
        rows = _TokenRows(self.from_tokens, self.arch.tie_word_embeddings)
        self.decoder.load_weights(_decoder_names(weights, head if self.score is not None else None, rows))
        if self.score is None:
            return
        if self.from_tokens is not None:
            weight = rows.head_weight()
        elif not head:
            raise ModelLoadError(
                "the sequence classifier's checkpoint has no score.weight; a causal-LM checkpoint "
                "(Qwen3-Reranker) makes its head from its LM head: give classifier_from_token in "
                "hf_overrides"
            )
        else:
            weight = head[0]
        if tuple(weight.shape) != tuple(self.score.weight.shape):
            raise ModelLoadError(
                f"score.weight has shape {tuple(weight.shape)}, expected {tuple(self.score.weight.shape)}"
            )
        with torch.no_grad():
            self.score.weight.copy_(weight)


class _TokenRows:
    """The LM head's rows of an LMHeadClassifier's tokens, taken from the tensor that holds them
    (lm_head.weight, or the embedding when tied) as the checkpoint streams past."""

    def __init__(self, head: LMHeadClassifier | None, tied: bool) -> None:
        self.head = head
        self.name = "model.embed_tokens.weight" if tied else "lm_head.weight"
        self.rows: torch.Tensor | None = None
        if head is not None and len(head.token_ids) != len(head.tokens):
            raise ModelLoadError("classifier_from_token: the tokens' ids were not looked up (build.py)")

    def take(self, name: str, tensor: torch.Tensor) -> None:
        if self.head is not None and name == self.name:
            ids = torch.tensor(self.head.token_ids, device=tensor.device)
            self.rows = tensor.index_select(0, ids).float()

    def head_weight(self) -> torch.Tensor:
        """[num_labels, hidden] float32: row_true - row_false for a 2-way head, else the rows."""
        assert self.head is not None
        if self.rows is None:
            raise ModelLoadError(
                f"classifier_from_token: the checkpoint has no {self.name} to take the tokens' rows from"
            )
        if self.head.method == "from_2_way_softmax":
            return (self.rows[1] - self.rows[0])[None]
        return self.rows


def _decoder_names(
    weights: Iterable[tuple[str, torch.Tensor]],
    head: list[torch.Tensor] | None = None,
    rows: _TokenRows | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The decoder's tensors, as the decoder names them; a classifier's score.weight goes to `head`, and
    the rows a head made from tokens needs to `rows` (which then ignores any score.weight)."""
    from_tokens = rows is not None and rows.head is not None
    for name, tensor in weights:
        if name.startswith("lm_head."):
            if rows is not None:
                rows.take(name, tensor)
            continue
        if head is not None and name == "score.weight":
            if not from_tokens:
                head.append(tensor)
            continue
        name = name if name.startswith("model.") else "model." + name
        if rows is not None:
            rows.take(name, tensor)
        yield name, tensor
