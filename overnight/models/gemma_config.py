"""Gemma 2/3/4 config.json -> ModelArch, with transformers 5's defaults for the keys a checkpoint leaves out
(published Gemma 3 configs name only a few: the rest come from Gemma3TextConfig's defaults).

Multimodal checkpoints (Gemma3/4ForConditionalGeneration) keep the language model's config under
`text_config`. RoPE comes in two spellings: transformers 5's `rope_parameters` ({layer kind: {...}} for
Gemma 3/4), or the older `rope_theta` (+ `rope_local_base_freq` for sliding layers, `rope_scaling` for
full ones). Gemma 4's full layers take their head size and KV heads from `per_layer_config` (what
transformers 5 writes), else from `global_head_dim` / `num_global_key_value_heads`.
"""

from __future__ import annotations

from typing import Any

from overnight.arch import ModelArch
from overnight.errors import ModelLoadError
from overnight.models.vision.config import gemma3_vision_arch

# Each family's transformers 5.17 defaults (Gemma2Config, Gemma3TextConfig, Gemma4TextConfig).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": dict(
        vocab_size=256000,
        max_position_embeddings=8192,
        query_pre_attn_scalar=256,
        sliding_window=4096,
        final_logit_softcapping=30.0,
        attn_logit_softcapping=50.0,
        rope_theta=10000.0,
    ),
    "gemma3": dict(
        vocab_size=262208,
        max_position_embeddings=131072,
        query_pre_attn_scalar=256,
        sliding_window=4096,
        final_logit_softcapping=None,
        rope_theta=1_000_000.0,
        rope_local_base_freq=10000.0,
    ),
    "gemma4": dict(
        vocab_size=262144,
        max_position_embeddings=131072,
        sliding_window=512,
        final_logit_softcapping=None,
        hidden_size_per_layer_input=256,
        vocab_size_per_layer_input=262144,
        global_head_dim=512,
    ),
}
_COMMON: dict[str, Any] = dict(
    hidden_size=2304,
    intermediate_size=9216,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    rms_norm_eps=1e-6,
    attention_bias=False,
)
_LAYERS = {"gemma2": 26, "gemma3": 26, "gemma4": 30}
_PATTERN = {"gemma2": 2, "gemma3": 6, "gemma4": 6}  # one full layer in every N, the others sliding
_ACTIVATIONS = ("gelu_pytorch_tanh",)


def _layer_types(text: dict[str, Any], family: str, n: int) -> tuple[str, ...]:
    types = text.get("layer_types")
    if types is None:
        pattern = int(text.get("sliding_window_pattern", _PATTERN[family]))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    types = list(types)
    if len(types) != n or set(types) - {"sliding_attention", "full_attention"}:
        raise ModelLoadError(
            f"layer_types must list {n} entries of sliding_attention / full_attention, got {types}"
        )
    if family == "gemma4":
        types[-1] = "full_attention"  # transformers forces Gemma 4's last layer to full attention
    return tuple(types)


def _rope_by_kind(text: dict[str, Any], family: str) -> dict[str, dict[str, Any]]:
    """{"sliding_attention": params, "full_attention": params}, either spelling (module docstring)."""
    params = text.get("rope_parameters")
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        full, sliding = dict(params.get("full_attention") or {}), dict(params.get("sliding_attention") or {})
    else:
        full = dict(params or text.get("rope_scaling") or {})
        sliding = {}
    defaults = _DEFAULTS[family]
    if family == "gemma4":
        full = {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6, **full}
        sliding = {"rope_type": "default", "rope_theta": 10000.0, **sliding}
    else:
        full.setdefault("rope_theta", text.get("rope_theta", defaults["rope_theta"]))
        sliding.setdefault(
            "rope_theta", text.get("rope_local_base_freq", defaults.get("rope_local_base_freq", 10000.0))
        )
    if family == "gemma2":  # one table for every layer
        sliding = dict(full)
    return {"full_attention": full, "sliding_attention": sliding}


