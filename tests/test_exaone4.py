"""EXAONE 4.0 (Exaone4ForCausalLM) against transformers on tiny random checkpoints
(tests/dense_family_checks.py): the 32B's shape (post-norm blocks, per-head q/k norms, sliding layers
with llama3 RoPE and a full layer without RoPE) and the 1.2B's (no window, RoPE everywhere, tied)."""

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
    preset_has_published_shape,
)


@pytest.fixture(scope="module", params=["exaone4", "exaone4-tied"])
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
    kernels_match_pytorch_path(make_checkpoint(tmp_path, "exaone4"), monkeypatch)


_BASE = dict(
    architectures=["Exaone4ForCausalLM"], vocab_size=10, hidden_size=8, intermediate_size=8,
    num_hidden_layers=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
)  # fmt: skip


def test_published_pattern_string_makes_every_fourth_layer_full_and_unrotated():
    arch = arch_from_hf_config({**_BASE, "sliding_window": WINDOW, "sliding_window_pattern": "LLLG"})
    specs = layer_specs(arch)
    assert [s.attention.sliding_window for s in specs] == [WINDOW, WINDOW, WINDOW, None] * 2
    assert [s.rope is None for s in specs] == [False, False, False, True] * 2
    assert arch.norm_placement == "post" and arch.qk_norm and not arch.qk_norm_whole


def test_without_a_window_every_layer_is_full_and_rotated():
    specs = layer_specs(arch_from_hf_config({**_BASE, "sliding_window": None}))
    assert all(s.attention.sliding_window is None and s.rope is not None for s in specs)


def test_bad_pattern_is_refused():
    with pytest.raises(ModelLoadError, match="sliding_window_pattern"):
        arch_from_hf_config({**_BASE, "sliding_window": WINDOW, "sliding_window_pattern": "LXG"})


def test_preset_has_the_published_shape():
    """LGAI-EXAONE/EXAONE-4.0-32B: 32.0B parameters (30.95B without the embeddings); layers 3, 7, ...
    full and unrotated."""
    model = preset_has_published_shape("exaone-4.0-32b", 64, 40, 8, 128, 27392, 102400, 32_003_216_384)
    assert model.model.layers[3].self_attn.rotary_emb is None
    assert model.model.layers[2].self_attn.rotary_emb is not None


def test_bf16_close_to_transformers(checkpoint):
    from tests.dense_family_checks import bf16_close_to_transformers

    variant, folder = checkpoint
    bf16_close_to_transformers(folder, variant)
