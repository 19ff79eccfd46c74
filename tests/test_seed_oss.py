"""Seed-OSS (SeedOssForCausalLM): Llama's blocks with a q/k/v bias and o_proj's own bias flag
(attention_out_bias), against transformers on a tiny random checkpoint (tests/dense_family_checks.py)."""

from __future__ import annotations

import pytest

from overnight.models.registry import arch_from_hf_config
from tests.dense_family_checks import (
    engine_matches_transformers,
    make_checkpoint,
    parameter_count_matches,
    preset_has_published_shape,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("seed_oss"), "seed_oss")


def test_engine_matches_transformers(checkpoint):
    engine_matches_transformers(checkpoint, "seed_oss")


def test_parameter_count_matches_transformers(checkpoint):
    parameter_count_matches(checkpoint, "seed_oss")


def test_bias_flags_are_read_apart():
    base = dict(
        architectures=["SeedOssForCausalLM"], vocab_size=10, hidden_size=8, intermediate_size=8,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
    )  # fmt: skip
    default = arch_from_hf_config(base)  # transformers' defaults: q/k/v bias, none on o_proj
    assert default.attention_bias and not default.o_proj_bias
    swapped = arch_from_hf_config({**base, "attention_bias": False, "attention_out_bias": True})
    assert not swapped.attention_bias and swapped.o_proj_bias


def test_preset_has_the_published_shape():
    """ByteDance-Seed/Seed-OSS-36B-Instruct: 36.15B parameters."""
    model = preset_has_published_shape("seed-oss-36b", 64, 80, 8, 128, 27648, 155136, 36_151_104_512)
    attn = model.model.layers[0].self_attn
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None


def test_bf16_close_to_transformers(checkpoint):
    from tests.dense_family_checks import bf16_close_to_transformers

    bf16_close_to_transformers(checkpoint, "seed_oss")
