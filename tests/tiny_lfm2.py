"""Tiny random LFM2 checkpoints (Lfm2ForCausalLM): 5 layers of short convs and attention (conv first,
two attention layers, conv last), odd sizes, grouped KV heads, the feed-forward width auto-adjusted
from intermediate_size as the published configs do; with or without the conv biases, tied or not. And
LFM2-MoE (Lfm2MoeForCausalLM): the same layers, two dense, then 6 experts of which 2 a token, with a
non-zero expert_bias (a buffer transformers never initializes away from zero) and a routing scale."""

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
_MOE: dict[str, Any] = dict(
    {k: v for k, v in _CONFIG.items() if not k.startswith("block_")},
    intermediate_size=36,  # the dense layers', as given
    moe_intermediate_size=12,
    num_experts=6,
    num_experts_per_tok=2,
    num_dense_layers=2,
    routed_scaling_factor=1.5,
)
# variant -> its config changes: the published shape (no biases, tied embeddings), the other flags, MoE
VARIANTS: dict[str, dict[str, Any]] = {
    "tied": dict(conv_bias=False, tie_word_embeddings=True),
    "biased": dict(conv_bias=True, tie_word_embeddings=False),
    "moe": dict(conv_bias=False, tie_word_embeddings=True),
}


def make_lfm2_model(variant: str = "tied", seed: int = 0, **overrides: Any):
    """The transformers model (fp32, eval) of one of VARIANTS."""
    import transformers

    torch.manual_seed(seed)
    if variant == "moe":
        cfg = transformers.Lfm2MoeConfig(**{**_MOE, **VARIANTS[variant], **overrides})
        model = transformers.Lfm2MoeForCausalLM(cfg).eval()
    else:
        model = transformers.Lfm2ForCausalLM(
            transformers.Lfm2Config(**{**_CONFIG, **VARIANTS[variant], **overrides})
        )
        model.eval()
    _spread_weights(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("expert_bias"):  # large enough to change some choices
                buf.copy_(0.3 * torch.randn(buf.shape, generator=gen))
    return model


def make_lfm2_checkpoint(
    tmp_path: str | os.PathLike, variant: str = "tied", seed: int = 0, **overrides: Any
) -> Path:
    return save_checkpoint(
        make_lfm2_model(variant, seed, **overrides), Path(tmp_path) / f"tiny-lfm2-{variant}"
    )