def _rope_fields(text: dict[str, Any], family: str) -> dict[str, Any]:
    rope = _rope_by_kind(text, family)
    full, sliding = rope["full_attention"], rope["sliding_attention"]
    sliding_type = sliding.get("rope_type", sliding.get("type", "default"))
    if sliding_type != "default":
        raise ModelLoadError(f"unsupported RoPE type {sliding_type!r} for sliding layers (only default)")
    full_type = full.get("rope_type", full.get("type", "default"))
    supported = {
        "gemma2": ("default",),
        "gemma3": ("default", "linear"),
        "gemma4": ("default", "proportional"),
    }
    if full_type not in supported[family]:
        raise ModelLoadError(
            f"unsupported RoPE type {full_type!r} for {family} (supported: {', '.join(supported[family])})"
        )
    factor = float(full.get("factor", 1.0)) if full_type != "default" else 1.0
    proportion = float(full.get("partial_rotary_factor", 1.0)) if full_type == "proportional" else 1.0
    return dict(
        rope_theta=float(full["rope_theta"]),
        local_rope_theta=float(sliding["rope_theta"]),
        rope_factor=factor,
        rope_proportion=proportion,
    )


def _gemma4_fields(text: dict[str, Any], layer_types: tuple[str, ...], kv_heads: int) -> dict[str, Any]:
    n = len(layer_types)
    overrides = {int(k): v for k, v in (text.get("per_layer_config") or {}).items()}
    full_layers = [i for i, t in enumerate(layer_types) if t == "full_attention"]
    if overrides:
        if set(overrides) - set(full_layers) or len({str(sorted(v.items())) for v in overrides.values()}) > 1:
            raise ModelLoadError(
                "unsupported per_layer_config: only one override shared by every full-attention layer"
            )
        override = next(iter(overrides.values()))
        if set(override) - {"head_dim", "num_key_value_heads"}:
            raise ModelLoadError(f"unsupported per_layer_config keys {sorted(override)}")
        global_head_dim = int(override.get("head_dim", text.get("head_dim", _COMMON["head_dim"])))
        global_kv = int(override.get("num_key_value_heads", kv_heads))
    else:
        global_head_dim = int(text.get("global_head_dim") or _DEFAULTS["gemma4"]["global_head_dim"])
        global_kv = int(text.get("num_global_key_value_heads") or kv_heads)
        if not text.get("attention_k_eq_v"):
            global_kv = kv_heads  # transformers reads num_global_key_value_heads only with k_eq_v
    shared = int(text.get("num_kv_shared_layers") or 0)
    if not 0 <= shared < n:
        raise ModelLoadError(f"num_kv_shared_layers must be in 0..{n - 1}, got {shared}")
    for kind in set(layer_types[n - shared :]):
        if kind not in layer_types[: n - shared]:
            raise ModelLoadError(f"KV-shared {kind} layers have no earlier {kind} layer to read from")
    fields: dict[str, Any] = dict(
        attention_scale=1.0,
        global_head_dim=global_head_dim,
        num_global_key_value_heads=global_kv,
        attention_k_eq_v=bool(text.get("attention_k_eq_v", False)),
        num_kv_shared_layers=shared,
        use_double_wide_mlp=bool(text.get("use_double_wide_mlp", False)),
    )
    ple = text.get("hidden_size_per_layer_input", _DEFAULTS["gemma4"]["hidden_size_per_layer_input"])
    if ple:
        fields["hidden_size_per_layer_input"] = int(ple)
        fields["vocab_size_per_layer_input"] = int(
            text.get("vocab_size_per_layer_input") or _DEFAULTS["gemma4"]["vocab_size_per_layer_input"]
        )
    if text.get("enable_moe_block"):
        try:
            experts, top_k = int(text["num_experts"]), int(text["top_k_experts"])
            inter = int(text["moe_intermediate_size"])
        except (KeyError, TypeError) as e:
            raise ModelLoadError(
                f"enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size ({e})"
            ) from None
        if not 0 < top_k <= experts or inter <= 0:
            raise ModelLoadError(f"top_k_experts must be in 1..num_experts ({experts}), got {top_k}")
        fields.update(
            num_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=inter,
            norm_topk_prob=True,
            moe_beside_dense=True,
        )
    return fields


