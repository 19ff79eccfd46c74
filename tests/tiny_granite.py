"""Tiny random checkpoints of Granite 4.0 hybrids (GraniteMoeHybridForCausalLM): 4 layers, Mamba2 and
attention alternating, odd sizes, two B/C groups; dense (the shared MLP alone) and MoE (routed experts
beside it), with Granite's multipliers away from 1 and RoPE or none."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from tests.tiny_hybrid import save_checkpoint
from tests.tiny_models import _spread_weights

_CONFIG: dict[str, Any] = dict(
    vocab_size=101,
    hidden_size=32,
    intermediate_size=12,  # each routed expert's
    shared_intermediate_size=20,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    layer_types=["mamba", "attention", "mamba", "attention"],
    num_experts_per_tok=2,
    mamba_n_heads=4,
    mamba_n_groups=2,
    mamba_d_state=8,
    mamba_d_head=16,
    mamba_expand=2,
    mamba_d_conv=4,
    embedding_multiplier=2.0,
    attention_multiplier=0.2,
    residual_multiplier=0.5,
    logits_scaling=3.0,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)
# variant -> its config changes: dense NoPE, MoE with RoPE, and attention only (granite-4.0-micro's shape:
# a GraniteMoeHybrid config without Mamba2 layers: no state cache at all)
VARIANTS: dict[str, dict[str, Any]] = {
    "dense": dict(num_local_experts=0, position_embedding_type=None),
    "moe": dict(num_local_experts=3, position_embedding_type="rope"),
    "attention-only": dict(
        num_local_experts=0, position_embedding_type="rope", layer_types=["attention"] * 4
    ),
}


def make_granite_model(variant: str, seed: int = 0, **overrides: Any):
    """The transformers model (fp32, eval) of one of VARIANTS."""
    import transformers

    cfg = transformers.GraniteMoeHybridConfig(**{**_CONFIG, **VARIANTS[variant], **overrides})
    torch.manual_seed(seed)
    model = transformers.GraniteMoeHybridForCausalLM(cfg).eval()
    _spread_weights(model, seed)
    return model


def make_granite_checkpoint(
    tmp_path: str | os.PathLike, variant: str, seed: int = 0, **overrides: Any
) -> Path:
    return save_checkpoint(
        make_granite_model(variant, seed, **overrides), Path(tmp_path) / f"tiny-granite-{variant}"
    )
