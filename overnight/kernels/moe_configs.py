"""Tile configurations of the fused MoE GEMMs: tuned per GPU, shape and batch size, stored as data.

moe_configs.json (beside this file, read once) maps

    GPU name -> shape key -> number of tokens -> {"block_m": .., "gemm1": {tiles}, "gemm2": {tiles}}

with shape keys like "E=128,N=768,H=2048,top_k=8,dtype=bfloat16" (N: one rank's expert intermediate
size, H: the hidden size; FP8 experts add ",w=float8_e4m3fn" and fall back to the compute dtype's
entry until tuned themselves) and tiles as GemmTiles' fields. bench/moe_gpu.py measures them and prints
the entries to paste in. A batch takes the entry of the nearest tuned token count (on a log scale); a
GPU or shape never tuned gets default_config(), chosen by the rows each expert gets on average.
block_m is shared by both GEMMs: it is the padding of the one alignment they both read.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from overnight.kernels.moe_gemm import GemmTiles

CONFIG_FILE = os.path.join(os.path.dirname(__file__), "moe_configs.json")
# FP8 experts run W8A8 on a GPU (fused_moe.py): e4m3 x e4m3 dots become Hopper's warpgroup MMA only in
# tiles of 64 rows or more; below that Triton converts both operands to 16 bits first
# (tests/test_kernels_sm90_fit.py reads it in the PTX). Padding a few rows per expert up to 64 costs MMA
# work the memory-bound decode GEMMs have to spare.
W8A8_MIN_BLOCK_M = 64


@dataclass(frozen=True)
class MoeConfig:
    block_m: int
    gemm1: GemmTiles  # gate/up with SiLU-and-mul: x [T, H] -> [P, N]
    gemm2: GemmTiles  # down, times the routing weight: [P, N] -> [P, H]

    def to_json(self) -> dict[str, Any]:
        return {"block_m": self.block_m, "gemm1": asdict(self.gemm1), "gemm2": asdict(self.gemm2)}

    @staticmethod
    def from_json(entry: dict[str, Any]) -> MoeConfig:
        return MoeConfig(entry["block_m"], GemmTiles(**entry["gemm1"]), GemmTiles(**entry["gemm2"]))


def shape_key(
    num_experts: int,
    inter: int,
    hidden: int,
    top_k: int,
    dtype: torch.dtype,
    weight_dtype: torch.dtype | None = None,
) -> str:
    key = f"E={num_experts},N={inter},H={hidden},top_k={top_k},dtype={str(dtype).removeprefix('torch.')}"
    if weight_dtype is not None and weight_dtype != dtype:
        key += f",w={str(weight_dtype).removeprefix('torch.')}"
    return key


@functools.cache
def _table() -> dict[str, dict[str, dict[str, Any]]]:
    if not os.path.isfile(CONFIG_FILE):
        return {}
    with open(CONFIG_FILE) as f:
        return json.load(f)


@functools.cache
def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def default_config(num_tokens: int, top_k: int, num_experts: int) -> MoeConfig:
    """Untuned shapes: tiles sized by the average rows per expert. Few rows: the GEMMs read weights
    (small BLOCK_M, long BLOCK_K); many: they compute (128 x 128 tiles, 8 warps)."""
    rows = num_tokens * top_k / num_experts
    if rows <= 8:
        tiles = GemmTiles(block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=4)
        return MoeConfig(16, tiles, tiles)
    if rows <= 24:
        tiles = GemmTiles(block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=4)
        return MoeConfig(32, tiles, tiles)
    if rows <= 96:
        tiles = GemmTiles(block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=4)
        return MoeConfig(64, tiles, tiles)
    tiles = GemmTiles(block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3)
    return MoeConfig(128, tiles, tiles)


def get_config(
    num_tokens: int,
    num_experts: int,
    inter: int,
    hidden: int,
    top_k: int,
    dtype: torch.dtype,
    device: torch.device,
    weight_dtype: torch.dtype | None = None,
) -> MoeConfig:
    """The tuned entry for this GPU and shape nearest to num_tokens (experts of another weight dtype
    without entries of their own: the compute dtype's), else default_config(). FP8 experts borrowing
    another entry get at least W8A8_MIN_BLOCK_M rows a tile."""
    shapes = _table().get(device_name(device), {})
    own = shapes.get(shape_key(num_experts, inter, hidden, top_k, dtype, weight_dtype))
    if own:
        return _nearest(own, num_tokens)
    entries = shapes.get(shape_key(num_experts, inter, hidden, top_k, dtype))
    config = _nearest(entries, num_tokens) if entries else default_config(num_tokens, top_k, num_experts)
    if weight_dtype == torch.float8_e4m3fn and config.block_m < W8A8_MIN_BLOCK_M:
        config = replace(config, block_m=W8A8_MIN_BLOCK_M)
    return config


def _nearest(entries: dict[str, dict[str, Any]], num_tokens: int) -> MoeConfig:
    target = math.log(max(1, num_tokens))
    nearest = min(entries, key=lambda m: abs(math.log(int(m)) - target))
    return MoeConfig.from_json(entries[nearest])
