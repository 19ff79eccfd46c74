"""Tensor parallelism for the Mamba2 hybrids (Granite 4.0-H, Nemotron-H): parallel/tp_shards.py's rules for
their mixers and MLPs. Heads split across ranks; B / C groups follow the heads that read them.

How rank r of `world` holds one mixer of H heads (P values each), G groups of B / C (N = d_state each):

    in_proj   rows [z (H P) | x (H P) | B (G N) | C (G N) | dt (H)]                    column-parallel
              -> [z of r's heads | x of them | B of r's groups | C of them | dt of r's heads]
    conv1d    weight and bias rows [x | B | C], the same as in_proj's x|B|C rows
    A_log, D, dt_bias   r's heads
    norm      (the gated RMSNorm) the weight rows of r's heads
    out_proj  columns of r's heads; partial outputs all-reduced, bias added once        row-parallel

Head h reads group h // (H / G) and r's heads are contiguous, so r's heads read whole groups of their
own when world divides G (G / world of them), and one group, shared with the world / G ranks beside r,
when G divides world (G = 1, Granite's published checkpoints: every rank holds the one group). Other G
are refused. A rank's state cache holds its heads' SSM states and its x|B|C conv channels
(TPShards.local_arch sizes it); the slots and snapshots are the same on every rank.

The gated norm normalizes mamba_norm_groups equal slices of the width (1: the whole width, Granite;
G: Nemotron-H). When world divides them each rank normalizes its own slices (no communication);
otherwise each norm slice spans `world / mamba_norm_groups` ranks, and their per-token sums of squares are
all-reduced (layers/mamba2.py GatedNormShare), so the statistics are those of the whole slice.

The MLPs: Granite's shared_mlp (input_linear rows [gate | up], output_linear's columns: the "ffn" share
of intermediate_size) and Nemotron-H's MLP blocks (up_proj rows, down_proj columns; tp.py's common
rules); Granite's routed experts and router as every MoE's (parallel/tp_experts.py). Nemotron-H's
input embedding is `embeddings` (vocab-parallel, as embed_tokens).

Nemotron 3's MoE blocks ("E", models/nemotron_h_mlp.py):

    gate (router weight, e_score_correction_bias)   replicated: every rank routes every token alike
    experts.gate_up_proj [E, I, H]  (up rows alone)  each expert's up rows of r's slice of I
    experts.down_proj    [E, H, I]                   each expert's columns of r's slice
    shared_experts.up_proj / down_proj               rows / columns of r's slice of the shared size
    fc1_latent_proj, fc2_latent_proj (latent, H <-> L)  replicated

The block reduces once (tp_modules.reduce_once): the experts and the shared expert's down_proj return
their partial sums, and routed + shared is all-reduced as one [tokens, H] tensor. Latent blocks stay
exact so: every rank computes fc1(x) whole (its experts need all L inputs), its experts' partial sum
at width L, and fc2 of it, a partial sum at width H because fc2 is linear. Splitting the latent
projections instead would need a second collective (an all-gather of fc1's rows, or a reduce at L);
they are 2 H L weights a block, small beside the experts' 2 E I L.

FP8 layers follow the float rows: in_proj's per-row (and per-row block) scales are rows like its weight's;
out_proj keeps per-channel scales whole and takes the column blocks of block scales, which must be whole
blocks of a rank's heads. Packed integer layers are refused under tensor parallelism for now.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from overnight.arch import ModelArch
from overnight.errors import ModelLoadError
from overnight.layers.mamba2 import GatedNormShare
from overnight.models.mamba2_mixer import Mamba2Mixer
from overnight.models.nemotron_h_mlp import NemotronHMoE
from overnight.parallel.tp_experts import keep
from overnight.parallel.tp_int import INT_PACKED_PARTS
from overnight.parallel.tp_modules import reduce_once
from overnight.quant.fp8 import columns_per_scale

# The column- and row-parallel linears of a Mamba2 hybrid beyond a plain decoder's (apply_tp slices them).
COLUMN_PARALLEL = ("in_proj", "input_linear", "up_proj")
ROW_PARALLEL = ("out_proj", "output_linear")
# A mixer's per-head parameters (one entry per head).
HEAD_PARAMS = ("A_log", "D", "dt_bias")
# The mixer's module name in each family's checkpoint: Granite's layers.N.mamba, Nemotron-H's layers.N.mixer.
MIXER_NAMES = ("mamba", "mixer")


def mamba2_problems(a: ModelArch, world: int) -> list[str]:
    """The Mamba2 sizes `world` ranks cannot split, by name (empty: it can)."""
    problems = []
    if a.mamba_n_heads % world:
        problems.append(f"mamba_n_heads {a.mamba_n_heads} (Mamba2 heads)")
    g = a.mamba_n_groups
    if g % world and world % g:
        problems.append(
            f"mamba_n_groups {g} (Mamba2 B/C groups: tensor_parallel_size must divide them or be a "
            "multiple of them)"
        )
    return problems


def local_mamba2_arch(a: ModelArch, world: int) -> ModelArch:
    """a with one rank's Mamba2 sizes: its heads, the groups it holds, its norm slices (1 when a slice
    spans several ranks: GatedNormShare)."""
    g, norm = a.mamba_n_groups, a.mamba_norm_groups
    return replace(
        a,
        mamba_n_heads=a.mamba_n_heads // world,
        mamba_n_groups=g // world if g % world == 0 else 1,
        mamba_norm_groups=norm // world if norm % world == 0 else 1,
    )


def _sections(a: ModelArch, rank: int, world: int) -> dict[str, tuple[int, int, int]]:
    """section -> (whole rows, first row of rank, rows of rank) for in_proj's sections."""
    inner, gn = a.mamba_intermediate, a.mamba_n_groups * a.mamba_d_state
    heads = a.mamba_n_heads // world
    g = a.mamba_n_groups
    # world | G: G / world whole groups each; G | world: the one group rank r's heads read
    group = rank * (g // world) if g % world == 0 else rank * g // world
    groups = max(1, g // world)
    n = a.mamba_d_state
    return {
        "heads_p": (inner, rank * heads * a.mamba_d_head, heads * a.mamba_d_head),
        "groups": (gn, group * n, groups * n),
        "heads": (a.mamba_n_heads, rank * heads, heads),
    }


def shard_mamba2_tensor(
    a: ModelArch, rank: int, world: int, ffn: tuple[int, int], parts: list[str], t: torch.Tensor
) -> torch.Tensor | None:
    """Rank `rank`'s share of a Mamba2 hybrid's tensor that shards otherwise than a plain decoder's
    (None: TPShards.shard's common rules). ffn: (first row, rows) of the rank's share of
    intermediate_size (Granite's shared MLP)."""
    module, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", parts[-1])
    s = _sections(a, rank, world)
    mixer = len(parts) >= 3 and parts[-3] in MIXER_NAMES
    if module == "in_proj" and kind in INT_PACKED_PARTS or module == "out_proj" and kind in INT_PACKED_PARTS:
        raise ModelLoadError(
            "packed integer Mamba2 projections cannot be split by tensor parallelism yet; use "
            "tensor_parallel_size 1"
        )
    if module == "in_proj":  # weight, bias, FP8 scales: rows
        order = ("heads_p", "heads_p", "groups", "groups", "heads")
        return _cat_rows(t, [s[k] for k in order], "in_proj")
    if module == "conv1d":  # weight [C, 1, K], bias [C]: the x|B|C channels
        return _cat_rows(t, [s["heads_p"], s["groups"], s["groups"]], "conv1d")
    if kind in HEAD_PARAMS and module in MIXER_NAMES:
        return _cat_rows(t, [s["heads"]], kind)
    if module == "norm" and mixer:  # the gated norm's weight: one per channel of the mixer's width
        return _cat_rows(t, [s["heads_p"]], "norm")
    if module == "out_proj":
        whole, start, n = s["heads_p"]
        if kind == "weight":
            return t.narrow(1, start, n)
        if kind == "weight_scale" and t.dim() == 2:  # FP8 block scales [N, KB]: whole column blocks
            block = columns_per_scale(whole, t.shape[1])
            if start % block or n % block:
                raise ModelLoadError(
                    f"tensor_parallel_size {world} splits the input of the Mamba2 out_proj ({whole} "
                    f"columns) into shares of {n}, not whole {block}-column FP8 weight-scale blocks; use "
                    "a smaller tensor_parallel_size"
                )
            return t.narrow(1, start // block, n // block)
        return t  # a bias or per-channel scale: whole (its outputs are whole rows)
    if module == "input_linear" and "shared_mlp" in parts:  # rows [gate | up]
        gate, up = t.split([t.shape[0] // 2] * 2)
        return torch.cat([gate.narrow(0, *ffn), up.narrow(0, *ffn)])
    if module == "output_linear" and "shared_mlp" in parts:
        return t.narrow(1, *ffn) if kind == "weight" else t
    return None


def _cat_rows(t: torch.Tensor, sections: list[tuple[int, int, int]], what: str) -> torch.Tensor:
    """t's rows cut into the sections' whole sizes, each narrowed to the rank's rows, concatenated."""
    wholes = [whole for whole, _, _ in sections]
    if t.shape[0] != sum(wholes):
        raise ModelLoadError(
            f"the Mamba2 {what} tensor has {t.shape[0]} rows, not the {sum(wholes)} its config gives"
        )
    pieces = t.split(wholes)
    return torch.cat([p.narrow(0, start, n) for p, (_, start, n) in zip(pieces, sections, strict=True)])


def shard_mamba2_mixer(
    module: Mamba2Mixer,
    name: str,
    shard: Callable[[str, torch.Tensor], torch.Tensor],  # TPShards.shard
    local: ModelArch,
    rank: int,
    world: int,
    group: dist.ProcessGroup | None,
) -> None:
    """Keep this rank's share of a mixer's own parameters (in_proj and out_proj are sliced with the
    other column- and row-parallel linears) and its sizes (local: TPShards.local_arch), and set up its
    gated norm: its own slices, or a share of slices that span several ranks (GatedNormShare)."""
    conv = module.conv1d
    conv.weight = nn.Parameter(keep(shard(f"{name}.conv1d.weight", conv.weight)), requires_grad=False)
    if conv.bias is not None:
        conv.bias = nn.Parameter(keep(shard(f"{name}.conv1d.bias", conv.bias)), requires_grad=False)
    conv.in_channels = conv.out_channels = conv.groups = conv.weight.shape[0]
    for pname in HEAD_PARAMS:
        sliced = keep(shard(f"{name}.{pname}", getattr(module, pname)))
        setattr(module, pname, nn.Parameter(sliced, requires_grad=False))
    module.num_heads, module.n_groups = local.mamba_n_heads, local.mamba_n_groups
    module.intermediate_size = local.mamba_intermediate
    module.conv_dim = module.intermediate_size + 2 * module.n_groups * module.d_state
    norm = module.norm
    if norm is None:  # no gated norm (Falcon-H1's mamba_rms_norm False): y * silu(z) is per channel
        return
    norm.weight = nn.Parameter(keep(shard(f"{name}.norm.weight", norm.weight)), requires_grad=False)
    whole_groups = norm.groups
    norm.groups = local.mamba_norm_groups
    if whole_groups % world:  # each norm slice spans world / whole_groups ranks
        norm.share = GatedNormShare(rank, world, world // whole_groups, partial(dist.all_reduce, group=group))


def check_mamba2_quantized_tp(
    arch: ModelArch, world: int, block_k: int | None, int_linear: tuple[int, int, bool] | None
) -> None:
    """Refuses, before any process starts, quantized Mamba2 projections tensor parallelism cannot split:
    packed integer layers (int_linear: loader/fit.py's answer; None: dequantized, float rules), and
    FP8 block scales (block_k) that do not come in whole blocks of a rank's out_proj columns."""
    if world == 1 or not arch.is_mamba2:
        return
    if int_linear is not None:
        raise ModelLoadError(
            "packed integer Mamba2 hybrids cannot be split by tensor parallelism yet; use "
            "tensor_parallel_size 1"
        )
    n = arch.mamba_intermediate // world
    if block_k and n % block_k:
        raise ModelLoadError(
            f"tensor_parallel_size {world} gives each rank {n} input columns of the Mamba2 out_proj, not "
            f"whole {block_k}-column FP8 weight-scale blocks; use a smaller tensor_parallel_size"
        )


def reduce_moe_blocks_once(model: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Nemotron 3's MoE blocks, once apply_tp has made their experts and shared down_proj row-parallel:
    one all-reduce a block, of routed + shared."""
    for module in model.modules():
        if isinstance(module, NemotronHMoE):
            reduce_once(module, ("experts", "shared_experts.down_proj"), group)
