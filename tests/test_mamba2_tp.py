"""Tensor parallelism of the Mamba2 hybrids (Granite 4.0-H, Nemotron-H; parallel/tp_mamba2.py), on the CPU.

Fast: each rank's rows of the fused in_proj / conv1d against an index-labelled weight (heads and B/C
groups, groups split, replicated, or shared by neighbouring ranks); the gated norm's statistics summed
over the ranks against the whole norm; the sharded loading of each family both ways (streamed and
sliced, checkpoint and dummy weights); sizes that do not split refused by name before any process starts.

Slow (2 gloo rank processes each): Granite MoE (1 B/C group on both ranks, the norm over the whole
width summed over the ranks, routed experts, RoPE) and Nemotron-H (M / * / - blocks, 2 groups, the norm
per group on its own rank) give the tokens of one process and of transformers, fp32 greedy, through
chunked prefill (16-token steps) and a second wave restored from state snapshots at a shared prefix
(prefix-cache hits); Granite dense (2 groups split) with both ranks on their Triton kernels (the
interpreter) gives transformers' tokens.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from overnight import LLM, SamplingParams
from overnight.errors import ModelLoadError
from overnight.layers.mamba2 import GatedNormShare, mamba_gated_norm_ref, sharded_gated_norm
from overnight.loader.resolve import resolve_source
from overnight.parallel.tp_mamba2 import check_mamba2_quantized_tp
from overnight.parallel.tp_shards import TPShards
from tests.test_engine_parity import hf_greedy
from tests.tiny_granite import make_granite_checkpoint
from tests.tiny_nemotron_h import make_nemotron_h_checkpoint
from tests.tp_helpers import check_tp2_two_waves, generate_split, prefix_waves, streamed_equals_sliced

VOCAB = 101
ENGINE = dict(
    device="cpu", dtype="float32", skip_tokenizer_init=True, block_size=4, max_num_batched_tokens=16,
    max_num_seqs=4, max_model_len=256,
)  # fmt: skip
MAKERS = {
    "granite-dense": lambda d: make_granite_checkpoint(d, "dense"),  # 2 groups, the norm over the width
    "granite-moe": lambda d: make_granite_checkpoint(d, "moe", mamba_n_groups=1),  # 1 group, replicated
    "nemotron-h": make_nemotron_h_checkpoint,  # 2 groups, the norm per group
}


def _arch(tmp_path, model: str, **changes):
    return replace(resolve_source(str(MAKERS[model](tmp_path))).arch, **changes)


def _expected_in_proj_rows(h: int, p: int, g: int, n: int, rank: int, world: int) -> list[int]:
    """in_proj's rows [z | x | B | C | dt] rank `rank` must hold, head by head: the z and x rows and dt
    of its heads, the B and C rows of every group its heads read (head i reads group i // (h / g))."""
    heads = range(rank * h // world, (rank + 1) * h // world)
    groups = sorted({i // (h // g) for i in heads})
    inner, gn = h * p, g * n
    z = [i * p + j for i in heads for j in range(p)]
    x = [inner + r for r in z]
    b = [2 * inner + k * n + j for k in groups for j in range(n)]
    c = [r + gn for r in b]
    dt = [2 * inner + 2 * gn + i for i in heads]
    return z + x + b + c + dt


@pytest.mark.parametrize(("groups", "world"), [(2, 2), (1, 2), (2, 4), (4, 2)])
def test_in_proj_and_conv_rows_follow_heads_and_groups(tmp_path, groups, world):
    """Groups split (world divides them), replicated (1 group) or shared by neighbouring ranks (2 groups,
    4 ranks); the conv takes the same x|B|C rows as in_proj."""
    h, p, n = 8, 4, 3
    arch = _arch(tmp_path, "nemotron-h", mamba_n_heads=h, mamba_d_head=p, mamba_n_groups=groups,
                 mamba_d_state=n, mamba_norm_groups=groups)  # fmt: skip
    rows = 2 * h * p + 2 * groups * n + h
    labelled = torch.arange(rows, dtype=torch.float32)[:, None].expand(rows, 5)
    conv = torch.arange(h * p, rows - h, dtype=torch.float32)[:, None, None].expand(-1, 1, 4)
    for rank in range(world):
        s = TPShards(arch, rank, world)
        s.check()
        want = _expected_in_proj_rows(h, p, groups, n, rank, world)
        got = s.shard("model.layers.1.mixer.in_proj.weight", labelled)
        assert got[:, 0].long().tolist() == want
        got_conv = s.shard("model.layers.1.mixer.conv1d.weight", conv)
        assert got_conv[:, 0, 0].long().tolist() == want[h * p // world : -h // world]
        local = s.local_arch
        (_, conv_dim), ssm = local.linear_state_shapes()
        assert conv_dim == got_conv.shape[0] and ssm == (h // world, p, n)  # the state cache's shapes
        heads = s.shard("model.layers.1.mixer.A_log", torch.arange(h, dtype=torch.float32))
        assert heads.long().tolist() == list(range(rank * h // world, (rank + 1) * h // world))


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize(("world", "norm_groups"), [(2, 1), (4, 2), (4, 1)])
def test_sharded_gated_norm_equals_the_whole(world, norm_groups, kernels, monkeypatch):
    """Each rank's share of a norm slice spanning several ranks: its sums of squares all-reduced (played
    here by two passes) give the whole norm's output, to rounding; on the CPU path and the GPU's
    kernels (kernels/mamba2_gated_norm.py, through the interpreter here)."""
    from overnight.kernels import dispatch

    monkeypatch.setattr(dispatch, "FORCE_KERNELS", kernels)
    torch.manual_seed(0)
    t, width = 5, 48
    y, z, w = torch.randn(t, width), torch.randn(t, width), torch.randn(width)
    whole = mamba_gated_norm_ref(y, z, w, 1e-5, norm_groups)
    share = width // world
    pieces = [(y[:, r * share : (r + 1) * share], z[:, r * share : (r + 1) * share]) for r in range(world)]
    seen: list[torch.Tensor] = []
    for r, (yr, zr) in enumerate(pieces):  # pass 1: what each rank contributes to the all-reduce
        sharded_gated_norm(
            yr, zr, w[:share], 1e-5, GatedNormShare(r, world, world // norm_groups, seen.append)
        )
    total = torch.stack(seen).sum(0)
    for r, (yr, zr) in enumerate(pieces):  # pass 2: every rank sees the sum
        share_r = GatedNormShare(r, world, world // norm_groups, lambda x: x.copy_(total))
        got = sharded_gated_norm(yr, zr, w[r * share : (r + 1) * share], 1e-5, share_r)
        torch.testing.assert_close(got, whole[:, r * share : (r + 1) * share], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("model", list(MAKERS))
def test_shards_streamed_equal_sliced(tmp_path, model):
    """Rank by rank (checkpoint tensors sliced as they stream in, or dummy draws replayed whole), each
    rank holds the weights apply_tp cuts from the whole model, and its mixers their local sizes; the
    gated norm is summed over the ranks only where a norm slice spans them (Granite's whole width)."""
    folder = MAKERS[model](tmp_path)
    for kind in ("auto", "dummy"):
        source = resolve_source(str(folder), kind)
        for rank in range(2):
            streamed = streamed_equals_sliced(source, rank, seed=3)
    layer = streamed.model.layers[0 if model.startswith("granite") else 1]
    mixer = layer.mamba if model.startswith("granite") else layer.mixer
    # 2 groups split, or Granite MoE's 1 replicated: one group a rank either way
    assert (mixer.num_heads, mixer.n_groups) == (2, 1)
    assert mixer.conv_dim == mixer.conv1d.weight.shape[0] == mixer.intermediate_size + 2 * 8
    if model.startswith("granite"):
        assert mixer.norm.share is not None and mixer.norm.share.span == 2
    else:
        assert mixer.norm.share is None and mixer.norm.groups == 1  # its own group, on its own rank


@pytest.mark.parametrize("world", [2, 4, 8])
def test_published_presets_split_their_states(world):
    """granite-4.0-h-small (128 heads x 64, 1 group of 128: replicated) and Nemotron Nano 9B v2 (128
    heads x 80, 8 groups of 128: split; its norm per group stays on one rank) at 2, 4 and 8 ranks: each
    rank's state is its heads' SSM state and its x|B|C conv channels."""
    for preset, d_head, groups in (("granite-4.0-h-small", 64, 1), ("nemotron-nano-9b-v2", 80, 8)):
        arch = resolve_source(preset, load_format="dummy").arch
        s = TPShards(arch, world - 1, world)
        s.check()
        local = s.local_arch
        (_, conv), ssm = local.linear_state_shapes()
        mine = max(1, groups // world)
        assert ssm == (128 // world, d_head, 128)
        assert conv == 128 // world * d_head + 2 * mine * 128
        assert local.mamba_norm_groups == max(1, groups // world)


def test_fp8_shards_take_their_scales_with_their_rows(tmp_path):
    """Online FP8 (Nemotron-H: every mixer and MLP projection): in_proj's per-row scales go with its
    rows, out_proj keeps its per-channel scales whole; streamed and sliced shares agree."""
    from overnight.parallel.tp_modules import RowParallelFp8Linear
    from overnight.quant.linear import Fp8Linear

    folder = make_nemotron_h_checkpoint(tmp_path)
    for rank in range(2):
        model = streamed_equals_sliced(resolve_source(str(folder), quantization="fp8"), rank)
    mixer = model.model.layers[1].mixer
    assert isinstance(mixer.in_proj, Fp8Linear) and isinstance(mixer.out_proj, RowParallelFp8Linear)
    assert mixer.in_proj.weight.shape == (66, 32) and mixer.in_proj.weight_scale.shape == (66,)
    assert mixer.out_proj.weight.shape == (32, 24) and mixer.out_proj.weight_scale.shape == (32,)


def test_sizes_that_do_not_split_are_refused_by_name(tmp_path):
    with pytest.raises(ModelLoadError, match="mamba_n_heads 6"):
        folder = make_nemotron_h_checkpoint(tmp_path, mamba_num_heads=6, n_groups=2)
        LLM(str(folder), tensor_parallel_size=4, **ENGINE)  # refused before any process starts
    arch = _arch(tmp_path / "g", "granite-dense", mamba_n_heads=6, mamba_d_head=8, mamba_n_groups=3)
    with pytest.raises(ModelLoadError, match="mamba_n_groups 3"):
        TPShards(arch, 0, 2).check()
    with pytest.raises(ModelLoadError, match="packed integer Mamba2"):
        check_mamba2_quantized_tp(arch, 2, None, (4, 128, False))
    with pytest.raises(ModelLoadError, match="24 input columns of the Mamba2 out_proj"):
        check_mamba2_quantized_tp(arch, 2, 128, None)
    check_mamba2_quantized_tp(arch, 1, 128, (4, 128, False))  # one rank: nothing to split


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.mark.slow  # starts tensor-parallel processes
@pytest.mark.parametrize("model", ["granite-moe", "nemotron-h"])  # Granite dense: the Triton test below
def test_tp2_matches_tp1_and_transformers(tmp_path, model):
    check_tp2_two_waves(MAKERS[model](tmp_path), ENGINE, VOCAB, seed=5)


def kernels_worker_main(*args: object) -> None:
    """A tensor-parallel rank process on the GPU's path: every layer's Triton kernels (the interpreter
    on the CPU; a spawned process does not see the test's FORCE_KERNELS)."""
    from overnight.kernels import dispatch
    from overnight.parallel import workers

    dispatch.FORCE_KERNELS = True
    workers._worker_main(*args)  # type: ignore[arg-type]


@pytest.mark.slow  # starts tensor-parallel processes; the Triton interpreter
def test_tp2_on_the_triton_path_matches_transformers(tmp_path, monkeypatch):
    """Granite dense at TP=2 with every rank on its kernels: the Mamba2 decode and chunked varlen
    prefill on each rank's heads and group, and the whole-width gated norm's two passes around the
    all-reduce of its statistics."""
    import transformers

    from overnight.parallel import workers

    folder = MAKERS["granite-dense"](tmp_path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    monkeypatch.setattr(workers, "_worker_main", kernels_worker_main)
    prompts = prefix_waves(VOCAB, 5)[0][1:]  # 53 tokens (chunked by 16) and 3
    outs = generate_split(folder, prompts, _greedy(4), **ENGINE)
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_greedy(ref, p, 4)[0] for p in prompts]
