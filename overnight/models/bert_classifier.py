"""Encoder sequence classifiers and cross-encoders: BertForSequenceClassification (ms-marco MiniLM
cross-encoders) and XLMRobertaForSequenceClassification (bge-reranker-v2-m3). Both run the BERT encoder
(models/bert.py) and the same head on the prompt's first token:

    logits = W_out · tanh(W_dense · h[0] + b_dense) + b_out            [num_labels]

BERT names the first layer bert.pooler.dense and the second classifier; XLM-R's
RobertaClassificationHead names them classifier.dense and classifier.out_proj (and the encoder
roberta.*). Attribute names follow BERT's keys; an XLM-R checkpoint's are renamed as they load.

A cross-encoder's prompt is the pair as its tokenizer joins it ([CLS] query [SEP] document [SEP] for
BERT); BERT tells the two texts apart by token type (0 up to the first [SEP], 1 after), which the
runner builds (encoder/runner.py); XLM-R has a single token type.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from overnight.arch import ModelArch
from overnight.models.bert import PACKED_MODULES_MAPPING, BertModel, EncoderBatch
from overnight.models.checkpoint import load_packed_weights

# XLM-R checkpoint names -> the BERT names used here
_XLMR_RENAMES = (
    ("roberta.", "bert."),
    ("classifier.dense.", "bert.pooler.dense."),
    ("classifier.out_proj.", "classifier."),
)
_UNUSED = ("cls.", "lm_head.", "bert.embeddings.position_ids", "bert.embeddings.token_type_ids")


class BertForSequenceClassification(nn.Module):
    packed_modules_mapping = PACKED_MODULES_MAPPING

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        assert arch.num_labels > 0, "a sequence classifier has labels"
        self.arch = arch
        self.checkpoint_kv_scales: dict[int, tuple[float, float]] = {}  # no KV cache: always empty
        self.bert = BertModel(arch)
        self.classifier = nn.Linear(arch.hidden_size, arch.num_labels)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: EncoderBatch,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] of the packed prompts (models/bert.py)."""
        return self.bert(input_ids, positions, batch, token_type_ids)

    def classify(self, first: torch.Tensor) -> torch.Tensor:
        """The logits [B, num_labels] of the prompts whose first tokens' states are `first` [B, H]
        float32 (CLS pooling). The head runs in float32 whatever the model's dtype (it is B rows:
        nothing to save), so scores that rank documents keep fp32's resolution, as the decoder
        classifiers' do (models/for_pooling.py)."""
        pooler = self.bert.pooler
        assert pooler is not None
        dense, out = pooler.dense, self.classifier
        x = torch.tanh(F.linear(first, dense.weight.float(), dense.bias.float()))
        return F.linear(x, out.weight.float(), out.bias.float())

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_packed_weights(self, self._names(weights))

    def _names(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        xlmr = self.arch.position_offset > 0
        for name, tensor in weights:
            if xlmr:
                for old, new in _XLMR_RENAMES:
                    if name.startswith(old):
                        name = new + name[len(old) :]
                        break
            if not name.startswith(_UNUSED):
                yield name, tensor
