"""What the runner and the loaders use of a model: the contract every model class keeps (they are
nn.Modules too; the type checker sees them through this)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from overnight.arch import ModelArch
from overnight.attention.metadata import AttentionBatch


@runtime_checkable
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


@runtime_checkable
class LoadsWeights(Protocol):
    """What the loaders need of every model class, decoder or encoder."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...


@runtime_checkable
class AfterLoad(Protocol):
    """A module that changes its own layout once its weights are in, for speed, keeping its outputs
    (models/vision/qwen_vit.py's SwiGLU fuses gate and up and pads its width): the loaders call
    after_load_ on every such module of a loaded model (finish_loading)."""

    def after_load_(self) -> None: ...


def finish_loading(model: nn.Module) -> None:
    """after_load_ on each AfterLoad module of `model`, its weights loaded (real or dummy)."""
    for module in list(model.modules()):  # listed first: after_load_ may replace a module's children
        if isinstance(module, AfterLoad):
            module.after_load_()


def as_causal_lm(model: nn.Module) -> CausalLM:
    """`model` held to the CausalLM contract (its members are checked, once, when it is built): raises
    TypeError naming those a model class lacks."""
    if isinstance(model, CausalLM):
        return model
    members = ("arch", "packed_modules_mapping", "checkpoint_kv_scales", "compute_logits", "load_weights")
    missing = [name for name in members if not hasattr(model, name)]
    raise TypeError(
        f"{type(model).__name__} does not implement CausalLM (models/interface.py): no {', '.join(missing)}"
    )
