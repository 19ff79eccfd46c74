"""What the tensor-parallel tests share: loading one rank's share both ways and checking they agree."""

from __future__ import annotations

import torch
from torch import nn

from overnight.loader.model_loader import load_model
from overnight.loader.source import ModelSource
from overnight.parallel.tp import apply_tp, load_sharded_model


def streamed_equals_sliced(source: ModelSource, rank: int, world: int = 2, seed: int = 0) -> nn.Module:
    """Rank `rank`'s share loaded rank by rank (load_sharded_model: checkpoint tensors sliced as they
    stream in, or dummy draws replayed whole), once checked to hold the same parameters, bit for bit,
    as apply_tp cuts from the whole loaded model (float32, on the CPU)."""
    sliced = apply_tp(load_model(source, torch.float32, "cpu", seed=seed), rank, world)
    streamed = load_sharded_model(source, torch.float32, "cpu", rank, world, seed=seed)
    a, b = dict(sliced.named_parameters()), dict(streamed.named_parameters())
    assert a.keys() == b.keys()
    for name in a:  # compared as bytes: FP8 and packed integer tensors too
        assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name
    return streamed
