"""Tensor parallelism for integer checkpoints (quant/int_linear.py's packed layers on the GPU).

On the CPU (and on a GPU under int_weights dense: IntScheme.dense) these checkpoints are dequantized
while they stream in, so their tensors shard like float ones. Packed on the GPU, the layers keep their
codes packed along the input dimension (32 / bits codes per int32, consecutive columns) with one scale
(and zero point) per output row and group of group_size input columns:

    column-parallel (q/k/v, gate/up)  packed_weight, group_scale, group_zero: this rank's rows, like a
                                      float weight's; an act-order input_perm stays whole (the input is)
    row-parallel (o, down)            packed_weight: this rank's int32 columns; group_scale / group_zero:
                                      its groups (a channel-wise scale, one group, stays whole); the
                                      share must be whole groups and whole int32 words
    W8A8 (Int8Linear)                 int8 weight like a float one; the per-row scale with its rows
                                      (column-parallel) or whole (row-parallel); each rank quantizes its
                                      own share of the input per token
    packed experts (IntExperts)       every expert's share of the intermediate size, as float experts
                                      (tp_experts.py): gate/up codes, scales, zeros their rows; down's
                                      codes their int32 words, scales and zeros their groups (channel-wise:
                                      whole); the share must be whole groups (channel-wise: of 16 columns,
                                      the grouped GEMM's step). The conversion writes each expert's scales
                                      into the stack itself: RowParallelIntExperts.expert_share cuts them

A hybrid's Gated DeltaNet projections follow parallel/tp_hybrid.py's rows and columns: in_proj_* as
column-parallel layers, out_proj as a row-parallel one (its share: the columns of a rank's value heads).

Not exact, so refused by name: a row-parallel layer with act-order columns (g_idx) on the GPU (a
rank's input columns belong to groups spread over the whole input, which the packed layout cannot
hold as whole groups).
(Act-order and W8A8 experts are not packed: they load dequantized, under the float rules.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from overnight.arch import ModelArch
from overnight.errors import ModelLoadError
from overnight.parallel.tp_experts import keep, reduce_partial
from overnight.quant.apply import packs_experts
from overnight.quant.int_linear import Int8Linear, WeightOnlyIntLinear
from overnight.quant.int_moe import IntExperts
from overnight.quant.int_scheme import IntScheme

INT_PACKED_PARTS = ("packed_weight", "group_scale", "group_zero")


def check_int_tp(scheme: IntScheme, arch: ModelArch, world: int, packed_experts: bool, packed: bool) -> None:
    """Raise ModelLoadError for an integer checkpoint these tensor-parallel shares cannot hold exactly,
    before any process starts. packed: the device keeps packed layers (quant/apply.py);
    packed_experts: and packed experts."""
    if world == 1 or not packed:
        return  # dequantized at load: float rules
    what = scheme.describe()
    if (
        packed_experts
        and arch.num_experts
        and packs_experts(scheme, arch.hidden_size, arch.moe_intermediate_size)
    ):
        n = arch.moe_intermediate_size // world
        # channel-wise: each rank's one group is its whole share, which the grouped GEMM takes in 16s
        unit = scheme.group_size or 16
        if n % unit:
            kind = f"{unit}-column groups" if scheme.group_size else "multiples of 16 columns (channel-wise)"
            raise ModelLoadError(
                f"tensor_parallel_size {world} gives each rank {n} columns of the experts' intermediate "
                f"size {arch.moe_intermediate_size}, not whole {kind} of {what}; use a smaller "
                "tensor_parallel_size"
            )
    if scheme.act_order and not scheme.int8_activations:
        raise ModelLoadError(
            f"{what}: act-order (g_idx) columns cannot be split exactly for the row-parallel o_proj / "
            "down_proj (their groups span every rank's columns); run with --tensor-parallel-size 1"
        )
    per_word = 32 // scheme.bits
    unit = max(scheme.group_size or 1, per_word)
    shares = {
        "o_proj": arch.q_size // world,
        "down_proj": arch.intermediate_size // world,
        "shared_expert.down_proj": arch.shared_expert_intermediate_size // world,
        # a hybrid's Gated DeltaNet out_proj: the columns of a rank's value heads (parallel/tp_hybrid.py)
        "out_proj": arch.linear_num_value_heads // world * arch.linear_value_head_dim
        if arch.num_linear_layers
        else 0,
    }
    for module, n in shares.items():
        if n and n % unit:
            raise ModelLoadError(
                f"tensor_parallel_size {world} gives each rank {n} input columns of {module}, not whole "
                f"{unit}-column groups of {what}; use a smaller tensor_parallel_size"
            )


def int_row_columns(module: str, kind: str, t: torch.Tensor, start: int, n: int, world: int) -> torch.Tensor:
    """A row-parallel packed layer's part for the input columns start .. start + n of n * world."""
    whole = n * world
    per = whole // t.shape[1]  # input columns per stored column: codes per word, or a group's width
    if per > whole // world or start % per or n % per:
        if kind == "packed_weight" or t.shape[1] > 1:
            raise ModelLoadError(
                f"tensor_parallel_size {world} splits the input of {module} ({whole} columns) into shares "
                f"of {n}, which are not whole {per}-column {kind} entries; use a smaller tensor_parallel_size"
            )
        return t  # one group over the whole input (channel-wise): every rank keeps the scale
    return t.narrow(1, start // per, n // per)


class RowParallelWeightOnlyIntLinear(WeightOnlyIntLinear):
    """A packed W4A16 / W8A16 layer holding this rank's input columns; partial products all-reduced,
    then the bias added once."""

    def __init__(
        self,
        layer: WeightOnlyIntLinear,
        name: str,
        shard: Callable[[str, torch.Tensor], torch.Tensor],  # TPShards.shard
        group: dist.ProcessGroup | None,
    ) -> None:
        if layer.input_perm is not None:
            raise ModelLoadError(
                f"{name}: act-order (g_idx) columns cannot be split for a row-parallel layer exactly"
            )
        weight = shard(f"{name}.packed_weight", layer.packed_weight)
        in_features = weight.shape[1] * 32 // layer.bits
        channel = layer.group_size == layer.in_features
        super().__init__(
            in_features, layer.out_features, False, layer.bits, None if channel else layer.group_size,
            layer.group_zero is None, False, layer.out_dtype, device=weight.device,
        )  # fmt: skip
        for part in INT_PACKED_PARTS:
            t = getattr(layer, part)
            if t is not None:
                setattr(self, part, nn.Parameter(keep(shard(f"{name}.{part}", t)), requires_grad=False))
        self.bias = layer.bias
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_partial(self.matmul(x), self.bias, self.group)


class RowParallelInt8Linear(Int8Linear):
    """A W8A8 layer holding this rank's input columns (every row's scale); all-reduced, bias once."""

    def __init__(
        self,
        layer: Int8Linear,
        name: str,
        shard: Callable[[str, torch.Tensor], torch.Tensor],
        group: dist.ProcessGroup | None,
    ) -> None:
        weight = keep(shard(f"{name}.weight", layer.weight))
        super().__init__(weight.shape[1], layer.out_features, False, layer.out_dtype, device=weight.device)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = layer.weight_scale
        self.bias = layer.bias
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_partial(self.matmul(x), self.bias, self.group)


class RowParallelIntExperts(IntExperts):
    """Packed integer experts (quant/int_moe.py) holding this rank's share of every expert's
    intermediate size, by the float experts' rules (parallel/tp_experts.py): gate/up codes, scales and
    zeros take their rows, down's codes their int32 words and its scales and zeros their groups (a
    channel-wise scale stays whole: one group per rank, its share). The weighted sums are partial over
    the intermediate size and the all-reduce completes them.

    The checkpoint conversion writes each expert's scales and zeros whole-sized into the stack
    (quant/int_checkpoint.py): expert_share cuts them by the same rules first."""

    def __init__(
        self,
        whole: IntExperts,
        name: str,
        shard: Callable[[str, torch.Tensor], torch.Tensor],  # TPShards.shard
        group: dist.ProcessGroup | None,
    ) -> None:
        gate_up = keep(shard(f"{name}.gate_up_proj", whole.gate_up_proj))
        super().__init__(
            whole.num_experts, whole.hidden_size, gate_up.shape[1] // 2, whole.bits, whole.group_size,
            whole.gate_up_zero is None, whole.dense_type, whole.compute_dtype, device=gate_up.device,
        )  # fmt: skip
        for part in ("gate_up_proj", "down_proj", "gate_up_scale", "down_scale", "gate_up_zero", "down_zero"):
            t = getattr(whole, part)
            if t is None:
                continue
            mine = gate_up if part == "gate_up_proj" else keep(shard(f"{name}.{part}", t))
            if mine.shape != getattr(self, part).shape:
                raise ModelLoadError(
                    f"{name}.{part}: a share of {list(mine.shape)}, but the rank's experts hold "
                    f"{list(getattr(self, part).shape)}"
                )
            setattr(self, part, nn.Parameter(mine, requires_grad=False) if part.endswith("proj") else mine)
        self._shard = shard
        self.group = group

    def expert_share(self, name: str, t: torch.Tensor) -> torch.Tensor:
        return self._shard(name, t)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return reduce_partial(super().forward(x, topk_weights, topk_ids), None, self.group)
