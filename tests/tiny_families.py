"""Tiny random HF checkpoints of the dense families of issue 32 (Mistral, Ministral 3, Mistral 3, Mixtral,
Phi-3, OLMo 2/3, SmolLM3, Granite, GLM-4), built with transformers and saved with save_pretrained.

Odd sizes (vocab 211, 3 layers, head_dim 12), windows of 7 tokens where the family has windows, and
between them every RoPE scaling overnight reads (linear, dynamic, YaRN, LongRoPE; llama3 is
tests/tiny_models.py's Llama). Weights are spread as tests/tiny_models.py does, so greedy decoding has
few near-ties.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from tests.tiny_models import _spread_weights

WINDOW = 7
_COMMON: dict[str, Any] = dict(
    vocab_size=211,
    hidden_size=48,
    intermediate_size=72,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0}

# name -> (transformers config class, model class, config overrides)
VARIANTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "mistral-window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW)),
    "mistral-dynamic": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(
            sliding_window=None, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 5000.0}
        ),
    ),
    # YaRN with Ministral 3's position-dependent q scaling (llama_4_scaling_beta) past position 32.
    "ministral3": (
        "Ministral3Config",
        "Ministral3ForCausalLM",
        dict(sliding_window=WINDOW, rope_parameters={**_YARN, "llama_4_scaling_beta": 0.3}),
    ),
    # Mistral 3 checkpoints: a Mistral text model (Mistral Small 3.1), or a Ministral 3 one (Ministral 3).
    "mistral3": ("Mistral3Config", "Mistral3ForConditionalGeneration", {}),
    "mistral3-ministral3": ("Mistral3Config", "Mistral3ForConditionalGeneration", {}),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2, intermediate_size=40),
    ),
    # Phi-3.5/4-mini's shape: partial rotary and LongRoPE; prompts stay within the original context
    # and generation crosses it (32; see layers/rotary.py on how LongRoPE picks its factors).
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            head_dim=None,
            sliding_window=WINDOW,
            partial_rotary_factor=0.5,
            original_max_position_embeddings=32,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0, 1.3, 1.9],
                "long_factor": [1.5, 3.0, 6.5],
            },
        ),
    ),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(head_dim=None)),
    "olmo3": (
        "Olmo3Config",
        "Olmo3ForCausalLM",
        dict(
            head_dim=None,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": dict(_YARN),
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},  # unscaled
            },
        ),
    ),
    # Layer 1 has no RoPE; with use_sliding_window the RoPE-less layer is the windowed one (HF's rule).
    "smollm3": (
        "SmolLM3Config",
        "SmolLM3ForCausalLM",
        dict(head_dim=None, no_rope_layers=[1, 0, 1], use_sliding_window=True, sliding_window=WINDOW),
    ),
    "granite": (
        "GraniteConfig",
        "GraniteForCausalLM",
        dict(
            head_dim=None,
            embedding_multiplier=3.0,
            residual_multiplier=0.6,
            attention_multiplier=0.2,
            logits_scaling=2.5,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        ),
    ),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", dict(partial_rotary_factor=0.5, attention_bias=True)),
}


def _mistral3_config(text_model: str):
    import transformers

    text = {**_COMMON, "model_type": text_model, "sliding_window": None}
    if text_model == "mistral":
        text["rope_parameters"] = {"rope_type": "linear", "factor": 3.0, "rope_theta": 20000.0}
    else:
        text["rope_parameters"] = {**_YARN, "llama_4_scaling_beta": 0.2}
    vision = dict(
        model_type="pixtral",
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        head_dim=8,
        image_size=28,
        patch_size=14,
    )
    return transformers.Mistral3Config(text_config=text, vision_config=vision, tie_word_embeddings=False)


def make_family_model(variant: str, seed: int = 0, **changes: Any):
    """The transformers model of `variant` (fp32, eval mode, spread weights); `changes` override its
    config (None removes a field)."""
    import transformers

    config_cls, model_cls, overrides = VARIANTS[variant]
    overrides = {**overrides, **changes}
    if variant.startswith("mistral3"):
        config = _mistral3_config("ministral3" if variant.endswith("ministral3") else "mistral")
    else:
        kwargs = {**_COMMON, **overrides}  # head_dim None: a config without it (hidden / heads = 12)
        kwargs = {k: v for k, v in kwargs.items() if v is not None or k not in ("head_dim", "no_rope_layers")}
        config = getattr(transformers, config_cls)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    _spread_weights(model, seed)
    return model


def make_family_checkpoint(tmp_path: str | os.PathLike, variant: str, seed: int = 0, **changes: Any) -> Path:
    folder = Path(tmp_path) / f"tiny-{variant}"
    make_family_model(variant, seed, **changes).save_pretrained(folder)
    return folder


def load_family_reference(folder: str | os.PathLike, variant: str):
    """The checkpoint loaded back with transformers (fp32, eval, eager attention)."""
    import transformers

    cls = getattr(transformers, VARIANTS[variant][1])
    return cls.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
