"""bench/dummy_routing_cpu.py: the two dummy draws it compares are the ones it names (vLLM's: one seed
for every tensor, so same-shaped tensors are equal, norms drawn like the rest; ours: a seed a tensor,
norms 1), and its check runs end to end on a small model."""

from __future__ import annotations

import argparse

import torch

from bench import dummy_routing_cpu as dr


def _tiny():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
        tie_word_embeddings=False,
    )  # fmt: skip
    return Qwen3MoeForCausalLM(cfg)


def test_vllms_draw_repeats_values_across_same_shaped_tensors_and_draws_norms():
    model = _tiny()
    dr.draw(model, "vllm")
    params = dict(model.named_parameters())
    assert torch.equal(params["model.embed_tokens.weight"], params["lm_head.weight"])
    assert torch.equal(params["model.layers.0.mlp.gate.weight"], params["model.layers.1.mlp.gate.weight"])
    norm = params["model.layers.0.input_layernorm.weight"]
    assert norm.abs().max() <= dr.DUMMY_RANGE and norm.std() > 0


def test_our_draw_gives_each_tensor_its_own_values_and_norms_one():
    model = _tiny()
    dr.draw(model, "overnight")
    params = dict(model.named_parameters())
    assert not torch.equal(params["model.embed_tokens.weight"], params["lm_head.weight"])
    assert not torch.equal(params["model.layers.0.mlp.gate.weight"], params["model.layers.1.mlp.gate.weight"])
    assert bool((params["model.norm.weight"] == 1).all())
    others = [p for n, p in params.items() if not n.endswith("norm.weight")]
    assert all(p.abs().max() <= dr.DUMMY_RANGE for p in others)


def test_the_check_runs_end_to_end():
    args = argparse.Namespace(vocab=512, hidden=128, layers=2, requests=4, tokens=5)
    out = dr.spread(args, "vllm")
    assert out["embedding_is_lm_head"] is True
    assert set(out["distinct_tokens"]) == {0, 1, 2, 4}
    assert all(1 <= n <= 4 for n in out["distinct_tokens"].values())
    for lo, mean, hi in out["experts_hit_per_step"].values():  # 4 tokens x top-8 of 128 experts
        assert 8 <= lo <= mean <= hi <= 32
    assert len(out["experts_hit_per_step"]) == 2
