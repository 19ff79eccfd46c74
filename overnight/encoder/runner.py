"""One encoder batch on the device: the prompts packed back to back, the forward pass, then pooling, the
sentence-transformers Dense layers (loader/dense_head.py) and the embedding head (layers/pooler.py), or
a sequence classifier's head and activation, and the results copied to the host in one transfer.

Token types: a BERT cross-encoder's score prompt is [CLS] query [SEP] document [SEP], type 0 up to and
including the first [SEP] and 1 after, exactly as BERT tokenizers mark a pair; the runner rebuilds them
from the first [SEP] of each "score" request (so requests carry nothing beyond their token ids). Every
other prompt is one segment of type 0, as when a tokenizer encodes a single text.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np
import torch

from overnight.config import EngineConfig
from overnight.encoder.batching import EncoderRequest
from overnight.layers.pooler import classifier_head, embedding_head, pool, split_rows
from overnight.loader.dense_head import load_dense_head
from overnight.loader.source import ModelSource
from overnight.models.bert import EncoderBatch


class EncoderModel(Protocol):
    """What the runner needs of an encoder (BERT, XLM-R, ModernBERT, EmbeddingGemma): the hidden states
    [T, hidden] of a packed batch (models/bert.py's EncoderBatch says how it is laid out)."""

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: EncoderBatch,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


@runtime_checkable
class EncoderClassifier(Protocol):
    """A sequence classifier's head: pooled rows [B, H] float32 (as PoolerConfig.pooling_type says) ->
    logits [B, num_labels] float32."""

    def classify(self, pooled: torch.Tensor) -> torch.Tensor: ...


class EncoderRunner:
    def __init__(
        self,
        config: EngineConfig,
        source: ModelSource,
        model: EncoderModel | None = None,
        sep_token_id: int | None = None,
    ) -> None:
        assert config.model.pooler is not None, "an encoder runs for pooling"
        self.pooler = config.model.pooler
        self.device = torch.device(config.runner.device)
        if model is None:
            from overnight.loader.model_loader import load_model

            model = load_model(source, config.model.dtype, self.device, config.model.seed, runner="pooling")
        self.model = model
        self.dense = load_dense_head(self.pooler.dense, self.device)
        # Pairs need token types only where the model has more than one (BERT's, not XLM-R's).
        self.sep_token_id = sep_token_id if source.arch.type_vocab_size > 1 else None

    @torch.inference_mode()
    def run(self, batch: list[EncoderRequest]) -> list[torch.Tensor]:
        """The embedding (or a classifier's scores / probabilities) of each prompt of `batch`, in order
        (float32, on the host)."""
        lens = np.array([r.num_tokens for r in batch], dtype=np.int64)
        qsl = np.zeros(len(batch) + 1, dtype=np.int64)
        np.cumsum(lens, out=qsl[1:])
        ids = np.fromiter((t for r in batch for t in r.token_ids), dtype=np.int64, count=int(qsl[-1]))
        positions = np.arange(qsl[-1]) - np.repeat(qsl[:-1], lens)
        types = None
        if self.sep_token_id is not None and any(r.params.task == "score" for r in batch):
            scored = np.array([r.params.task == "score" for r in batch])
            types = pair_token_types(ids, lens, positions, scored, self.sep_token_id)
        dev = self.device
        hidden = self.model(
            torch.from_numpy(ids).to(dev, non_blocking=True),
            torch.from_numpy(positions).to(dev, non_blocking=True),
            EncoderBatch.build(lens.tolist(), dev),
            None if types is None else torch.from_numpy(types).to(dev, non_blocking=True),
        )
        starts = torch.from_numpy(qsl).to(dev)
        rows = pool(hidden, starts, self.pooler.pooling_type)
        classifier = self.pooler.classifier
        if classifier is not None:
            assert isinstance(self.model, EncoderClassifier)
            logits = self.model.classify(rows)
            active = [r.params.use_activation is not False for r in batch]
            return split_rows(
                classifier_head(logits, classifier.activation, active).cpu(), [None] * len(batch)
            )
        if self.dense is not None:
            rows = self.dense(rows)
        dims = [r.params.dimensions for r in batch]
        norm = [self.pooler.normalize if r.params.normalize is None else r.params.normalize for r in batch]
        return split_rows(embedding_head(rows, dims, norm).cpu(), dims)


def pair_token_types(
    ids: np.ndarray, lens: np.ndarray, positions: np.ndarray, scored: np.ndarray, sep: int
) -> np.ndarray:
    """Token type ids [T] of packed prompts (ids, positions [T]; lens, scored [B]): 1 after the first
    `sep` of each scored prompt (a pair's second text), 0 elsewhere (see the module docstring)."""
    seq_of = np.repeat(np.arange(len(lens)), lens)
    at = np.flatnonzero((ids == sep) & np.repeat(scored, lens))
    seqs, first = np.unique(seq_of[at], return_index=True)  # each scored prompt's first [SEP]
    second = lens.copy()  # where type 1 starts: never, for a prompt without one
    second[seqs] = positions[at[first]] + 1
    return (positions >= second[seq_of]).astype(np.int64)
