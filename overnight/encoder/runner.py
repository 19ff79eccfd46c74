"""One encoder batch on the device: the prompts packed back to back, the forward pass, pooling and the
embedding head (layers/pooler.py), and the vectors copied to the host in one transfer."""

from __future__ import annotations

import numpy as np
import torch

from overnight.config import EngineConfig
from overnight.encoder.batching import EncoderRequest
from overnight.layers.pooler import embedding_head, pool, split_rows
from overnight.loader.source import ModelSource
from overnight.models.bert import BertModel, EncoderBatch


class EncoderRunner:
    def __init__(self, config: EngineConfig, source: ModelSource, model: BertModel | None = None) -> None:
        assert config.model.pooler is not None, "an encoder runs for pooling"
        self.pooler = config.model.pooler
        self.device = torch.device(config.runner.device)
        if model is None:
            from overnight.loader.model_loader import load_model

            loaded = load_model(source, config.model.dtype, self.device, config.model.seed, runner="pooling")
            assert isinstance(loaded, BertModel)
            model = loaded
        self.model = model

    @torch.inference_mode()
    def run(self, batch: list[EncoderRequest]) -> list[torch.Tensor]:
        """The embedding of each prompt of `batch`, in order (float32, on the host)."""
        lens = np.array([r.num_tokens for r in batch], dtype=np.int64)
        qsl = np.zeros(len(batch) + 1, dtype=np.int64)
        np.cumsum(lens, out=qsl[1:])
        ids = np.fromiter((t for r in batch for t in r.token_ids), dtype=np.int64, count=int(qsl[-1]))
        positions = np.arange(qsl[-1]) - np.repeat(qsl[:-1], lens)
        dev = self.device
        hidden = self.model(
            torch.from_numpy(ids).to(dev, non_blocking=True),
            torch.from_numpy(positions).to(dev, non_blocking=True),
            EncoderBatch.build(lens.tolist(), dev),
        )
        rows = pool(hidden, torch.from_numpy(qsl).to(dev), self.pooler.pooling_type)
        dims = [r.params.dimensions for r in batch]
        norm = [self.pooler.normalize if r.params.normalize is None else r.params.normalize for r in batch]
        return split_rows(embedding_head(rows, dims, norm).cpu(), dims)
