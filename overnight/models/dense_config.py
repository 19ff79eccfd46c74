"""The ModelArch fields of the dense families that run on Llama's or OLMo's blocks with switches
(models/llama.py, olmo.py, apertus.py, cohere.py): Seed-OSS, EXAONE 4.0, Apertus, Cohere / Cohere 2.
One small function per family, in models/hf_config.py's FAMILY_FIELDS."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from overnight.errors import ModelLoadError
from overnight.models.field_readers import rope_params, window_fields


def _seed_oss_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Seed-OSS: Llama's blocks with a bias on q/k/v (attention_bias, default true) and, apart, on
    o_proj (attention_out_bias, default false)."""
    return dict(
        attention_bias=bool(cfg.get("attention_bias", True)),
        o_proj_bias=bool(cfg.get("attention_out_bias", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 524288)),  # transformers' default
    )


def _hybrid_kinds(cfg: dict[str, Any], default_pattern: int) -> list[str] | None:
    """EXAONE 4's and Cohere 2's per-layer kinds: layer_types, else sliding_window_pattern (an int p:
    every p-th layer full, the others sliding; or a string such as "LLLG" repeated over the layers, L
    sliding and G full); None without a sliding_window (every layer full)."""
    if not cfg.get("sliding_window"):
        return None
    n = int(cfg["num_hidden_layers"])
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    pattern = cfg.get("sliding_window_pattern", default_pattern)
    if isinstance(pattern, str) and pattern and set(pattern) <= {"L", "G"}:
        return [
            "sliding_attention" if pattern[i % len(pattern)] == "L" else "full_attention" for i in range(n)
        ]
    if isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0:
        return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]
    raise ModelLoadError(
        f"sliding_window_pattern must be a positive int or a string of L and G, got {pattern!r}"
    )


def _nope_full_layers(kinds: list[str] | None, n: int) -> tuple[int, ...]:
    """EXAONE 4 / Cohere 2: with a sliding_window, the full-attention layers take no RoPE (transformers
    rotates only where the layer is sliding or the config has no window at all)."""
    return () if kinds is None else tuple(i for i in range(n) if kinds[i] != "sliding_attention")


def _exaone4_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """EXAONE 4.0: OLMo's post-norm blocks (a norm on each sub-block's output, none before), an RMSNorm
    over each head of q and k before RoPE, and with a sliding_window the hybrid layers of
    _hybrid_kinds (32B: three sliding, one full), the full ones without RoPE (the 1.2B: no window,
    RoPE everywhere)."""
    kinds = _hybrid_kinds(cfg, 4)
    n = int(cfg["num_hidden_layers"])
    fields: dict[str, Any] = dict(
        norm_placement="post",
        qk_norm=True,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),  # transformers' defaults
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
    )
    if kinds is not None:
        fields.update(window_fields(cfg, kinds), no_rope_layers=_nope_full_layers(kinds, n))
    return fields


def _apertus_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Apertus: an RMSNorm over each head of q and k, and the ungated xIELU MLP (models/apertus.py);
    transformers' default RoPE is llama3's (theta 12M, factor 8 over 8192 positions)."""
    if cfg.get("hidden_act", "xielu") != "xielu":
        raise ModelLoadError(f"unsupported hidden_act {cfg['hidden_act']!r} for Apertus (only xielu)")
    fields: dict[str, Any] = dict(
        qk_norm=True,
        hidden_act="xielu",
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),  # transformers' defaults
        max_position_embeddings=int(cfg.get("max_position_embeddings", 65536)),
    )
    if not cfg.get("rope_parameters") and not cfg.get("rope_scaling") and not cfg.get("rope_theta"):
        default = dict(rope_type="llama3", rope_theta=12000000.0, factor=8.0, low_freq_factor=1.0,
                       high_freq_factor=4.0, original_max_position_embeddings=8192)  # fmt: skip
        theta, scaling = rope_params(cfg, default)
        fields.update(rope_theta=theta, rope_scaling=scaling)
    return fields


def _cohere_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Command R (cohere) and R7B / A (cohere2): attention and MLP side by side on one bias-free
    LayerNorm (models/cohere.py), RoPE in interleaved pairs, logits times logit_scale, head_dim =
    hidden_size / heads; Cohere 2 adds windowed layers (_hybrid_kinds, default every 4th full) whose
    full layers take no RoPE. Command R+ (use_qk_norm, Command R's config only) adds a bias-free
    LayerNorm over each head of q and k before RoPE, a weight row per head."""
    n, heads = int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"])
    fields: dict[str, Any] = dict(
        norm_placement="parallel",
        norm_type="layer",
        layer_norm_eps=float(cfg.get("layer_norm_eps") or 1e-5),
        rope_interleaved=True,
        logit_scale=float(cfg.get("logit_scale", 0.0625) or 1.0),
        head_dim=int(cfg["hidden_size"]) // heads,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),  # transformers' default
    )
    cohere2 = cfg.get("model_type") == "cohere2" or "Cohere2ForCausalLM" in (cfg.get("architectures") or ())
    fields["qk_norm"] = bool(cfg.get("use_qk_norm")) and not cohere2
    if cohere2:
        kinds = _hybrid_kinds(cfg, 4)
        if kinds is None:  # no window: transformers rotates no layer at all
            fields["no_rope_layers"] = tuple(range(n))
        else:
            fields.update(window_fields(cfg, kinds), no_rope_layers=_nope_full_layers(kinds, n))
    return fields


DENSE_FAMILY_FIELDS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "seed_oss": _seed_oss_fields,
    "exaone4": _exaone4_fields,
    "apertus": _apertus_fields,
    "cohere": _cohere_fields,
    "cohere2": _cohere_fields,
}
