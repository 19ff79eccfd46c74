"""Apertus (ApertusForCausalLM) against transformers on a tiny random checkpoint
(tests/dense_family_checks.py): per-head q/k norms, llama3 RoPE, the ungated xIELU MLP with its learned
alpha_p / alpha_n, and the checkpoint's own norm names; xIELU itself against transformers' module."""

from __future__ import annotations

import pytest
import torch

from overnight.errors import ModelLoadError
from overnight.layers.xielu import XIELU
from overnight.models.apertus import ApertusForCausalLM
from overnight.models.registry import arch_from_hf_config
from tests.dense_family_checks import (
    engine_matches_transformers,
    make_checkpoint,
    parameter_count_matches,
    preset_has_published_shape,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("apertus"), "apertus")


def test_engine_matches_transformers(checkpoint):
    engine_matches_transformers(checkpoint, "apertus")


def test_parameter_count_matches_transformers(checkpoint):
    parameter_count_matches(checkpoint, "apertus")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_xielu_matches_transformers(dtype):
    from transformers.activations import XIELUActivation

    theirs = XIELUActivation(dtype=dtype)
    ours = XIELU().to(dtype)
    with torch.no_grad():
        theirs.alpha_p.fill_(0.3)
        theirs.alpha_n.fill_(-1.2)
        ours.alpha_p.fill_(0.3)
        ours.alpha_n.fill_(-1.2)
    x = torch.cat([torch.linspace(-12, 6, 301), torch.tensor([0.0, -1e-7, 1e-7])]).to(dtype)
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0)


def test_checkpoint_constants_are_checked():
    good = [("model.layers.0.mlp.act_fn.beta", torch.tensor(0.5, dtype=torch.bfloat16))]
    assert list(ApertusForCausalLM.rename_checkpoint(good)) == []
    bad = [("model.layers.0.mlp.act_fn.beta", torch.tensor(0.7))]
    with pytest.raises(ModelLoadError, match="beta"):
        list(ApertusForCausalLM.rename_checkpoint(bad))


def test_norm_names_are_renamed():
    names = ["model.layers.3.attention_layernorm.weight", "model.layers.3.feedforward_layernorm.weight"]
    renamed = [n for n, _ in ApertusForCausalLM.rename_checkpoint((n, torch.ones(1)) for n in names)]
    assert renamed == [
        "model.layers.3.input_layernorm.weight",
        "model.layers.3.post_attention_layernorm.weight",
    ]


def test_other_activations_are_refused():
    cfg = dict(
        architectures=["ApertusForCausalLM"], vocab_size=10, hidden_size=8, intermediate_size=8,
        num_hidden_layers=1, num_attention_heads=2, hidden_act="silu",
    )  # fmt: skip
    with pytest.raises(ModelLoadError, match="hidden_act 'silu' for Apertus"):
        arch_from_hf_config(cfg)


def test_preset_has_the_published_shape():
    """swiss-ai/Apertus-8B-Instruct-2509: 8.05B parameters, no gate projection."""
    model = preset_has_published_shape("apertus-8b", 32, 32, 8, 128, 21504, 131072, 8_053_338_176)
    assert not hasattr(model.model.layers[0].mlp, "gate_up_proj")


def test_tensor_parallelism_is_refused_by_name(checkpoint):
    from overnight.loader.resolve import resolve_source
    from overnight.parallel.tp_shards import TPShards

    with pytest.raises(ModelLoadError, match="not supported yet for Apertus"):
        TPShards(resolve_source(str(checkpoint)).arch, 0, 2).check()


@pytest.mark.slow  # the Triton interpreter
def test_kernels_match_pytorch_path(tmp_path, monkeypatch):
    from tests.dense_family_checks import kernels_match_pytorch_path

    kernels_match_pytorch_path(make_checkpoint(tmp_path, "apertus"), monkeypatch)


def test_bf16_close_to_transformers(checkpoint):
    from tests.dense_family_checks import bf16_close_to_transformers

    bf16_close_to_transformers(checkpoint, "apertus")
