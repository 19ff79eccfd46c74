"""Tiny random LFM2 checkpoints (Lfm2ForCausalLM): 5 layers of short convs and attention (conv first,
two attention layers, conv last), odd sizes, grouped KV heads, the feed-forward width auto-adjusted
from intermediate_size as the published configs do; with or without the conv biases, tied or not."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from tests.tiny_hybrid import save_checkpoint
from tests.tiny_models import _spread_weights

_CONFIG: dict[str, Any] = dict(
    vocab_size=101,
    hidden_size=40,
    intermediate_size=90,  # int(2 * 90 / 3) = 60, times 1.5 = 90, up to a multiple of 16: 96
    block_multiple_of=16,
    block_ffn_dim_multiplier=1.5,
    block_auto_adjust_ff_dim=True,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=2,
    layer_types=["conv", "full_attention", "conv", "full_attention", "conv"],
    conv_L_cache=3,
    norm_eps=1e-5,
    max_position_embeddings=1024,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
# variant -> its config changes: the published shape (no biases, tied embeddings), and the other flags
VARIANTS: dict[str, dict[str, Any]] = {
    "tied": dict(conv_bias=False, tie_word_embeddings=True),
    "biased": dict(conv_bias=True, tie_word_embeddings=False),
}


def make_lfm2_model(variant: str = "tied", seed: int = 0, **overrides: Any):
    """The transformers model (fp32, eval) of one of VARIANTS."""
    import transformers

    cfg = transformers.Lfm2Config(**{**_CONFIG, **VARIANTS[variant], **overrides})
    torch.manual_seed(seed)
    model = transformers.Lfm2ForCausalLM(cfg).eval()
    _spread_weights(model, seed)
    return model


def make_lfm2_checkpoint(
    tmp_path: str | os.PathLike, variant: str = "tied", seed: int = 0, **overrides: Any
) -> Path:
    return save_checkpoint(
        make_lfm2_model(variant, seed, **overrides), Path(tmp_path) / f"tiny-lfm2-{variant}"
    )
