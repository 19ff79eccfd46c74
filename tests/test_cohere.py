"""Cohere Command R (CohereForCausalLM) and R7B / A (Cohere2ForCausalLM) against transformers on tiny
random checkpoints (tests/dense_family_checks.py): parallel attention + MLP on one bias-free LayerNorm,
interleaved RoPE, logit_scale, tied embeddings (Command R), and Cohere 2's sliding layers with an
unrotated full layer."""

from __future__ import annotations

import pytest

from overnight.errors import ModelLoadError
from overnight.models.layer_spec import layer_specs
from overnight.models.registry import arch_from_hf_config
from tests.dense_family_checks import (
    WINDOW,
    engine_matches_transformers,
    kernels_match_pytorch_path,
    make_checkpoint,
    parameter_count_matches,
)


@pytest.fixture(scope="module", params=["cohere", "cohere2"])
def checkpoint(request, tmp_path_factory):
    return request.param, make_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


def test_engine_matches_transformers(checkpoint):
    variant, folder = checkpoint
    engine_matches_transformers(folder, variant)


def test_parameter_count_matches_transformers(checkpoint):
    variant, folder = checkpoint
    parameter_count_matches(folder, variant)


@pytest.mark.slow  # the Triton interpreter
def test_kernels_match_pytorch_path(tmp_path, monkeypatch):
    kernels_match_pytorch_path(make_checkpoint(tmp_path, "cohere2"), monkeypatch)


_BASE = dict(
    vocab_size=10, hidden_size=8, intermediate_size=8, num_hidden_layers=4, num_attention_heads=2,
    num_key_value_heads=1,
)  # fmt: skip


def test_cohere2_layers_follow_the_pattern():
    arch = arch_from_hf_config({**_BASE, "architectures": ["Cohere2ForCausalLM"], "sliding_window": WINDOW})
    specs = layer_specs(arch)  # transformers' default: every 4th layer full, and that one unrotated
    assert [s.attention.sliding_window for s in specs] == [WINDOW, WINDOW, WINDOW, None]
    assert [s.rope is None for s in specs] == [False, False, False, True]
    assert arch.tie_word_embeddings and arch.logit_scale == 0.0625 and arch.rope_interleaved


def test_command_r_rotates_every_layer():
    specs = layer_specs(arch_from_hf_config({**_BASE, "architectures": ["CohereForCausalLM"]}))
    assert all(s.rope is not None and s.attention.sliding_window is None for s in specs)


def test_qk_norm_is_refused():
    with pytest.raises(ModelLoadError, match="use_qk_norm"):
        arch_from_hf_config({**_BASE, "architectures": ["CohereForCausalLM"], "use_qk_norm": True})
