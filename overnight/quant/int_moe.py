"""IntExperts: a stack of MoE experts holding packed integer weights (W4A16 / W8A16), put in place of
layers/moe.py's Experts from outside (quant/apply.py), as the integer linears replace nn.Linear.

Same forward as Experts (x, topk_weights, topk_ids) -> [T, H]; the weights stay packed on the GPU and
are dequantized inside the grouped GEMMs (kernels/w4a16_moe.py), otherwise the torch reference runs.

    gate_up_proj  int32 [E, 2I, H / P]   gate rows then up rows, codes packed along H (int_formats.py)
    down_proj     int32 [E, H, I / P]
    gate_up_scale / _zero  float32 [E, 2I, H / G1];  down_scale / _zero  float32 [E, H, I / G2]

The packed projections are parameters under Experts' own names, so the loader stacks a checkpoint's
per-expert tensors into them as it stacks float ones (quant/int_checkpoint.py yields each expert's
packed codes as `experts.N.gate_proj.weight`); scales and zeros are buffers the checkpoint conversion
writes directly (cut to a tensor-parallel rank's share by expert_share), rows placed as the loader
places the codes'. Act-order checkpoints are not packed here (each expert would need its own input
permutation): their experts load dequantized.

On the GPU, after loading, the words may be put in MMA order (after_load_; kernels/w4a16_moe.py's
MMA_ORDER): both projections or neither, where the codes are 4-bit and every group a multiple of 128
columns. The products and dequantized weights stay the same.
"""

from __future__ import annotations

import torch
from torch import nn

from overnight.kernels.dispatch import use_kernels

Packed = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]  # codes, scales, zeros


class IntExperts(nn.Module):
    gate_up_scale: torch.Tensor
    down_scale: torch.Tensor

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        bits: int,
        group_size: int | None,
        symmetric: bool,
        dense_type: type[nn.Module],
        compute_dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        per = 32 // bits
        if hidden_size % per or intermediate_size % per:
            raise ValueError(f"expert sizes {hidden_size}, {intermediate_size} are not multiples of {per}")
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.bits = bits
        self.group_size = group_size  # None: one group per row (channel-wise)
        self.groups = (group_size or hidden_size, group_size or intermediate_size)
        self.dense_type = dense_type  # layers/moe.py's Experts, rebuilt for comparisons (dequantize_model)
        self.compute_dtype = compute_dtype
        e, h, i = num_experts, hidden_size, intermediate_size
        kw = {"dtype": torch.int32, "device": device}
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h // per, **kw), requires_grad=False)  # type: ignore[arg-type]
        self.down_proj = nn.Parameter(torch.empty(e, h, i // per, **kw), requires_grad=False)  # type: ignore[arg-type]
        g1, g2 = h // self.groups[0], i // self.groups[1]
        f32 = {"dtype": torch.float32, "device": device}
        self.register_buffer("gate_up_scale", torch.empty(e, 2 * i, g1, **f32))  # type: ignore[arg-type]
        self.register_buffer("down_scale", torch.empty(e, h, g2, **f32))  # type: ignore[arg-type]
        self.gate_up_zero: torch.Tensor | None
        self.down_zero: torch.Tensor | None
        if symmetric:
            self.gate_up_zero = self.down_zero = None
        else:
            self.register_buffer("gate_up_zero", torch.empty(e, 2 * i, g1, **f32))  # type: ignore[arg-type]
            self.register_buffer("down_zero", torch.empty(e, h, g2, **f32))  # type: ignore[arg-type]
        self.mma_order = False  # the packed words' order (use_mma_order_)

    @classmethod
    def replacing(cls, experts: nn.Module, bits: int, group_size: int | None, symmetric: bool) -> IntExperts:
        w = experts.get_parameter("gate_up_proj")
        e, two_i, h = w.shape
        return cls(e, h, two_i // 2, bits, group_size, symmetric, type(experts), w.dtype, w.device)

    def expert_share(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """The part this stack holds of one checkpoint expert's scales or zeros, `name` being
        `<stack>.N.<projection>.group_scale` / `.group_zero` ([rows, groups] of the whole projection):
        all of it here; a tensor-parallel stack (parallel/tp_int.py) keeps its rows or groups."""
        return t

    def after_load_(self) -> None:
        """On the GPU, the words in MMA order where they fit (kernels/w4a16_moe.py's MMA_ORDER)."""
        if not self.gate_up_proj.is_cuda:
            return
        from overnight.kernels.w4a16_moe import KERNEL, MMA_ORDER  # triton loads on first use

        if MMA_ORDER and KERNEL == "v2":  # the first version ("v1") reads column order only
            self.use_mma_order_()

    def use_mma_order_(self) -> None:
        """Both projections' words put in MMA order (kernels/w4a16_moe.py's experts_to_mma_order),
        where both fit: 4-bit codes, groups a multiple of 128 columns (a tensor-parallel share of the
        intermediate size may not)."""
        from overnight.kernels.w4a16_gemm import mma_order_fits
        from overnight.kernels.w4a16_moe import experts_to_mma_order

        fits = mma_order_fits(self.bits, self.groups[0], self.hidden_size) and mma_order_fits(
            self.bits, self.groups[1], self.intermediate_size
        )
        if self.mma_order or not fits:
            return
        for proj in (self.gate_up_proj, self.down_proj):
            proj.copy_(experts_to_mma_order(proj))
        self.mma_order = True

    def _weights(self) -> tuple[Packed, Packed]:
        gate_up = (self.gate_up_proj, self.gate_up_scale, self.gate_up_zero)
        down = (self.down_proj, self.down_scale, self.down_zero)
        return gate_up, down

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        gate_up, down = self._weights()
        if use_kernels(x) and all(g % 16 == 0 for g in self.groups):
            from overnight.kernels.w4a16_moe import w4a16_fused_experts  # triton loads on first use

            return w4a16_fused_experts(
                x, gate_up, down, self.bits, self.groups, topk_weights, topk_ids, mma_order=self.mma_order
            )
        from overnight.kernels.w4a16_moe import w4a16_fused_experts_ref

        return w4a16_fused_experts_ref(
            x, gate_up, down, self.bits, self.groups, topk_weights, topk_ids, self.mma_order
        )

    def dequantized(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [E, 2I, H], down [E, H, I]) in dtype."""
        from overnight.kernels.w4a16_moe import dequantize_experts_ref

        gate_up, down = self._weights()
        return (
            dequantize_experts_ref(*gate_up, self.bits, self.groups[0], dtype, self.mma_order),
            dequantize_experts_ref(*down, self.bits, self.groups[1], dtype, self.mma_order),
        )

    def extra_repr(self) -> str:
        zeros = "symmetric" if self.gate_up_zero is None else "zero points"
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
            f"intermediate_size={self.intermediate_size}, int{self.bits} groups of {self.groups}, {zeros}"
        )
