"""Tiny random checkpoints of the hybrid linear-attention families (Qwen3.5 dense and MoE, their
ConditionalGeneration checkpoints, Qwen3-Next): odd sizes, 4 layers of both kinds, grouped value heads."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from tests.tiny_models import _spread_weights

# The layers of every tiny hybrid (tiny_vl.py's Qwen3.5 image checkpoints too): linear, full, linear,
# full; 2 value heads per key head, dk != dv.
LINEAR_LAYERS: dict[str, Any] = dict(
    num_hidden_layers=4,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=6,
    linear_conv_kernel_dim=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
)
_TEXT: dict[str, Any] = dict(
    vocab_size=101,
    hidden_size=40,
    num_attention_heads=3,
    num_key_value_heads=1,
    head_dim=16,
    **LINEAR_LAYERS,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
_MOE: dict[str, Any] = dict(
    num_experts=5, num_experts_per_tok=2, moe_intermediate_size=12, shared_expert_intermediate_size=20
)
VARIANTS = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen3_5_vl", "qwen3_5_moe_vl")
_VISION: dict[str, Any] = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=40)


def make_hybrid_model(variant: str, seed: int = 0, **overrides: Any):
    """The transformers model (fp32, eval) of one of VARIANTS."""
    import transformers
    from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5TextConfig
    from transformers.models.qwen3_5_moe import Qwen3_5MoeConfig, Qwen3_5MoeTextConfig

    text = {**_TEXT, **overrides}
    torch.manual_seed(seed)
    if variant == "qwen3_5":
        model = transformers.Qwen3_5ForCausalLM(Qwen3_5TextConfig(**{"intermediate_size": 36, **text}))
    elif variant == "qwen3_5_moe":
        model = transformers.Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**{**_MOE, **text}))
    elif variant == "qwen3_next":
        sizes = {**_MOE, "intermediate_size": 36, **text}  # overrides win
        cfg = transformers.Qwen3NextConfig(**sizes, partial_rotary_factor=0.5)
        model = transformers.Qwen3NextForCausalLM(cfg)
    elif variant == "qwen3_5_vl":
        cfg = Qwen3_5Config(text_config={**text, "intermediate_size": 36}, vision_config=_VISION)
        model = transformers.Qwen3_5ForConditionalGeneration(cfg)
    elif variant == "qwen3_5_moe_vl":
        cfg = Qwen3_5MoeConfig(text_config={**text, **_MOE}, vision_config=_VISION)
        model = transformers.Qwen3_5MoeForConditionalGeneration(cfg)
    else:
        raise ValueError(variant)
    model.eval()
    _spread_weights(model, seed)
    return model


def make_hybrid_checkpoint(
    tmp_path: str | os.PathLike, variant: str, seed: int = 0, **overrides: Any
) -> Path:
    return save_checkpoint(make_hybrid_model(variant, seed, **overrides), Path(tmp_path) / f"tiny-{variant}")


def save_checkpoint(model: Any, folder: Path) -> Path:
    """model saved in folder with a generation config that never stops early (no eos, greedy)."""
    import transformers

    model.save_pretrained(folder)
    transformers.GenerationConfig(eos_token_id=[], do_sample=False).save_pretrained(folder)
    return folder
