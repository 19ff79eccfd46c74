"""Tensor parallelism for packed integer hybrids (Qwen3.5, Qwen3-Next in AWQ): the Gated DeltaNet layers'
packed projections split as the float ones are (parallel/tp_hybrid.py): in_proj_qkv / _z / _qkvz rows
(codes, scales, zeros) of a rank's key-head groups, out_proj's int32 words and groups of its value
heads; Qwen3-Next's packed experts and shared expert by their intermediate sizes.

The GPU's packed layout is kept on the CPU (PACKED_INT_ON_CPU). Sizes: 4 value heads of 16 (out_proj:
32 columns a rank, one 32-column group), hidden 64, experts and shared expert of 64.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from overnight import LLM
from overnight.errors import ModelLoadError
from overnight.loader.model_loader import load_model
from overnight.loader.resolve import resolve_source
from overnight.parallel import workers
from overnight.parallel.tp_int import RowParallelInt8Linear, RowParallelWeightOnlyIntLinear, check_int_tp
from overnight.parallel.tp_shards import TPShards
from overnight.quant import apply
from overnight.quant.int_linear import Int8Linear, WeightOnlyIntLinear
from overnight.quant.int_moe import IntExperts
from overnight.quant.int_scheme import IntScheme
from tests.int_checkpoints import make_int_checkpoint
from tests.tiny_hybrid import make_hybrid_checkpoint
from tests.tiny_vl import make_vl_checkpoint
from tests.tp_helpers import generate_split, packed_int_worker_main, streamed_equals_sliced

SIZES = dict(
    hidden_size=64, num_attention_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, intermediate_size=64
)  # fmt: skip
MOE = dict(moe_intermediate_size=64, shared_expert_intermediate_size=64)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-int-hybrid")
    made = {}
    for variant in ("qwen3_5", "qwen3_next"):
        extra = MOE if variant == "qwen3_next" else {}
        src = make_hybrid_checkpoint(root / "src", variant, **SIZES, **extra)
        made[variant] = make_int_checkpoint(src, root / f"{variant}-awq", "awq-g32")[0]
        if variant == "qwen3_5":
            made["qwen3_5-w8a8"] = make_int_checkpoint(src, root / "qwen3_5-w8a8", "ct-w8a8")[0]
    # the image checkpoint (names under model.language_model, a float vision tower): int8 per channel,
    # as its out_proj's 12 columns a rank are whole words of 4 codes, not whole int4 words
    vl = Path(make_vl_checkpoint(root / "vl", "qwen3_5"))
    made["qwen3_5-vl"] = make_int_checkpoint(vl, root / "qwen3_5-vl-int8", "ct-w8-channel-sym")[0]
    return made


@pytest.fixture
def packed(monkeypatch):
    monkeypatch.setattr(apply, "PACKED_INT_ON_CPU", True)


@pytest.mark.parametrize("variant", ["qwen3_5", "qwen3_next", "qwen3_5-w8a8", "qwen3_5-vl"])
def test_packed_hybrid_shards_hold_their_share_of_the_weights(folders, variant, packed):
    """Every integer layer of rank r (Gated DeltaNet's in_proj_* and out_proj, gated attention, dense
    MLP or shared expert) dequantizes to exactly r's share of the whole layer's weight, loaded rank by
    rank or sliced from the whole model; out_proj is row-parallel (W8A8: the int8 weight's columns,
    every row's scale)."""
    source = resolve_source(str(folders[variant]))
    whole = load_model(source, torch.float32, "cpu")
    kind = Int8Linear if variant.endswith("w8a8") else WeightOnlyIntLinear
    layers = {n: m for n, m in whole.named_modules() if isinstance(m, kind)}
    assert any(n.endswith("linear_attn.out_proj") for n in layers)
    assert any(n.endswith(("in_proj_qkv", "in_proj_qkvz")) for n in layers)
    stacks = [m for m in whole.modules() if isinstance(m, IntExperts)]
    assert len(stacks) == (4 if variant == "qwen3_next" else 0)  # every layer's experts, packed
    for rank in range(2):
        shards = TPShards(source.arch, rank, 2)
        streamed = streamed_equals_sliced(source, rank)
        for name, layer in layers.items():
            mine = streamed.get_submodule(name)
            row = name.endswith(("o_proj", "down_proj", "out_proj"))
            assert isinstance(mine, (RowParallelWeightOnlyIntLinear, RowParallelInt8Linear)) == row, name
            share = shards.shard(f"{name}.weight", layer.dequantized_weight())
            assert torch.equal(mine.dequantized_weight(), share), name


def test_packed_hybrid_out_proj_split_that_is_not_whole_groups_is_refused(folders):
    arch = resolve_source(str(folders["qwen3_5"])).arch
    g32 = IntScheme("awq", bits=4, group_size=32, symmetric=False)
    check_int_tp(g32, arch, 2, packed_experts=False, packed=True)  # 2 value heads of 16 a rank
    narrow = replace(arch, linear_value_head_dim=8)  # 16 columns a rank
    with pytest.raises(ModelLoadError, match="16 input columns of out_proj, not whole 32-column groups"):
        check_int_tp(g32, narrow, 2, packed_experts=False, packed=True)


@pytest.mark.parametrize("variant", ["qwen3_5", "qwen3_next"])
def test_packed_hybrid_tp1_matches_transformers(folders, variant, packed):
    """The baseline the ranks are held to: one process with packed layers gives transformers' greedy
    tokens on the dequantized twin (integer hybrids load; FP8 ones stay refused: test_state_cache.py)."""
    import transformers

    from tests.test_engine_parity import hf_greedy
    from tests.test_tp_models import HYBRID, _greedy, _waves

    twin = folders[variant].parent / f"{folders[variant].name}-deq"
    ref = transformers.AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    first, _ = _waves()
    llm = LLM(str(folders[variant]), **HYBRID)
    assert isinstance(llm.engine.runner.model.model.layers[0].linear_attn.out_proj, WeightOnlyIntLinear)  # type: ignore[attr-defined]
    outs = llm.generate(first, _greedy(6), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_greedy(ref, p, 6)[0] for p in first]


def test_packed_hybrid_image_checkpoint_tp1_matches_transformers(folders, packed):
    """Qwen3.5's image checkpoint in int8: its tensors renamed before the integer conversion looks them
    up (model.language_model.* -> model.*), the vision tower float; a text prompt's greedy tokens equal
    transformers' on the dequantized twin."""
    from transformers import AutoModelForImageTextToText

    from tests.test_tp_models import HYBRID, _greedy
    from tests.tiny_vl import hf_greedy as hf_image_greedy

    folder = folders["qwen3_5-vl"]
    twin = str(folder.parent / f"{folder.name}-deq")
    ref = AutoModelForImageTextToText.from_pretrained(twin, dtype=torch.float32).eval()
    llm = LLM(str(folder), **HYBRID)
    assert isinstance(llm.engine.runner.model.model.layers[0].linear_attn.out_proj, WeightOnlyIntLinear)  # type: ignore[attr-defined]
    prompt = [5, 9, 13, 17, 21, 8, 30, 11]
    out = llm.generate([prompt], _greedy(6), use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == hf_image_greedy(twin, prompt, [], 6, ref)


@pytest.mark.slow  # starts tensor-parallel processes
def test_packed_hybrid_tp2_matches_tp1(folders, packed, monkeypatch):
    """Qwen3-Next in AWQ (packed Gated DeltaNet, attention, experts and shared expert): greedy tokens in
    fp32 over 16-token prefill chunks, 2 ranks against one process with the same packed layout."""
    from tests.test_tp_models import HYBRID, _greedy, _waves

    monkeypatch.setattr(workers, "_worker_main", packed_int_worker_main)
    folder = str(folders["qwen3_next"])
    first, _ = _waves()
    one = LLM(folder, **HYBRID)
    expected = one.generate(first, _greedy(6), use_tqdm=False)
    got = generate_split(folder, first, _greedy(6), **HYBRID)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
