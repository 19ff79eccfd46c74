"""The gated MLP activation on a fused gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from overnight.layers.norm import use_kernels


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """x: [..., 2 * I] laid out as [gate | up]; returns silu(gate) * up: [..., I].

    Triton kernel when use_kernels(x) (see norm.py), else the PyTorch reference above."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_kernels(x):
            from overnight.kernels.activation import silu_and_mul  # triton loads on first use

            return silu_and_mul(x)
        return silu_and_mul_ref(x)
