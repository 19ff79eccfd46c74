"""The gated MLP activation on a fused gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from overnight.kernels.dispatch import use_kernels
from overnight.quant.fp8 import QuantizedActivation, quantize_activation_ref


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """x: [..., 2 * I] laid out as [gate | up]; returns silu(gate) * up: [..., I].

    Triton kernel when use_kernels(x) (see norm.py), else the PyTorch reference above. With fp8_output
    (set by the quantization pass, see norm.py) the result is a QuantizedActivation."""

    fp8_output = False

    def forward(self, x: torch.Tensor) -> torch.Tensor | QuantizedActivation:
        if self.fp8_output:
            if use_kernels(x):
                from overnight.kernels.activation import silu_and_mul_fp8

                return QuantizedActivation(*silu_and_mul_fp8(x))
            return QuantizedActivation(*quantize_activation_ref(silu_and_mul_ref(x)))
        if use_kernels(x):
            from overnight.kernels.activation import silu_and_mul  # triton loads on first use

            return silu_and_mul(x)
        return silu_and_mul_ref(x)

    def extra_repr(self) -> str:
        return "fp8 output" if self.fp8_output else ""
