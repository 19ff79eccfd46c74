"""The gated MLP activation on a fused gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """x: [..., 2 * I] laid out as [gate | up]; returns silu(gate) * up: [..., I]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
