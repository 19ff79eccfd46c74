"""The config readers every family shares: RoPE parameters (theta and scaling, old and new config
forms) checked by computing a table, and the per-layer sliding windows of layer_types."""

from __future__ import annotations

from typing import Any

from overnight.arch import ModelArch, RopeValue
from overnight.errors import ModelLoadError
from overnight.layers.rotary import ROPE_TYPES, rope_table

_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def rope_params(
    cfg: dict[str, Any], params: dict[str, Any] | None = None, *, scaled: bool = True
) -> tuple[float, tuple[tuple[str, RopeValue], ...] | None]:
    """(theta, scaling) from a rope parameter dict: `params` when given (one layer kind's), else the
    config's `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (older configs).
    scaled=False: the theta alone (OLMo 3's sliding layers of an older config)."""
    if params is None:
        params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = float(params.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in ("su", "yarn") and cfg.get("model_type") == "phi3":
        rope_type = "longrope"  # Phi-3's early names for it, as transformers reads them
    if rope_type in (None, "default") or not scaled:
        return theta, None
    if rope_type not in ROPE_TYPES:
        raise ModelLoadError(
            f"unsupported RoPE scaling type {rope_type!r} (supported: {', '.join(ROPE_TYPES)})"
        )
    keys = dict(params)
    for k in ("rope_theta", "type", "partial_rotary_factor", "rope_type"):
        keys.pop(k, None)
    if rope_type in ("llama3", "yarn", "longrope"):
        # transformers' rule: a top-level original_max_position_embeddings (Phi-3) wins
        original = cfg.get("original_max_position_embeddings") or keys.get("original_max_position_embeddings")
        keys["original_max_position_embeddings"] = original or cfg.get("max_position_embeddings", 4096)
    required = {
        "llama3": _LLAMA3_KEYS,
        "linear": ("factor",),
        "dynamic": ("factor",),
        "longrope": ("short_factor", "long_factor"),
    }.get(rope_type, ())
    missing = [k for k in required if keys.get(k) is None]
    if missing:
        raise ModelLoadError(f"{rope_type} RoPE scaling is missing {', '.join(missing)}")
    if rope_type == "llama3":  # kept in the older form: the four keys alone
        return theta, tuple((k, float(keys[k])) for k in _LLAMA3_KEYS)
    items: list[tuple[str, RopeValue]] = [("rope_type", str(rope_type))]
    for k, v in sorted(keys.items()):
        if isinstance(v, list):
            items.append((k, tuple(float(x) for x in v)))
        elif isinstance(v, bool) or isinstance(v, (int, float)):
            items.append((k, v if isinstance(v, bool) else float(v)))
        elif v is not None:
            raise ModelLoadError(f"unsupported value {v!r} of RoPE parameter {k!r}")
    return theta, tuple(items)


def checked_rope(arch: ModelArch) -> ModelArch:
    """Every RoPE table of the architecture computes (one position of it), so a bad scaling parameter
    (LongRoPE factors of the wrong length, a non-number) is refused before anything is built."""
    for theta, scaling in (
        (arch.rope_theta, arch.rope_scaling),
        (arch.sliding_rope_theta, arch.sliding_rope_scaling),
    ):
        if theta is None:
            continue
        try:
            rope_table(arch.rotary_dim, 1, theta, dict(scaling) if scaling else None)
        except ValueError as e:
            raise ModelLoadError(f"bad RoPE parameters in config.json: {e}") from None
    return arch


def window_fields(cfg: dict[str, Any], kinds: list[str] | None) -> dict[str, Any]:
    """layer_types and sliding_window: every layer windowed when kinds is None (Mistral's one
    sliding_window for all), else HF's per-layer names; no window at all without a sliding_window."""
    window = cfg.get("sliding_window")
    if not window:
        return {}
    n = cfg["num_hidden_layers"]
    kinds = kinds if kinds is not None else ["sliding_attention"] * n
    if len(kinds) != n or not set(kinds) <= {"full_attention", "sliding_attention"}:
        raise ModelLoadError(
            f"layer_types must name full_attention or sliding_attention for each of {n} layers"
        )
    if "sliding_attention" not in kinds:
        return {}
    return dict(layer_types=tuple(kinds), sliding_window=int(window))
