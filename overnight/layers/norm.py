"""RMSNorm, optionally fused with the residual add that precedes it in every decoder layer.

Path choice, shared by the small-op layers (this file, rotary.py, activation.py): use_kernels(x) is true
for CUDA tensors when triton imports, and the layer then runs its fused Triton kernel from
overnight/kernels/; otherwise it runs the PyTorch code here, which is both the CPU path and the kernels'
reference, as kernels/dispatch.py decides (its FORCE_KERNELS flips every layer at once for tests).

fp8_output (RMSNorm, OffsetRMSNorm, SiluAndMul) is set from outside by the quantization pass
(quant/apply.py) when the layer's output is the input of FP8 linear layers only: the layer then returns
a QuantizedActivation (e4m3 data, one scale per token), quantized inside its kernel on the GPU and by
the reference arithmetic of quant/fp8.py on the CPU. OffsetRMSNorm can also hand over both forms
(dense_output), for an output that feeds layers kept in the compute dtype as well.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from overnight.kernels.dispatch import use_kernels
from overnight.quant.fp8 import QuantizedActivation, quantize_activation_ref


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The statistics are taken in fp32 and the result is cast back to the input dtype *before* the
    weight multiply; that order is what the HF reference does, so fp32 outputs match it bit for bit."""
    input_dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    return weight * x.to(input_dtype)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual): the add is done in the activation dtype, as the reference
    does between layers, and its sum becomes the next residual."""
    residual = x + residual
    return rms_norm_ref(residual, weight, eps), residual


# A norm's output: a QuantizedActivation with fp8_output (see the module docstring).
Normed = torch.Tensor | QuantizedActivation


class RMSNorm(nn.Module):
    """weight * x / rms(x), normalising over the last dimension."""

    fp8_output = False  # see the module docstring

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> Normed | tuple[Normed, torch.Tensor]:
        """norm(x); or, with a residual, (norm(x + residual), x + residual). Inputs are not modified."""
        if self.fp8_output:
            return self._forward_fp8(x, residual)
        if use_kernels(x):
            from overnight.kernels.rmsnorm import add_rms_norm, rms_norm  # triton loads on first use

            if residual is None:
                return rms_norm(x, self.weight, self.variance_epsilon)
            return add_rms_norm(x, residual, self.weight, self.variance_epsilon)
        if residual is None:
            return rms_norm_ref(x, self.weight, self.variance_epsilon)
        return add_rms_norm_ref(x, residual, self.weight, self.variance_epsilon)

    def _forward_fp8(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> QuantizedActivation | tuple[QuantizedActivation, torch.Tensor]:
        if use_kernels(x):
            from overnight.kernels.rmsnorm import add_rms_norm_fp8, rms_norm_fp8

            if residual is None:
                return QuantizedActivation(*rms_norm_fp8(x, self.weight, self.variance_epsilon))
            data, scale, residual = add_rms_norm_fp8(x, residual, self.weight, self.variance_epsilon)
            return QuantizedActivation(data, scale), residual
        if residual is None:
            normed = rms_norm_ref(x, self.weight, self.variance_epsilon)
            return QuantizedActivation(*quantize_activation_ref(normed))
        normed, residual = add_rms_norm_ref(x, residual, self.weight, self.variance_epsilon)
        return QuantizedActivation(*quantize_activation_ref(normed)), residual

    def extra_repr(self) -> str:
        fp8 = ", fp8 output" if self.fp8_output else ""
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}{fp8}"


class OffsetRMSNorm(nn.Module):
    """x / rms(x) * (1 + w) in float32, cast back once (weights stored centred on 0: the hybrids of
    models/qwen3_next.py, as HF computes it, so not the folded RMSNorm above, whose arithmetic rounds
    the normalized value before the multiply); with a residual, (norm(x + residual), x + residual), the
    add in x's dtype. The GPU runs kernels/rmsnorm.py's offset form; this code is its reference.

    fp8_output as RMSNorm's; with dense_output too (set by the quantization pass when the output also
    feeds layers kept in the compute dtype) the QuantizedActivation carries the norm's output as
    `dense`, stored by the same kernel pass."""

    fp8_output = False
    dense_output = False

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).type_as(x)

    def _out(self, normed: torch.Tensor) -> Normed:
        if not self.fp8_output:
            return normed
        data, scale = quantize_activation_ref(normed)
        return QuantizedActivation(data, scale, normed if self.dense_output else None)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> Normed | tuple[Normed, torch.Tensor]:
        if use_kernels(x):
            return self._forward_kernel(x, residual)
        if residual is None:
            return self._out(self._norm(x))
        residual = x + residual
        return self._out(self._norm(residual)), residual

    def _forward_kernel(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> Normed | tuple[Normed, torch.Tensor]:
        from overnight.kernels.rmsnorm import offset_rms_norm  # triton loads on first use

        fp8 = self.fp8_output
        out, scale, dense, new_residual = offset_rms_norm(
            x, self.weight, self.eps, residual, fp8_out=fp8, dense_out=self.dense_output
        )
        normed: Normed = out
        if fp8:
            assert scale is not None
            normed = QuantizedActivation(out, scale, dense)
        if new_residual is None:
            return normed
        return normed, new_residual

    def extra_repr(self) -> str:
        fp8 = (", fp8 and dense output" if self.dense_output else ", fp8 output") if self.fp8_output else ""
        return f"{tuple(self.weight.shape)}, eps={self.eps}{fp8}"


def sharded_rms_norm_pair(
    q: torch.Tensor,
    k: torch.Tensor,
    q_norm: RMSNorm,
    k_norm: RMSNorm,
    world: int,
    reduce: Callable[[torch.Tensor], object],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_norm(q), k_norm(k)) when q [T, dq] and k [T, dk] are each one rank's share of a norm that
    spans every rank's share together (OLMo's whole-projection q/k norms under tensor parallelism).

    The per-token sums of squares of both shares go through one `reduce` (an in-place sum over the
    `world` ranks) as a [T, 2] float32 tensor; every rank's share has the same size, so the whole mean
    is the summed squares over `world` times the local size. A k share replicated across a group of
    ranks (fewer kv heads than ranks) is counted once per holder, and so is its size: the mean is exact.
    The arithmetic otherwise follows rms_norm_ref (fp32 statistics, cast back before the weight)."""
    squares = torch.stack([q.float().pow(2).sum(-1), k.float().pow(2).sum(-1)], dim=-1)
    reduce(squares)
    out = []
    for i, (x, norm) in enumerate(((q, q_norm), (k, k_norm))):
        variance = squares[:, i : i + 1] / (world * x.shape[-1])
        normed = x.float() * torch.rsqrt(variance + norm.variance_epsilon)
        out.append(norm.weight * normed.to(x.dtype))
    return out[0], out[1]
