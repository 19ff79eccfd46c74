"""EmbeddingGemma: Gemma 3's text model (Gemma3TextModel) with use_bidirectional_attention, run by the
encoder engine. The blocks, norms, rotary tables and checkpoint names are models/gemma.py's; only the
attention differs: each prompt attends to all of itself in the full layers, and to the tokens within
sliding_window // 2 positions either side in the sliding ones (transformers' bidirectional window:
|i - j| < sliding_window // 2 + 1). There is no KV cache, so the prompts run packed as BERT's do
(models/bert.py). The sentence-transformers modules after the model (mean pooling, the Dense layers,
normalization) are the runner's (encoder/runner.py, loader/pooling_config.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from overnight.arch import ModelArch
from overnight.attention.spec import FULL_ATTENTION, LayerAttention
from overnight.layers.gemma import fold_gemma_norms
from overnight.models.bert import EncoderBatch, encoder_attention
from overnight.models.gemma import GemmaModel, text_weights
from overnight.models.llama import PACKED_MODULES_MAPPING, load_packed_weights


class BidirectionalAttention:
    """The Attend of models/gemma.py over one encoder batch: each layer's window (LayerAttention) is
    read as a band around the query (EncoderBatch.mask)."""

    def __init__(self, batch: EncoderBatch) -> None:
        self.batch = batch

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
    ) -> torch.Tensor:
        # Gemma 3 has neither (gemma_config.py refuses the other families' bidirectional configs).
        assert k is not None and v is not None and sinks is None and layer.logit_softcap is None
        out = encoder_attention(q, k, v, self.batch, scale, layer.sliding_window)
        return out.view(q.shape)


class GemmaEncoderModel(nn.Module):
    """Hidden states [T, hidden] of a packed batch of prompts, after the final norm."""

    packed_modules_mapping = PACKED_MODULES_MAPPING

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        assert arch.is_encoder and not arch.num_labels, "a bidirectional Gemma 3 embedding model"
        self.arch = arch
        self.checkpoint_kv_scales: dict[int, tuple[float, float]] = {}  # no KV cache: always empty
        self.model = GemmaModel(arch)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: EncoderBatch,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """token_type_ids: unused (one segment)."""
        return self.model(input_ids, positions, BidirectionalAttention(batch))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """A Gemma3TextModel checkpoint (sentence-transformers saves its names bare: layers.N.*)."""
        load_packed_weights(self, fold_gemma_norms(text_weights(weights)))
