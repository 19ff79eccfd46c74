"""Tensor parallelism for stacked experts: each rank keeps every expert's slice of the intermediate
dimension (parallel/tp_shards.py decides which slice; this file cuts the experts' tensors by it).

    gate_up (weights, biases, MXFP4 blocks and scales)  rows [gate | up] -> [gate rows of r | up rows of r]
                                                         ungated (Nemotron 3's relu^2: the up rows alone)
                                                         -> the up rows of r
    down weights                                         columns of r's slice (MXFP4: r's bytes, 2 a byte)
    down MXFP4 scales                                    r's column groups (one scale per 32 columns)
    down bias                                            rank 0 only; zeros elsewhere

Every rank's weighted sum over its experts is a partial sum over the intermediate dimension and the
all-reduce completes it. The down bias is added inside each expert's output (weighted by the router),
so it must enter the sum once: rank 0 keeps it and the other ranks hold zeros, which leaves the sum
exactly that of one rank adding the bias (dividing it by the world size would round).

MXFP4 slices are whole 32-column scale groups of down's input; when the groups do not divide evenly
the last ranks' slices end in zero padding (TPShards.moe_share). Gate and up stay paired: gpt-oss checkpoints interleave
them (gate even rows, up odd), and models/gpt_oss.py de-interleaves them into [gate | up] before
any slicing, so rank r's gate row i and up row i are the same intermediate unit.

Tensors come in two namings: the model's stacked parameters (experts.gate_up_proj [E, 2I, ...],
sliced in dim 1) and a checkpoint's per-expert ones (experts.N.gate_proj.weight, experts.N.gate_up_bias.weight
[2I], ..., sliced in dim 0).

A block whose output is the sum of several row-parallel parts (Nemotron 3's MoE: routed experts plus
a shared expert) reduces once (reduce_once): its parts return their partial sums, and the block
all-reduces their total; the sum of the ranks' totals is the same, one collective instead of two.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from overnight.errors import ModelLoadError
from overnight.layers.moe import Experts

MXFP4_GROUP = 32  # columns per MXFP4 scale
EXPERT_TENSORS = ("gate_up_proj", "down_proj", "gate_up_bias", "down_bias", "gate_up_scales", "down_scales")
# quant/int_moe.py's packed experts' scales and zero points (their codes take the names above)
INT_EXPERT_TENSORS = ("gate_up_scale", "gate_up_zero", "down_scale", "down_zero")
# A checkpoint expert's tensors: its weight (float, or packed codes as quant/int_checkpoint.py
# yields them) and the packed scales and zeros cut for IntExperts.expert_share
PER_EXPERT_PARTS = ("weight", "group_scale", "group_zero")


def shard_expert_tensor(
    section: tuple[int, int],
    whole: int,
    rank: int,
    parts: list[str],
    t: torch.Tensor,
    gated: bool = True,
) -> torch.Tensor | None:
    """Rank `rank`'s slice of one expert tensor named by `parts` (its dotted name, split), given its
    (first unit, units) of the expert intermediate size (TPShards.section("moe")) and that whole
    size, or None when `parts` names no expert tensor this file cuts (FP8 scales: the common rules
    of TPShards.shard). gated: whether a stacked gate_up holds [gate | up] rows (ModelArch.experts_gated;
    else the up rows alone, one per intermediate unit)."""
    if "experts" not in parts or len(parts) < 2:
        return None
    module, kind = parts[-2], parts[-1]
    if module == "experts":  # the stacked parameter: experts.<tensor>
        name, dim = kind, 1
    elif kind in PER_EXPERT_PARTS:  # a checkpoint's experts.N.<tensor>.weight (or packed scales)
        name, dim = module, 0
    else:
        return None
    if name in ("gate_proj", "up_proj") and dim == 0:  # a checkpoint expert's rows
        return _take(t, 0, *section)
    if name not in EXPERT_TENSORS + INT_EXPERT_TENSORS:
        return None
    start, n = section
    if name.startswith("gate_up") and not gated:  # one up row per unit: r's rows, as a checkpoint's
        return _take(t, dim, start, n)
    if name.startswith("gate_up"):
        half = t.shape[dim] // 2
        gate, up = t.split([half, half], dim=dim)
        return torch.cat([_take(gate, dim, start, n), _take(up, dim, start, n)], dim=dim)
    if name == "down_bias":
        return t if rank == 0 else torch.zeros_like(t)
    if name == "down_scale" and t.dim() == 2:  # FP8 row scales [E, H]: down keeps its rows
        return t
    # down's input columns. A stored column holds `per` of them: 1 (float), 2 (MXFP4 bytes), 32 / bits
    # (int32 words), a scale group's width (MXFP4 scales, integer scales and zeros)
    per = whole // t.shape[dim + 1]
    if per > n and t.shape[dim + 1] == 1:
        return t  # one integer group over the whole input (channel-wise): every rank keeps it
    if start % per or n % per:
        raise ModelLoadError(
            f"tensor_parallel_size splits the experts' intermediate size {whole} into shares of {n}, "
            f"which are not whole {per}-column entries of {'.'.join(parts)}; use a smaller one"
        )
    return _take(t, dim + 1, start // per, n // per)


def _take(t: torch.Tensor, dim: int, start: int, n: int) -> torch.Tensor:
    """t's entries start .. start + n along dim, zeros past its end (MXFP4 padding: zero codes, zero
    scales and biases; TPShards.moe_share)."""
    have = max(0, min(n, t.shape[dim] - start))
    part = t.narrow(dim, min(start, t.shape[dim]), have)
    if have == n:
        return part
    shape = list(t.shape)
    shape[dim] = n - have
    return torch.cat([part, t.new_zeros(shape)], dim=dim)


def keep(t: torch.Tensor) -> torch.Tensor:
    """A share to hold as a parameter: its own storage (shard() may return a view of the whole)."""
    return t.clone() if t.device.type != "meta" else t.contiguous()


def reduce_partial(
    y: torch.Tensor, bias: torch.Tensor | None, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """A row-parallel layer's output: every rank's partial product y summed (all-reduced in place),
    then the bias added once (adding it on every rank before the sum would count it world times)."""
    dist.all_reduce(y, group=group)
    return y if bias is None else y + bias


class RowParallelExperts(Experts):
    """Experts holding this rank's slice of every expert's intermediate dimension (biases and MXFP4
    blocks and scales included); the all-reduce completes the weighted sum. Parameter names stay those
    of layers/moe.py's Experts, so checkpoints load into it unchanged; FP8 experts are quantized after
    loading, per rank, from the rank's own rows and columns."""

    def __init__(
        self,
        whole: Experts,
        name: str,
        shard: Callable[[str, torch.Tensor], torch.Tensor],  # TPShards.shard
        group: dist.ProcessGroup | None,
    ) -> None:
        nn.Module.__init__(self)
        self.num_experts = whole.num_experts
        self.activation = whole.activation
        for pname in EXPERT_TENSORS:
            t = getattr(whole, pname)
            sliced = None if t is None else keep(shard(f"{name}.{pname}", t))
            setattr(self, pname, None if sliced is None else nn.Parameter(sliced, requires_grad=False))
        self._init_fp8_state()
        self.compute_dtype = whole.compute_dtype  # experts held as e4m3 while loading keep theirs
        self.pow2_scales = whole.pow2_scales  # and their row scales' rule
        self.group = group
        # False inside a block that reduces once (tp_modules.reduce_once): the partial sum is returned
        # (the down bias is rank 0's alone, so it still enters the block's sum once).
        self.reduces = True

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        y = super().forward(x, topk_weights, topk_ids)
        return reduce_partial(y, None, self.group) if self.reduces else y
