"""Tensor parallelism for packed integer MoE experts (quant/int_moe.py's IntExperts, parallel/tp_int.py):
each rank holds every expert's share of the intermediate size, its codes, scales and zero points cut as
the float experts' weights are (gate/up rows, down's int32 words and groups), the sums all-reduced.

The GPU's packed layout is kept on the CPU (PACKED_INT_ON_CPU) so the packed experts load and run here:
Qwen3-MoE with experts of 64 (32 a rank: one 32-column group, or two of 16) in AWQ, GPTQ and
compressed-tensors layouts, symmetric and with zero points, grouped and channel-wise.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from overnight import LLM, SamplingParams
from overnight.errors import ModelLoadError
from overnight.loader.model_loader import load_model
from overnight.loader.resolve import resolve_source
from overnight.parallel import workers
from overnight.parallel.tp import apply_tp
from overnight.parallel.tp_int import RowParallelIntExperts, check_int_tp
from overnight.parallel.tp_shards import TPShards
from overnight.quant import apply
from overnight.quant.int_moe import IntExperts
from overnight.quant.int_scheme import IntScheme
from tests.int_checkpoints import make_int_checkpoint
from tests.tp_helpers import generate_split, packed_int_worker_main, streamed_equals_sliced

LAYOUTS = ("awq-g32", "gptq-w4-g32-sym", "ct-w4-channel-asym", "ct-w8-g16-sym")
STACK = "model.layers.0.mlp.experts"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from tests.tiny_models import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("tp-int-experts")
    src = make_tiny_checkpoint(root / "src", "qwen3_moe", moe_intermediate_size=64, num_hidden_layers=2)
    return {name: make_int_checkpoint(src, root / name, name)[0] for name in LAYOUTS}


@pytest.fixture
def packed(monkeypatch):
    monkeypatch.setattr(apply, "PACKED_INT_ON_CPU", True)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_expert_shards_hold_their_share_of_the_weights(folders, layout, packed):
    """Rank r's experts dequantize to exactly rows [gate of r | up of r] and down's columns of r of the
    whole experts' weights, loaded rank by rank (each expert's codes, scales and zeros cut as they
    stream in) or sliced from the whole loaded model, bit for bit the same."""
    source = resolve_source(str(folders[layout]))
    whole = load_model(source, torch.float32, "cpu").get_submodule(STACK)
    assert isinstance(whole, IntExperts)
    gate_up, down = whole.dequantized(torch.float32)
    inter = gate_up.shape[1] // 2
    for rank in range(2):
        mine = streamed_equals_sliced(source, rank).get_submodule(STACK)
        assert isinstance(mine, RowParallelIntExperts) and mine.intermediate_size == inter // 2
        start, n = TPShards(source.arch, rank, 2).section("moe")
        my_gate_up, my_down = mine.dequantized(torch.float32)
        rows = torch.cat([gate_up[:, start : start + n], gate_up[:, inter + start : inter + start + n]], 1)
        assert torch.equal(my_gate_up, rows)
        assert torch.equal(my_down, down[:, :, start : start + n])


@pytest.mark.parametrize("layout", ["awq-g32", "ct-w4-channel-asym"])
def test_packed_expert_shares_through_the_kernel_sum_to_the_whole(folders, layout, packed, monkeypatch):
    """The grouped GEMM kernel (interpreted) on each rank's share, before the all-reduce: the two
    partial sums add up to the whole stack's output (groups of 32, and channel-wise: one group of a
    rank's 32 columns)."""
    from overnight.kernels import dispatch

    monkeypatch.setattr(dispatch, "FORCE_KERNELS", True)
    source = resolve_source(str(folders[layout]))
    model = load_model(source, torch.float32, "cpu")
    whole = model.get_submodule(STACK)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=gen)
    weights, ids = torch.topk(torch.randn(5, 8, generator=gen).softmax(-1), 2)
    parts = []
    for rank in range(2):
        mine = apply_tp(load_model(source, torch.float32, "cpu"), rank, 2).get_submodule(STACK)
        assert isinstance(mine, RowParallelIntExperts)
        parts.append(IntExperts.forward(mine, x, weights, ids.int()))  # the rank's partial sum
    torch.testing.assert_close(parts[0] + parts[1], whole(x, weights, ids.int()), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("layout", ["awq-g32", "ct-w4-channel-asym", "ct-w8-g16-sym"])
def test_packed_expert_dummy_shards_are_the_unsharded_dummy_model(folders, layout, packed):
    """--load-format dummy at TP 2: each rank's packed experts hold the share apply_tp cuts from the
    unsharded dummy model, bit for bit: codes drawn whole and cut, the scale and zero buffers
    loader/dummy.py's constants (a channel-wise down scale whole)."""
    from overnight.loader.dummy import DUMMY_RANGE

    source = resolve_source(str(folders[layout]), "dummy")
    mid = 1 << ((8 if "w8" in layout else 4) - 1)
    for rank in range(2):
        mine = streamed_equals_sliced(source, rank, seed=3).get_submodule(STACK)
        assert isinstance(mine, RowParallelIntExperts) and mine.intermediate_size == 32
        for codes in (mine.gate_up_proj, mine.down_proj):
            assert len(codes.unique()) > codes.numel() // 2  # random int32 words
        for part in ("gate_up_scale", "down_scale", "gate_up_zero", "down_zero"):
            t = getattr(mine, part)
            value = DUMMY_RANGE / mid if part.endswith("scale") else mid
            assert (t is None) == (layout == "ct-w8-g16-sym" and part.endswith("zero")), part
            assert t is None or torch.all(t == torch.tensor(value)), part


def test_expert_share_cuts_scales_and_zeros(folders, packed):
    """The per-expert cuts the checkpoint conversion applies (IntExperts.expert_share): gate/up scale
    rows, down scale groups, a channel-wise down scale kept whole."""
    source = resolve_source(str(folders["awq-g32"]))
    model = apply_tp(load_model(source, torch.float32, "cpu"), 1, 2)
    stack = model.get_submodule(STACK)
    assert isinstance(stack, RowParallelIntExperts)
    t = torch.arange(64 * 2, dtype=torch.float32).view(64, 2)  # gate_proj: 64 rows, 2 groups of 32
    assert torch.equal(stack.expert_share(f"{STACK}.3.gate_proj.group_scale", t), t[32:])
    t = torch.arange(64 * 2, dtype=torch.float32).view(64, 2)  # down_proj: 64 rows, 2 groups of 32
    assert torch.equal(stack.expert_share(f"{STACK}.3.down_proj.group_zero", t), t[:, 1:])
    one = torch.ones(64, 1)  # channel-wise: one group over the whole input, each rank's whole share
    assert stack.expert_share(f"{STACK}.3.down_proj.group_scale", one) is one
    codes = torch.arange(64 * 8, dtype=torch.int32).view(64, 8)  # 64 columns of int4: 8 words
    assert torch.equal(stack.expert_share(f"{STACK}.3.down_proj.weight", codes), codes[:, 4:])


def test_packed_expert_splits_that_are_not_whole_groups_are_refused(folders):
    arch = resolve_source(str(folders["awq-g32"])).arch  # experts of 64
    g32 = IntScheme("awq", bits=4, group_size=32, symmetric=False)
    check_int_tp(g32, arch, 2, packed_experts=True, packed=True)  # 32 a rank: one group
    with pytest.raises(ModelLoadError, match="16 columns of the experts' intermediate size 64, not whole 32"):
        check_int_tp(g32, arch, 4, packed_experts=True, packed=True)
    channel = IntScheme("compressed-tensors", bits=4, group_size=None, symmetric=False)
    with pytest.raises(ModelLoadError, match="24 columns .* multiples of 16 columns"):
        check_int_tp(channel, replace(arch, moe_intermediate_size=48), 2, packed_experts=True, packed=True)
    # experts the kernels do not take (40 is no multiple of 32) stay float, dequantized at load
    check_int_tp(g32, replace(arch, moe_intermediate_size=40), 2, packed_experts=True, packed=True)


@pytest.mark.slow  # starts tensor-parallel processes
def test_packed_experts_tp2_matches_tp1(folders, packed, monkeypatch):
    """Greedy tokens in fp32 over chunked prefills: 2 ranks with packed experts (and packed attention
    and dense layers) against one process with the same packed layout."""
    from tests.parity_helpers import PROMPTS

    monkeypatch.setattr(workers, "_worker_main", packed_int_worker_main)
    options = dict(device="cpu", dtype="float32", skip_tokenizer_init=True, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    folder = str(folders["awq-g32"])
    prompts = PROMPTS[:4]
    one = LLM(folder, **options)
    assert isinstance(one.engine.runner.model.model.layers[0].mlp.experts, IntExperts)  # type: ignore[attr-defined]
    expected = one.generate(prompts, params, use_tqdm=False)
    two = generate_split(folder, prompts, params, **options)
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in expected]
