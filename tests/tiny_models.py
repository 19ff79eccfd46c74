"""Tiny random HF checkpoints (Qwen3, Qwen2, Llama, Qwen3-MoE) built with transformers, for tests anywhere.

Weights are drawn with a larger spread than transformers' default init so that logits are well
separated: greedy decoding then has no near-ties, and token-exact comparisons are meaningful. The
defaults are untied, so greedy outputs are varied; with tie_word_embeddings=True the random input and
output embeddings coincide and a tiny model mostly repeats its last token (fine for parity, useless for
catching mixed-up requests).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

FAMILIES = ("qwen3", "qwen2", "llama", "qwen3_moe")

_COMMON: dict[str, Any] = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)
_FAMILY: dict[str, dict[str, Any]] = {
    "qwen3": dict(rope_theta=10000.0, tie_word_embeddings=False),
    "qwen2": dict(rope_theta=10000.0, tie_word_embeddings=False),
    # 8 experts, top-2, every layer sparse unless overridden (mlp_only_layers, decoder_sparse_step).
    "qwen3_moe": dict(
        num_hidden_layers=3,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    ),
    # Llama 3 scaling with a short original context, so the interpolated band covers real positions.
    "llama": dict(
        num_hidden_layers=3,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
}


def tiny_config(family: str, **overrides: Any):
    """A transformers config for a tiny model of `family` (overrides win)."""
    import transformers

    cls = {
        "qwen3": transformers.Qwen3Config,
        "qwen2": transformers.Qwen2Config,
        "llama": transformers.LlamaConfig,
        "qwen3_moe": transformers.Qwen3MoeConfig,
    }[family]
    return cls(**{**_COMMON, **_FAMILY[family], **overrides})


@torch.no_grad()
def _spread_weights(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.2 * (torch.rand(p.shape, generator=gen) - 0.5))
        elif name.endswith("bias"):
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))
        elif "embed_tokens" in name or "lm_head" in name:
            p.copy_(torch.randn(p.shape, generator=gen))
        else:  # projections (stacked experts too): unit-variance outputs for unit-variance inputs
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


def make_tiny_model(family: str, seed: int = 0, **overrides: Any):
    """The transformers model itself (fp32, eval mode), e.g. as the reference in parity tests."""
    import transformers

    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    cls = {
        "qwen3": transformers.Qwen3ForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "llama": transformers.LlamaForCausalLM,
        "qwen3_moe": transformers.Qwen3MoeForCausalLM,
    }[family]
    model = cls(config).eval()
    _spread_weights(model, seed)
    return model


def make_tiny_checkpoint(
    tmp_path: str | os.PathLike,
    family: str = "qwen3",
    *,
    seed: int = 0,
    name: str | None = None,
    max_shard_size: str | None = None,
    eos_token_ids: list[int] | None = None,
    **overrides: Any,
) -> Path:
    """Save a tiny random `family` model as safetensors with a generation_config.json into
    tmp_path/<name or family>; returns the folder. max_shard_size (e.g. "100KB") makes a sharded
    checkpoint; eos_token_ids goes into generation_config.json (default [eos_token_id])."""
    import transformers

    folder = Path(tmp_path) / (name or f"tiny-{family}")
    model = make_tiny_model(family, seed=seed, **overrides)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    eos = eos_token_ids if eos_token_ids is not None else [model.config.eos_token_id]
    generation = transformers.GenerationConfig(
        bos_token_id=model.config.bos_token_id, eos_token_id=eos, do_sample=False
    )
    generation.save_pretrained(folder)
    return folder


def load_reference(folder: str | os.PathLike):
    """The checkpoint in `folder` loaded back with transformers (fp32, eval, eager attention)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
