"""Gemma's building blocks (models/gemma.py, models/gemma4.py): the GeGLU activation, a norm without a
learned scale, Gemma's (1 + w) norm weights folded for the plain RMSNorm, the rotary tables of its layer
kinds, and the softcap.

Gemma 2/3 normalise with weight (1 + w) where w is the checkpoint's tensor (stored around 0); the
(1 + w) is folded into the weight as it loads (fold_gemma_norms), so the plain RMSNorm and its GPU kernel
serve unchanged. Gemma 4 stores the weight itself (no fold).

Rotary tables (GemmaRotaryEmbedding) keep the rotate-half layout of layers/rotary.py, so its kernel path
serves too; only the frequencies differ:

    f_j = 1 / theta^(2j / D) / factor     for j < proportion * D/2      (Gemma 3's linear scaling: factor)
    f_j = 0                               for the rest                  (Gemma 4's proportional RoPE: those
                                                                         pairs keep cos 1, sin 0)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from overnight.layers.norm import rms_norm_ref
from overnight.layers.rotary import RotaryEmbedding, rotary_ref

# Names of the checkpoint's RMSNorm weights: every module Gemma 2/3 call *norm* or *layernorm*.
_NORM_SUFFIXES = ("norm.weight", "layernorm.weight")


def fold_gemma_norms(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint stream with every RMSNorm weight w replaced by 1 + w, computed in fp32 as the HF
    reference does before it multiplies."""
    for name, tensor in weights:
        if name.endswith(_NORM_SUFFIXES):
            tensor = tensor.float() + 1.0
        yield name, tensor


def gelu_and_mul_ref(x: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate=approximate) * up


class GeluAndMul(nn.Module):
    """x: [..., 2 * I] laid out as [gate | up]; returns gelu(gate) * up (GeGLU). approximate="tanh" is HF's
    gelu_pytorch_tanh (every Gemma checkpoint), "none" the exact gelu. The PyTorch code runs on every
    device (there is no fused kernel yet; it is three elementwise ops, safe in CUDA graphs)."""

    def __init__(self, approximate: str = "tanh") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_and_mul_ref(x, self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate}"


class ScalelessRMSNorm(nn.Module):
    """x / rms(x) with no learned weight (Gemma 4's v_norm and router norm)."""

    def __init__(self, eps: float = 1e-6) -> None:
        super().__init__()
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_ref(x, x.new_ones(()), self.variance_epsilon)


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap), in the order HF computes it; None: x."""
    if cap is None:
        return x
    return torch.tanh(x / cap) * cap


class GemmaRotaryEmbedding(RotaryEmbedding):
    """RotaryEmbedding with Gemma's frequencies (module docstring): `factor` divides them all, and only the
    first `proportion` of the D/2 pairs turn."""

    factor = 1.0
    proportion = 1.0

    def __init__(
        self, head_dim: int, max_position: int, theta: float, factor: float = 1.0, proportion: float = 1.0
    ) -> None:
        if factor <= 0 or not 0 < proportion <= 1:
            raise ValueError(f"RoPE factor must be > 0 and proportion in (0, 1], got {factor}, {proportion}")
        super().__init__(head_dim, max_position, theta)  # a meta model builds no table here
        self.factor, self.proportion = factor, proportion
        if self.cos_sin_cache.device.type != "meta":
            self.reset_table()

    def _table(self, device: torch.device) -> torch.Tensor:
        if device.type == "meta":
            return torch.empty(self.max_position, self.head_dim, dtype=torch.float32, device=device)
        with torch.device("cpu"):
            turning = int(self.proportion * self.head_dim // 2)
            exponents = torch.arange(0, 2 * turning, 2, dtype=torch.int64).float() / self.head_dim
            inv_freq = torch.cat((1.0 / self.theta**exponents, torch.zeros(self.head_dim // 2 - turning)))
            inv_freq = inv_freq / self.factor
            freqs = torch.outer(torch.arange(self.max_position, dtype=torch.float32), inv_freq)
            table = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        return table.to(device)

    def rotate_q(self, positions: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """q alone rotated (a KV-shared layer has no k); the PyTorch path on every device."""
        return rotary_ref(positions, q, q[:, :1], self.cos_sin_cache)[0]

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, theta={self.theta}, factor={self.factor}, proportion={self.proportion}"
        )
