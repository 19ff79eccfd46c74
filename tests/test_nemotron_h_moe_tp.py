"""Tensor parallelism of Nemotron 3's MoE blocks (parallel/tp_experts.py's ungated experts, parallel/
tp_mamba2.py's one all-reduce a block), on the CPU.

Fast: each rank's rows of the ungated experts' up stacks, columns of their down stacks, the shared
expert's rows and columns, against index-labelled tensors (stacked and per-expert checkpoint names, FP8
row scales), the router and latent projections whole; the sharded loading both ways (checkpoint and
dummy weights, latent or not) against apply_tp's cut; FP8 experts' scales with their rows; the ranks'
partial sums of a block, after its single all-reduce, equal to the whole block's output (latent too);
every rank's weight bytes as the pre-load estimate counts them; the nemotron-3-nano-30b-a3b preset's
budget at 2, 4 and 8 GPUs equal to what apply_tp leaves a rank; a shared expert's block-scaled
down_proj cut by the shared width.

Slow (2 gloo rank processes): a tiny Nemotron 3 at TP=2 gives one process's tokens and transformers',
fp32 greedy, through chunked prefill and a second wave restored from prefix-cache state snapshots.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from overnight.layers.moe import Experts
from overnight.loader.model_loader import build_model, load_model
from overnight.loader.resolve import resolve_source
from overnight.parallel.tp import apply_tp
from overnight.parallel.tp_experts import RowParallelExperts
from overnight.parallel.tp_load import load_sharded_model
from overnight.parallel.tp_modules import RowParallelLinear
from overnight.parallel.tp_shards import TPShards
from tests.tiny_nemotron_h import make_nemotron_h_moe_checkpoint
from tests.tp_helpers import streamed_equals_sliced

BLOCK = "model.layers.1.mixer"  # MOE_PATTERN "ME*-EM*E": blocks 1, 4 and 7 are MoE blocks
MOE_BLOCKS = (1, 4, 7)
E, INTER, H, SHARED = 8, 16, 32, 24  # tiny_nemotron_h.MOE_CONFIG's experts, their width, hidden, shared width


def _labelled(*shape: int, dim: int) -> torch.Tensor:
    """A float tensor whose every entry is its index along `dim` (plus 1000 x its first index when
    dim is not 0, so a stack's experts differ too)."""
    idx = torch.arange(shape[dim], dtype=torch.float32)
    view = [1] * len(shape)
    view[dim] = shape[dim]
    t = idx.view(view).expand(shape).clone()
    if dim:
        t += 1000 * torch.arange(shape[0], dtype=torch.float32).view(-1, *[1] * (len(shape) - 1))
    return t


def _rows(t: torch.Tensor, dim: int) -> list[int]:
    """The labels left along dim (the first entry of every other dim)."""
    index = [0] * t.dim()
    index[dim] = slice(None)  # type: ignore[call-overload]
    return [int(v) % 1000 for v in t[tuple(index)].tolist()]


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_holds_its_slices_of_experts_shared_expert_and_router(tmp_path, world):
    arch = resolve_source(str(make_nemotron_h_moe_checkpoint(tmp_path))).arch
    assert not arch.experts_gated
    i_share, s_share = INTER // world, SHARED // world
    for rank in range(world):
        s = TPShards(arch, rank, world)
        s.check()
        mine = list(range(rank * i_share, (rank + 1) * i_share))
        # the model's stacks: up rows [E, I, H] (no gate half), down columns [E, H, I]
        up = s.shard(f"{BLOCK}.experts.gate_up_proj", _labelled(E, INTER, H, dim=1))
        assert up.shape == (E, i_share, H) and _rows(up, 1) == mine
        assert torch.equal(up[5, :, 0], 5000 + torch.tensor(mine, dtype=torch.float32))  # expert 5's own
        down = s.shard(f"{BLOCK}.experts.down_proj", _labelled(E, H, INTER, dim=2))
        assert down.shape == (E, H, i_share) and _rows(down, 2) == mine
        # a checkpoint's per-expert tensors, as the published layout names them
        up_e = s.shard(f"{BLOCK}.experts.3.up_proj.weight", _labelled(INTER, H, dim=0))
        assert _rows(up_e, 0) == mine
        down_e = s.shard(f"{BLOCK}.experts.3.down_proj.weight", _labelled(H, INTER, dim=1))
        assert down_e.shape == (H, i_share) and _rows(down_e, 1) == mine
        # FP8 experts' row scales [E, I] go with their rows (apply_tp cuts them as an [E, I, 1] stack)
        scale = s.shard(f"{BLOCK}.experts.gate_up_proj", _labelled(E, INTER, 1, dim=1))
        assert _rows(scale, 1) == mine
        # the shared expert: column-parallel up rows, row-parallel down columns of the shared width
        shared = list(range(rank * s_share, (rank + 1) * s_share))
        assert (
            _rows(s.shard(f"{BLOCK}.shared_experts.up_proj.weight", _labelled(SHARED, H, dim=0)), 0) == shared
        )
        down_s = s.shard(f"{BLOCK}.shared_experts.down_proj.weight", _labelled(H, SHARED, dim=1))
        assert _rows(down_s, 1) == shared
        # replicated: the router (weight and correction bias) and the latent projections
        for name, shape in (
            ("gate.weight", (E, H)),
            ("gate.e_score_correction_bias", (E,)),
            ("fc1_latent_proj.weight", (12, H)),
            ("fc2_latent_proj.weight", (H, 12)),
        ):
            t = torch.randn(shape)
            assert torch.equal(s.shard(f"{BLOCK}.{name}", t), t), name
        local = s.local_arch
        assert (local.moe_intermediate_size, local.shared_expert_intermediate_size) == (i_share, s_share)
        assert local.num_experts == E and local.moe_latent_size == arch.moe_latent_size


def test_shared_expert_block_scales_split_by_the_shared_width(tmp_path):
    """A block-scaled FP8 shared down_proj [H, 64 / 32 columns]: each rank keeps the scale column of its
    32 input columns of the shared expert's width, not of the MLP blocks' intermediate size (24)."""
    arch = resolve_source(str(make_nemotron_h_moe_checkpoint(tmp_path))).arch
    arch = replace(arch, shared_expert_intermediate_size=64)
    scale = _labelled(H, 2, dim=1)
    for rank in range(2):
        got = TPShards(arch, rank, 2).shard(f"{BLOCK}.shared_experts.down_proj.weight_scale", scale)
        assert got.shape == (H, 1) and _rows(got, 1) == [rank]


@pytest.mark.parametrize("latent", [0, 12], ids=["plain", "latent"])
def test_shards_streamed_equal_sliced_and_each_block_reduces_once(tmp_path, latent):
    """Rank by rank, checkpoint tensors sliced as they stream in (and dummy draws replayed whole) give the
    weights apply_tp cuts from the whole model; the experts and the shared down_proj return partial
    sums, which their block all-reduces."""
    folder = make_nemotron_h_moe_checkpoint(tmp_path, moe_latent_size=latent or None)
    for kind in ("auto", "dummy"):
        source = resolve_source(str(folder), kind)
        for rank in range(2):
            model = streamed_equals_sliced(source, rank, seed=3)
    for block in MOE_BLOCKS:
        moe = model.model.layers[block].mixer
        assert isinstance(moe.experts, RowParallelExperts) and not moe.experts.reduces
        assert moe.experts.gate_up_proj.shape == (E, INTER // 2, latent or H)
        assert isinstance(moe.shared_experts.down_proj, RowParallelLinear)
        assert not moe.shared_experts.down_proj.reduces and moe.reduce_output is not None
        if latent:  # replicated
            assert moe.fc1_latent_proj.weight.shape == (latent, H)


def _dequantized(e: Experts) -> tuple[torch.Tensor, torch.Tensor]:
    assert e.gate_up_scale is not None and e.down_scale is not None
    return e.gate_up_proj.float() * e.gate_up_scale[:, :, None], e.down_proj.float() * e.down_scale[
        :, :, None
    ]


def test_fp8_experts_keep_their_row_scales_with_their_rows(tmp_path):
    """FP8 experts: apply_tp on a loaded model takes the up rows with their scales and down's columns with
    its whole rows' scales (the rank's dequantized experts are exactly the whole's slices); the sharded
    loader quantizes each rank's own slices (up rows: the same bytes; down's row scales from the rank's
    columns only, within e4m3's half step of the float values)."""
    folder = make_nemotron_h_moe_checkpoint(tmp_path)
    source = resolve_source(str(folder), quantization="fp8")
    whole = load_model(source, torch.float32, "cpu").model.layers[4].mixer.experts
    floats = load_model(resolve_source(str(folder)), torch.float32, "cpu").model.layers[4].mixer.experts
    up, down = _dequantized(whole)
    for rank in range(2):
        rows = slice(rank * INTER // 2, (rank + 1) * INTER // 2)
        local = apply_tp(load_model(source, torch.float32, "cpu"), rank, 2).model.layers[4].mixer.experts
        got_up, got_down = _dequantized(local)
        assert torch.equal(got_up, up[:, rows]) and torch.equal(got_down, down[:, :, rows])
        streamed = load_sharded_model(source, torch.float32, "cpu", rank, 2).model.layers[4].mixer.experts
        assert streamed.stores_fp8 and streamed.gate_up_scale.shape == (E, INTER // 2)
        s_up, s_down = _dequantized(streamed)
        assert torch.equal(s_up, up[:, rows])  # whole rows: the same quantization
        exact = floats.down_proj[:, :, rows]
        bound = exact.abs() * 2**-4 + streamed.down_scale[:, :, None] * 2**-9
        assert bool(((s_down - exact).abs() <= bound).all())


@pytest.mark.parametrize("latent", [0, 12], ids=["plain", "latent"])
def test_ranks_partial_sums_reduced_once_give_the_whole_block(tmp_path, monkeypatch, latent):
    """Each rank's block, its one all-reduce recorded instead of run: the sum of the two ranks' outputs is
    the whole block's (routed through latent projections or not, plus the shared expert)."""
    folder = make_nemotron_h_moe_checkpoint(tmp_path, moe_latent_size=latent or None)
    source = resolve_source(str(folder))
    whole = load_model(source, torch.float32, "cpu").model.layers[4].mixer
    x = torch.randn(23, H, generator=torch.Generator().manual_seed(1))
    reduced: list[torch.Tensor] = []
    monkeypatch.setattr(dist, "all_reduce", lambda t, group=None: reduced.append(t.clone()))
    for rank in range(2):
        block = apply_tp(load_model(source, torch.float32, "cpu"), rank, 2).model.layers[4].mixer
        with torch.no_grad():
            block(x)
        assert len(reduced) == rank + 1  # one collective a block and step
    with torch.no_grad():
        want = whole(x)
    torch.testing.assert_close(reduced[0] + reduced[1], want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(reduced[0], want, rtol=1e-3, atol=1e-3)  # a partial sum alone is not it


@pytest.mark.parametrize("fp8", [False, True], ids=["float", "fp8"])
def test_each_ranks_weight_bytes_are_what_the_estimate_counts(tmp_path, fp8):
    """What a rank holds once loaded (parameters, and the FP8 experts' row scales) equals the pre-load
    estimate of TPShards.rank_weights_arch: router and latent projections whole, experts and shared
    expert by their shares (latent here, so the replicated latent projections count too)."""
    folder = make_nemotron_h_moe_checkpoint(tmp_path, moe_latent_size=12)
    source = resolve_source(str(folder), quantization="fp8" if fp8 else None)
    for world in (2, 4):
        model = load_sharded_model(source, torch.float32, "cpu", world - 1, world)
        held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
        held += sum(
            s.numel() * 4
            for m in model.modules()
            if isinstance(m, Experts)
            for s in (m.gate_up_scale, m.down_scale)
            if s is not None
        )
        arch = TPShards(source.arch, world - 1, world).rank_weights_arch
        assert held == arch.weight_bytes(4, fp8_linear=fp8, fp8_experts=fp8), world


def test_the_nano_30b_a3b_preset_splits_over_2_4_and_8_gpus():
    """nemotron-3-nano-30b-a3b (128 experts of 1856, a shared one of 3712, 64 Mamba2 heads in 8 groups,
    32 attention heads over 2 KV heads): `overnight budget --tensor-parallel-size N`'s per-GPU weights
    are what apply_tp leaves a rank (a meta model), a little over 1/N of the whole (the vocabulary's
    padding, the replicated routers, norms and, past 2 GPUs, the KV heads), and each GPU's states are
    1/N of a request's."""
    from overnight.options import EngineOptions
    from overnight.tools.budget import GIB, DeviceMemory, plan_budget

    h100 = DeviceMemory("NVIDIA H100", total_bytes=int(79.1 * GIB), free_bytes=int(78.6 * GIB))
    name = "nemotron-3-nano-30b-a3b"
    source = resolve_source(name, load_format="dummy")
    opts = EngineOptions(model=name, load_format="dummy", dtype="bfloat16", max_model_len=32768)
    one = plan_budget(opts, source, h100)
    for tp in (2, 4, 8):
        b = plan_budget(replace(opts, tensor_parallel_size=tp), source, h100)
        model = apply_tp(build_model(source, torch.bfloat16, "meta", runs_on="cpu"), 0, tp)
        held = {id(p): p.numel() * p.element_size() for p in model.parameters()}
        assert b.weights_bytes == sum(held.values()), tp
        assert one.weights_bytes / tp < b.weights_bytes < 1.02 * one.weights_bytes / tp, tp
        assert b.state_bytes_per_seq * tp == one.state_bytes_per_seq
        assert b.seqs_fit > one.seqs_fit
        experts = model.model.layers[1].mixer.experts
        assert experts.gate_up_proj.shape == (128, 1856 // tp, 2688)


@pytest.mark.slow  # starts tensor-parallel processes
def test_tp2_matches_tp1_and_transformers(tmp_path):
    """Token-exact, fp32 greedy: one process, two ranks and transformers, through 16-token prefill
    chunks and a second wave whose shared 41-token prefix is restored from state snapshots."""
    from tests.test_mamba2_tp import ENGINE, VOCAB
    from tests.tp_helpers import check_tp2_two_waves

    check_tp2_two_waves(make_nemotron_h_moe_checkpoint(tmp_path), ENGINE, VOCAB, seed=5)
