"""Tensor parallelism for the hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): parallel/tp_shards.py's rules for
what a plain decoder lacks.

Each rank holds linear_num_key_heads / world key heads of every Gated DeltaNet layer and the value
heads grouped under them (value head h reads key head h // r, so contiguous key heads carry
contiguous value heads and the grouped ratio r stays whole):

    in_proj_qkv, conv1d  rows [q | k | v]  -> [q of r's key heads | k of them | v of r's value heads]
    in_proj_z            rows of r's value heads (dv each); in_proj_b, in_proj_a, dt_bias, A_log: one each
    in_proj_qkvz, _ba    rows grouped by key head (Qwen3-Next): r's whole key-head groups
    out_proj             columns of r's value heads; all-reduced                              row-parallel
    gated q_proj         rows [q | gate] per head: r's heads, 2 * head_dim rows each
    shared expert        gate/up rows and down columns of r's slice of shared_expert_intermediate_size
                         (TPShards' "shared" section; its down_proj is row-parallel like any other)
    shared_expert_gate   replicated (one output; it scales the reduced shared expert)
    vision tower         (the image checkpoints: visual.*) replicated

Packed integer checkpoints (parallel/tp_int.py) follow the same rows: a column-parallel projection's
codes, scales and zeros are rows like a float weight's (in_proj_qkvz's key-head groups included), and
out_proj's codes split in int32 words and its scales and zeros in groups, so a rank's value-head
columns must be whole groups (check_int_tp). An act-order out_proj is refused, as o_proj is.

FP8 layers (quant/linear.py) follow the float rows too: a column-parallel projection's per-row (or
per-row-and-block) scales are rows like its weight's; out_proj keeps its per-channel scales whole and
takes the column blocks of block scales, which must then be whole blocks of a rank's value heads. The
b / a projections, router and shared-expert gate stay in the compute dtype under FP8.

A rank's state cache holds the states of its own heads (the runner sizes it from local_arch); the
slots and snapshots are the same on every rank, as the scheduling is shared.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from overnight.arch import ModelArch
from overnight.errors import ModelLoadError
from overnight.models.gated_deltanet import GatedDeltaNet
from overnight.parallel.tp_experts import keep
from overnight.parallel.tp_int import INT_PACKED_PARTS, int_row_columns
from overnight.quant.fp8 import columns_per_scale

# A hybrid's column-parallel projections, kept under their checkpoint names (not fused on load):
# apply_tp slices them like the fused ones. in_proj_*: its Gated DeltaNet layers, whose out_proj is
# row-parallel. (Only hybrids: vision towers use some of these names for layers that stay whole.)
COLUMN_PARALLEL = (
    "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj",
    "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "in_proj_qkvz", "in_proj_ba",
)  # fmt: skip
# The Qwen3.5 image checkpoints' vision tower (models/qwen3_5_vl.py): replicated, not sharded (a small
# share of the weights; every rank computes the same image embeddings).
VISION_TOWER = "visual"
# Per-value-head parameters of a Gated DeltaNet layer (one entry per head).
LINEAR_HEAD_PARAMS = ("dt_bias", "A_log")

Section = Callable[[str], tuple[int, int]]  # TPShards.section


def shard_hybrid_tensor(
    arch: ModelArch, rank: int, world: int, section: Section, module: str, kind: str, t: torch.Tensor
) -> torch.Tensor | None:
    """Rank `rank`'s share of a hybrid's tensor that shards otherwise than a plain decoder's (None: the
    common rules of TPShards.shard). `section` gives (first row, rows) of "q", "linear_k" (key heads
    x dk), "linear_v" (value heads x dv) and "linear_heads" (value heads)."""

    def rows(x: torch.Tensor, name: str) -> torch.Tensor:
        return x.narrow(0, *section(name))

    a = arch
    if module == "q_proj":  # gated attention: [q | gate] per head, 2 * head_dim rows each
        start, n = section("q")
        return t.narrow(0, 2 * start, 2 * n)
    if module in ("in_proj_qkv", "conv1d"):  # channels q | k | v
        key = a.linear_num_key_heads * a.linear_key_head_dim
        q, k, v = t.split([key, key, t.shape[0] - 2 * key])
        return torch.cat([rows(q, "linear_k"), rows(k, "linear_k"), rows(v, "linear_v")])
    if module == "out_proj" and kind in INT_PACKED_PARTS:  # packed: int32 words and groups (tp_int.py)
        return int_row_columns(module, kind, t, *section("linear_v"), world)
    if module == "out_proj" and kind == "weight":
        return t.narrow(1, *section("linear_v"))
    if module == "out_proj" and kind == "weight_scale" and t.dim() == 2:  # FP8 blocks of columns
        return _column_blocks(a, world, t, *section("linear_v"))
    if module == "out_proj":  # a per-row scale (W8A8, FP8 per channel): whole (its outputs are whole rows)
        return t
    if module == "in_proj_z":
        return rows(t, "linear_v")
    if module in ("in_proj_b", "in_proj_a") or kind in LINEAR_HEAD_PARAMS:
        return rows(t, "linear_heads")
    if module in ("in_proj_qkvz", "in_proj_ba"):  # rows grouped by key head: whole groups per rank
        per_group = t.shape[0] // a.linear_num_key_heads
        heads = a.linear_num_key_heads // world
        return t.narrow(0, rank * heads * per_group, heads * per_group)
    return None


def _column_blocks(a: ModelArch, world: int, scale: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """A rank's columns of out_proj's FP8 block scales [N, KB]: its value heads' columns must be whole
    blocks (else refused by name)."""
    whole = a.linear_num_value_heads * a.linear_value_head_dim
    block = columns_per_scale(whole, scale.shape[1])
    if start % block or n % block:
        raise ModelLoadError(
            f"tensor_parallel_size {world} splits the input of out_proj ({whole} columns) into shares of "
            f"{n}, which are not whole {block}-column FP8 weight-scale blocks; use a smaller "
            "tensor_parallel_size"
        )
    return scale.narrow(1, start // block, n // block)


def shard_gated_deltanet(
    module: GatedDeltaNet, name: str, shard: Callable[[str, torch.Tensor], torch.Tensor], local: ModelArch
) -> None:
    """Keep this rank's heads of a Gated DeltaNet layer's own parameters (the projections are sliced
    with the other column- and row-parallel linears) and its head counts (local: TPShards.local_arch)."""
    conv = module.conv1d
    conv.weight = nn.Parameter(keep(shard(f"{name}.conv1d.weight", conv.weight)), requires_grad=False)
    conv.in_channels = conv.out_channels = conv.groups = conv.weight.shape[0]
    for pname in LINEAR_HEAD_PARAMS:
        sliced = keep(shard(f"{name}.{pname}", getattr(module, pname)))
        setattr(module, pname, nn.Parameter(sliced, requires_grad=False))
    module.num_k_heads, module.num_v_heads = local.linear_num_key_heads, local.linear_num_value_heads
    module.key_dim = module.num_k_heads * module.head_k_dim
    module.value_dim = module.num_v_heads * module.head_v_dim
    module.conv_dim = 2 * module.key_dim + module.value_dim