def gemma_arch(cfg: dict[str, Any], family: str, hf_architecture: str) -> ModelArch:
    """ModelArch of a Gemma 2/3/4 config.json (family: "gemma2" | "gemma3" | "gemma4")."""
    text = {**_COMMON, **_DEFAULTS[family], **(cfg.get("text_config") or cfg)}
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
        if isinstance(text.get(key), list):  # Gemma 3n-style per-layer sizes
            raise ModelLoadError(f"unsupported: per-layer {key} ({family})")
    activation = text.get("hidden_activation") or text.get("hidden_act") or "gelu_pytorch_tanh"
    if activation not in _ACTIVATIONS:
        raise ModelLoadError(f"unsupported hidden_activation {activation!r} for {family} (gelu_pytorch_tanh)")
    # EmbeddingGemma: Gemma 3's text model with bidirectional attention runs as an encoder
    # (models/gemma_encoder.py); its sliding layers see sliding_window // 2 tokens either side.
    bidirectional = text.get("use_bidirectional_attention") in (True, "all")
    if bidirectional and family != "gemma3":
        raise ModelLoadError(f"unsupported: use_bidirectional_attention in {family} (only Gemma 3's)")
    try:
        n = int(text.get("num_hidden_layers", _LAYERS[family]))
        layer_types = _layer_types(text, family, n)
        window = text["sliding_window"]
        if "sliding_attention" in layer_types and (window is None or int(window) < 1):
            raise ModelLoadError(f"sliding layers need a positive sliding_window, got {window}")
        heads = int(text["num_attention_heads"])
        kv_heads = int(text.get("num_key_value_heads") or heads)
        head_dim = int(text.get("head_dim") or text["hidden_size"] // heads)
        tie = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
        final_cap = text["final_logit_softcapping"]
        if hf_architecture == "Gemma3ForConditionalGeneration":
            final_cap = None  # transformers' multimodal Gemma 3 does not softcap its logits
        fields: dict[str, Any] = {}
        if family == "gemma4":
            fields = _gemma4_fields(text, layer_types, kv_heads)
        else:
            fields["attention_scale"] = float(text["query_pre_attn_scalar"]) ** -0.5
            if family == "gemma2":  # Gemma 3's attention ignores attn_logit_softcapping (as HF does)
                cap = text["attn_logit_softcapping"]
                fields["attn_logit_softcapping"] = None if cap is None else float(cap)
        if hf_architecture == "Gemma3ForConditionalGeneration" and isinstance(cfg.get("vision_config"), dict):
            fields["vision"] = gemma3_vision_arch(cfg, int(text["hidden_size"]))
        return ModelArch(
            architecture=family,
            vocab_size=int(text["vocab_size"]),
            hidden_size=int(text["hidden_size"]),
            intermediate_size=int(text["intermediate_size"]),
            num_hidden_layers=n,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(text["rms_norm_eps"]),
            max_position_embeddings=int(text["max_position_embeddings"]),
            tie_word_embeddings=bool(tie),
            attention_bias=bool(text["attention_bias"]),
            o_proj_bias=bool(text["attention_bias"]),
            layer_types=layer_types,
            sliding_window=None if window is None else int(window),
            final_logit_softcapping=None if final_cap is None else float(final_cap),
            is_encoder=bidirectional,
            **_rope_fields(text, family),
            **fields,
        )
    except KeyError as e:
        raise ModelLoadError(f"config.json lacks required field {e.args[0]!r}") from None
