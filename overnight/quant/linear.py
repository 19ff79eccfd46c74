"""Fp8Linear: a linear layer whose weight is stored in FP8 e4m3 with float32 scales.

It takes what nn.Linear takes, a tensor in the compute dtype, which it quantizes per token itself, or a
QuantizedActivation that the producing kernel (RMSNorm, SiLU-and-mul) already quantized. The output is
in the compute dtype. Paths, chosen like the other layers' (layers/norm.py use_kernels):

    CPU                  fp8_linear_ref: the same quantization, then dequantize and matmul in fp32
    kernels, per channel torch._scaled_mm with row-wise scales (scale_a [M, 1], scale_b [1, N], bf16
                         out) on CUDA when the shapes allow; otherwise the Triton FP8 GEMM
    kernels, blocks      the Triton block-scaled GEMM (kernels/fp8_gemm.py)

Input quantization without a fused producer is kernels/fp8_quant.py. Nothing here syncs with the host
or depends on values: CUDA graphs capture it like any other layer.
"""

from __future__ import annotations

import torch
from torch import nn

from overnight.kernels.dispatch import use_kernels
from overnight.quant.fp8 import (
    FP8_DTYPE,
    QuantizedActivation,
    dequantize_weight,
    fp8_linear_ref,
    quantize_weight,
)

# Per-channel layers on CUDA: "scaled_mm" (torch's cuBLASLt / CUTLASS row-wise FP8 GEMM) or "triton"
# (kernels/fp8_gemm.py). bench/fp8_weights_gpu.py times both on the Qwen3-8B shapes.
PER_CHANNEL_GEMM = "scaled_mm"


class Fp8Linear(nn.Module):
    """y = x @ dequant(weight)^T + bias, weight [out, in] e4m3 with weight_scale [out] (per channel) or
    [out, ceil(in / block_k)] (blocks of block_k input columns per output row)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        out_dtype: torch.dtype,
        block_k: int | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.out_dtype = out_dtype
        self.block_k = block_k
        scale_shape = (out_features,) if block_k is None else (out_features, -(-in_features // block_k))
        # The order weight, weight_scale, bias matters to the dummy init (loader/dummy.py): it draws
        # nn.Linear's weight then bias, and derives the scale from the weight.
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device), requires_grad=False
        )
        self.weight_scale = nn.Parameter(
            torch.empty(scale_shape, dtype=torch.float32, device=device), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=out_dtype, device=device), requires_grad=False)
            if bias
            else None
        )

    @classmethod
    def replacing(cls, linear: nn.Linear, block_k: int | None) -> Fp8Linear:
        """An Fp8Linear of linear's shape, device and dtype; holding linear's weights quantized unless
        linear is shape-only (meta)."""
        w = linear.weight
        layer = cls(
            linear.in_features, linear.out_features, linear.bias is not None, w.dtype, block_k, w.device
        )
        if not w.is_meta:
            with torch.no_grad():
                layer.load_dense_(w)
                if linear.bias is not None and layer.bias is not None:  # both or neither
                    layer.bias.copy_(linear.bias)
        return layer

    @torch.no_grad()
    def load_dense_(self, weight: torch.Tensor) -> None:
        """Quantize a float weight [out, in] into this layer's layout (in place)."""
        data, scale = quantize_weight(weight, self.block_k)
        self.weight.copy_(data)
        self.weight_scale.copy_(scale)

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize_weight(self.weight, self.weight_scale)

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        y = self.matmul(x)
        return y if self.bias is None else y + self.bias

    def matmul(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        """x @ W^T without the bias (tensor parallelism adds it once, after the reduce)."""
        rows: torch.Tensor | QuantizedActivation
        if isinstance(x, QuantizedActivation):
            rows, lead = x, x.data.shape[:-1]
        else:
            lead = x.shape[:-1]
            rows = x.reshape(-1, x.shape[-1])
        data = rows.data if isinstance(rows, QuantizedActivation) else rows
        if not use_kernels(data):
            y = fp8_linear_ref(rows, self.weight, self.weight_scale, None, self.out_dtype)
        else:
            if not isinstance(rows, QuantizedActivation):
                from overnight.kernels.fp8_quant import quantize_fp8  # triton loads on first use

                rows = QuantizedActivation(*quantize_fp8(rows))
            y = self._gemm(rows)
        return y.view(*lead, self.out_features)

    def _gemm(self, qa: QuantizedActivation) -> torch.Tensor:
        if self.block_k is None and _scaled_mm_fits(qa, self.weight, self.out_dtype):
            return scaled_mm_rowwise(qa, self.weight, self.weight_scale)
        from overnight.kernels.fp8_gemm import fp8_gemm

        return fp8_gemm(
            qa.data, qa.scale, self.weight, self.weight_scale, self.out_dtype, group_k=self.block_k or 0
        )

    def extra_repr(self) -> str:
        layout = "per channel" if self.block_k is None else f"blocks of {self.block_k} columns"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, fp8 e4m3 {layout}"
        )


def _scaled_mm_fits(qa: QuantizedActivation, weight: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """torch._scaled_mm's row-wise path: CUDA, bf16 output, K and N multiples of 16, one scale per
    token (not per group)."""
    n, k = weight.shape
    return (
        PER_CHANNEL_GEMM == "scaled_mm"
        and qa.data.is_cuda
        and out_dtype == torch.bfloat16
        and k % 16 == 0
        and n % 16 == 0
        and qa.scale.shape[1] == 1
    )


def scaled_mm_rowwise(
    qa: QuantizedActivation, weight: torch.Tensor, weight_scale: torch.Tensor
) -> torch.Tensor:
    """[M, K] x [N, K] -> [M, N] bf16 through torch._scaled_mm: B must be column-major, which the
    transpose of the row-major [N, K] weight is; scale_a [M, 1] and scale_b [1, N] float32."""
    return torch._scaled_mm(
        qa.data,
        weight.t(),
        scale_a=qa.scale,
        scale_b=weight_scale.view(1, -1),
        out_dtype=torch.bfloat16,
    )
