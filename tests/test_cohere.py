"""Cohere Command R / R+ (CohereForCausalLM) and R7B / A (Cohere2ForCausalLM) against transformers on
tiny random checkpoints (tests/dense_family_checks.py): parallel attention + MLP on one bias-free
LayerNorm, interleaved RoPE, logit_scale, tied embeddings, Command R+'s per-head q/k LayerNorms, and
Cohere 2's sliding layers with an unrotated full layer."""

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


@pytest.fixture(scope="module", params=["cohere", "cohere-plus", "cohere2"])
def checkpoint(request, tmp_path_factory):
    return request.param, make_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


def test_engine_matches_transformers(checkpoint):
    variant, folder = checkpoint
    engine_matches_transformers(folder, variant)


def test_parameter_count_matches_transformers(checkpoint):
    variant, folder = checkpoint
    parameter_count_matches(folder, variant)


@pytest.mark.slow  # the Triton interpreter
@pytest.mark.parametrize("variant", ["cohere-plus", "cohere2"])  # R+'s q/k LayerNorms stay out of the
def test_kernels_match_pytorch_path(variant, tmp_path, monkeypatch):  # fused RMSNorm + RoPE kernel
    kernels_match_pytorch_path(make_checkpoint(tmp_path, variant), monkeypatch)


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


def test_qk_norms_are_command_r_plus_only_and_refuse_tensor_parallelism():
    from overnight.parallel.tp_shards import TPShards

    plus = arch_from_hf_config({**_BASE, "architectures": ["CohereForCausalLM"], "use_qk_norm": True})
    assert plus.qk_norm
    with pytest.raises(ModelLoadError, match="Command R\\+'s per-head q/k LayerNorms"):
        TPShards(plus, 0, 2).check()
    # Cohere 2 has no such option: transformers ignores the key, and so do we.
    assert not arch_from_hf_config(
        {**_BASE, "architectures": ["Cohere2ForCausalLM"], "use_qk_norm": True}
    ).qk_norm


def test_preset_has_the_published_shape():
    """CohereLabs/c4ai-command-r7b-12-2024: 8.03B parameters, tied embeddings, logits times 0.25."""
    model = preset_has_published_shape("command-r7b", 32, 32, 8, 128, 14336, 256000, 8_028_033_024)
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.arch.logit_scale == 0.25


@pytest.mark.slow  # two rank processes
def test_tensor_parallel_matches_transformers(tmp_path):
    """TP=2 under the shared rules (parallel/tp_shards.py): each rank holds half the heads and MLP columns; the
    parallel block's two row-parallel outputs are each reduced, the tied head split by vocabulary."""
    from overnight import LLM, SamplingParams
    from tests.dense_family_checks import reference
    from tests.test_families import _hf_greedy

    variant = "cohere2"  # windows, NoPE layers and the tied head
    folder = make_checkpoint(tmp_path, variant)
    prompts = [list(range(5, 5 + n)) for n in (9, 3 * WINDOW + 2)]
    llm = LLM(str(folder), tensor_parallel_size=2, skip_tokenizer_init=True, dtype="float32", device="cpu",
              block_size=4, max_num_batched_tokens=11, max_model_len=64)  # fmt: skip
    try:
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.engine.runner.shutdown()  # type: ignore[attr-defined]
    ref = reference(folder, variant)
    for prompt, out in zip(prompts, outs):
        expected, _ = _hf_greedy(ref, prompt, stepwise=False)
        assert out.outputs[0].token_ids == expected[:8], f"{variant}: prompt of {len(prompt)} tokens"


def test_bf16_close_to_transformers(checkpoint):
    from tests.dense_family_checks import bf16_close_to_transformers

    variant, folder = checkpoint
    bf16_close_to_transformers(folder, variant)
