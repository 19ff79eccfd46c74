"""Linear layers on integer weights, built by quant/apply.py on CUDA (on the CPU these checkpoints are
dequantized at load into plain nn.Linear: quant/int_checkpoint.py). Both are plain modules with
in_features, out_features, bias and forward(x) -> y in x's dtype, so wrappers (LoRA, tensor
parallelism) can treat them like nn.Linear; matmul(x) is the product without the bias.

    WeightOnlyIntLinear   W4A16 / W8A16 (AWQ, GPTQ, compressed-tensors pack-quantized): the weight
                          stays packed, kernels/w4a16_gemm.py dequantizes it inside the GEMM
    Int8Linear            W8A8 (compressed-tensors int-quantized): int8 weight per output channel,
                          activations quantized per token as they come in (kernels/int8_gemm.py)

Parameters are laid out with the output rows first, so the loader fuses q/k/v and gate/up by stacking
rows as it does for float weights. Off CUDA (or with kernels disabled) both run their torch references.
"""

from __future__ import annotations

import torch
from torch import nn

from overnight.kernels.dispatch import use_kernels
from overnight.kernels.int8_quant import quantize_int8_ref


class WeightOnlyIntLinear(nn.Module):
    """y = x @ W^T + bias, W [out, in] held as `bits`-bit codes with a float32 scale and zero point per
    output row and group of `group_size` input columns (int_formats.kernel_layout: the layout). With
    act_order, input_perm [in] is the column order the codes were sorted into (by group), and inputs
    are gathered by it first; it is set by the checkpoint conversion, not loaded as a parameter."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        bits: int,
        group_size: int | None,
        symmetric: bool,
        act_order: bool,
        out_dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if in_features % (32 // bits):
            raise ValueError(f"{in_features} input columns are not a multiple of {32 // bits}")
        self.in_features = in_features
        self.out_features = out_features
        self.bits = bits
        self.group_size = group_size or in_features
        self.out_dtype = out_dtype
        groups = in_features // self.group_size
        self.packed_weight = nn.Parameter(
            torch.empty(out_features, in_features * bits // 32, dtype=torch.int32, device=device),
            requires_grad=False,
        )
        self.group_scale = nn.Parameter(
            torch.empty(out_features, groups, dtype=torch.float32, device=device), requires_grad=False
        )
        self.group_zero = (
            None
            if symmetric
            else nn.Parameter(
                torch.empty(out_features, groups, dtype=torch.float32, device=device), requires_grad=False
            )
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=out_dtype, device=device), requires_grad=False)
            if bias
            else None
        )
        self.mma_order = False  # the packed words' order (use_mma_order_)
        self.input_perm: torch.Tensor | None
        if act_order:
            self.register_buffer("input_perm", torch.empty(in_features, dtype=torch.int64, device=device))
        else:
            self.input_perm = None

    @classmethod
    def replacing(
        cls, linear: nn.Linear, bits: int, group_size: int | None, symmetric: bool, act_order: bool
    ) -> WeightOnlyIntLinear:
        w = linear.weight
        return cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            bits,
            group_size,
            symmetric,
            act_order,
            w.dtype,
            w.device,
        )

    def after_load_(self) -> None:
        """On the GPU, the words in MMA order where they fit (kernels/w4a16_gemm.py's MMA_ORDER)."""
        if not self.packed_weight.is_cuda:
            return
        from overnight.kernels.w4a16_gemm import MMA_ORDER  # triton loads on first use

        if MMA_ORDER:
            self.use_mma_order_()

    def use_mma_order_(self) -> None:
        """The packed words put in MMA order (kernels/w4a16_gemm.py's to_mma_order: a swapped tile's
        unpacked weights are then wgmma's register operand as they stand), where the codes are 4-bit
        and the groups a multiple of 128 columns; the products stay the same."""
        from overnight.kernels.w4a16_gemm import mma_order_fits, to_mma_order

        if self.mma_order or not mma_order_fits(self.bits, self.group_size, self.in_features):
            return
        self.packed_weight.copy_(to_mma_order(self.packed_weight))
        self.mma_order = True

    def dequantized_weight(self) -> torch.Tensor:
        """W [out, in] in the compute dtype, columns in the checkpoint's order."""
        from overnight.kernels.w4a16_gemm import dequantize_int_weight_ref

        w = dequantize_int_weight_ref(
            self.packed_weight, self.group_scale, self.group_zero, self.bits, self.group_size, self.out_dtype,
            self.mma_order,
        )  # fmt: skip
        if self.input_perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.input_perm] = w
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        return y if self.bias is None else y + self.bias

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)
        if self.input_perm is not None:
            rows = rows.index_select(1, self.input_perm)
        args = (self.packed_weight, self.group_scale, self.group_zero, self.bits, self.group_size)
        if use_kernels(rows) and self.group_size % 16 == 0:
            from overnight.kernels.w4a16_gemm import w4a16_linear  # triton loads on first use

            y = w4a16_linear(rows, *args, mma_order=self.mma_order)
        else:
            from overnight.kernels.w4a16_gemm import w4a16_gemm_ref

            y = w4a16_gemm_ref(rows, *args, self.mma_order)
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        zeros = "symmetric" if self.group_zero is None else "zero points"
        order = ", act-order" if self.input_perm is not None else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"int{self.bits} groups of {self.group_size}, {zeros}{order}"
        )


class Int8Linear(nn.Module):
    """y = (xq * sx) @ (W * sw)^T + bias: W int8 [out, in] with weight_scale [out] float32; x quantized
    per token (symmetric int8) on each call. Kernel path: kernels/int8_gemm.int8_linear (an int8 GEMM
    with exact int32 accumulation and both scales applied in float32; at a few rows, the weight-only
    W8A16 product instead); the reference: the W8A8 arithmetic in float32. The per-token quantization
    is not fused into the preceding norm yet (the FP8 path's producers do that): it is a few
    elementwise ops per layer."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        out_dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.out_dtype = out_dtype
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=torch.int8, device=device), requires_grad=False
        )
        self.weight_scale = nn.Parameter(
            torch.empty(out_features, dtype=torch.float32, device=device), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=out_dtype, device=device), requires_grad=False)
            if bias
            else None
        )

    @classmethod
    def replacing(cls, linear: nn.Linear) -> Int8Linear:
        w = linear.weight
        return cls(linear.in_features, linear.out_features, linear.bias is not None, w.dtype, w.device)

    def dequantized_weight(self) -> torch.Tensor:
        return (self.weight.float() * self.weight_scale[:, None]).to(self.out_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        return y if self.bias is None else y + self.bias

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)
        if use_kernels(rows) and self.in_features % 16 == 0 and self.out_features % 8 == 0:
            from overnight.kernels.int8_gemm import int8_linear  # triton loads on first use

            y = int8_linear(rows, self.weight, self.weight_scale)
        else:
            codes, sx = quantize_int8_ref(rows)
            acc = codes.float() @ self.weight.float().t()
            y = (acc * sx * self.weight_scale[None, :]).to(x.dtype)
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            "int8 weights per channel, int8 activations per token"
        )
