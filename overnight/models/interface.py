"""What the runner and the loaders use of a model: the contract every model class keeps (they are
nn.Modules too; the type checker sees them through this)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

from overnight.attention.metadata import AttentionBatch
from overnight.config import ModelArch


class CausalLM(Protocol):
    arch: ModelArch
    # checkpoint projection name -> (fused parameter's module name, shard id inside it)
    packed_modules_mapping: dict[str, tuple[str, str | int]]
    # FP8 checkpoints' per-layer KV-cache scales, {layer: (k_scale, v_scale)}; empty when none
    checkpoint_kv_scales: dict[int, tuple[float, float]]

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBatch
    ) -> torch.Tensor:
        """Hidden states [T, hidden] of the flattened batch."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...
