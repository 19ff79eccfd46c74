"""From a HF config.json to a ModelArch and the class that implements it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from overnight.config import ModelArch, RopeValue
from overnight.errors import ModelLoadError
from overnight.layers.rotary import ROPE_TYPES, rope_table
from overnight.models.bert import BertModel
from overnight.models.llama import LlamaForCausalLM, Mistral3ForConditionalGeneration
from overnight.models.mixtral import MixtralForCausalLM
from overnight.models.olmo import OlmoForCausalLM
from overnight.models.qwen3_moe import Qwen3MoeForCausalLM

# ModelArch.architecture (the HF model_type) -> implementation. One class per family shape: the dense
# families differ only in ModelArch flags.
_FAMILIES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "bert": BertModel,
    # The dense families of issue 32: Llama's decoder with per-layer windows / RoPE and block options
    # (ModelArch fields read by _FAMILY_FIELDS below), OLMo's post-norm blocks, Mixtral's experts.
    "mistral": LlamaForCausalLM,
    "ministral3": LlamaForCausalLM,
    "mistral3": Mistral3ForConditionalGeneration,
    "mixtral": MixtralForCausalLM,
    "phi3": LlamaForCausalLM,
    "olmo2": OlmoForCausalLM,
    "olmo3": OlmoForCausalLM,
    "smollm3": LlamaForCausalLM,
    "granite": LlamaForCausalLM,
    "glm4": LlamaForCausalLM,
}
# HF `architectures` entry -> family
_HF_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    # Checkpoints of the bare decoder (sentence-transformers saves Qwen3-Embedding this way).
    "Qwen3Model": "qwen3",
    "BertModel": "bert",
    "MistralForCausalLM": "mistral",
    "Ministral3ForCausalLM": "ministral3",
    "Mistral3ForConditionalGeneration": "mistral3",
    "MixtralForCausalLM": "mixtral",
    "Phi3ForCausalLM": "phi3",
    "Olmo2ForCausalLM": "olmo2",
    "Olmo3ForCausalLM": "olmo3",
    "SmolLM3ForCausalLM": "smollm3",
    "GraniteForCausalLM": "granite",
    "Glm4ForCausalLM": "glm4",
}
_ENCODERS = ("bert",)
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def supported_architectures() -> list[str]:
    return sorted(_HF_ARCHITECTURES)


def _unsupported(name: str) -> ModelLoadError:
    return ModelLoadError(
        f"unsupported model architecture {name!r}; supported: {', '.join(supported_architectures())} "
        f"(model_type {', '.join(sorted(_FAMILIES))}). overnight implements each architecture itself and "
        "never runs a checkpoint's own code, so trust_remote_code does not change this"
    )


def family_of(name: str) -> str:
    """'Qwen3ForCausalLM' or 'qwen3' -> 'qwen3'."""
    if name in _FAMILIES:
        return name
    if name in _HF_ARCHITECTURES:
        return _HF_ARCHITECTURES[name]
    raise _unsupported(name)


def get_model_class(name: str) -> type[nn.Module]:
    """The implementation for a HF architecture name or a model_type / ModelArch.architecture."""
    return _FAMILIES[family_of(name)]


def hf_architecture_of(cfg: dict[str, Any]) -> str:
    """The config's `architectures[0]`, or the one implied by its model_type."""
    archs = cfg.get("architectures") or []
    if archs:
        return archs[0]
    model_type = cfg.get("model_type")
    if model_type in _FAMILIES:
        return next(a for a, f in _HF_ARCHITECTURES.items() if f == model_type)
    raise _unsupported(str(model_type))


def _bert_arch(cfg: dict[str, Any]) -> ModelArch:
    if cfg.get("hidden_act", "gelu") != "gelu":
        raise ModelLoadError(f"unsupported hidden_act {cfg['hidden_act']!r} for BERT (only gelu)")
    if cfg.get("position_embedding_type", "absolute") != "absolute":
        raise ModelLoadError(
            f"unsupported position_embedding_type {cfg['position_embedding_type']!r} (only absolute)"
        )
    heads = cfg["num_attention_heads"]
    return ModelArch(
        architecture="bert",
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=cfg["hidden_size"] // heads,
        max_position_embeddings=cfg.get("max_position_embeddings", 512),
        is_encoder=True,
        type_vocab_size=cfg.get("type_vocab_size", 2),
        layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
    )


def _rope_params(
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


def _rope(cfg: dict[str, Any]) -> tuple[float, tuple[tuple[str, RopeValue], ...] | None]:
    return _rope_params(cfg)


def arch_from_hf_config(cfg: dict[str, Any]) -> ModelArch:
    """Read a config.json dict; raises ModelLoadError for architectures or features not implemented."""
    family = family_of(hf_architecture_of(cfg))
    if family in _ENCODERS:
        try:
            return _bert_arch(cfg)
        except KeyError as e:
            raise ModelLoadError(f"config.json lacks required field {e.args[0]!r}") from None
    if family in _TEXT_CONFIG_FAMILIES:  # a multimodal checkpoint: its text model's config
        cfg = _text_config(cfg)
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"unsupported hidden_act {cfg['hidden_act']!r} (only silu)")
    if cfg.get("mlp_bias"):
        raise ModelLoadError("unsupported: mlp_bias=true")
    if cfg.get("use_sliding_window") and family not in _WINDOWED_FAMILIES:
        raise ModelLoadError("unsupported: use_sliding_window=true (sliding-window attention)")
    theta, scaling = _rope(cfg)
    try:
        heads = cfg["num_attention_heads"]
        fields: dict[str, Any] = dict(
            architecture=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has a q/k/v bias and none on o_proj; the others say so in attention_bias,
            # which covers both.
            attention_bias=True if family == "qwen2" else bool(cfg.get("attention_bias", False)),
            o_proj_bias=False if family == "qwen2" else bool(cfg.get("attention_bias", False)),
            qk_norm=family in ("qwen3", "qwen3_moe"),
        )
        fields.update(_FAMILY_FIELDS.get(family, _no_fields)(cfg))
        return _checked_rope(ModelArch(**fields))
    except KeyError as e:
        raise ModelLoadError(f"config.json lacks required field {e.args[0]!r}") from None


def _checked_rope(arch: ModelArch) -> ModelArch:
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


# ---------------------------------------------------------------------------------------------------
# Per-family config reading: each returns the ModelArch fields where the family differs from Llama.


def _no_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    return {}


def _window(cfg: dict[str, Any], kinds: list[str] | None) -> dict[str, Any]:
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


def _partial_rotary(cfg: dict[str, Any]) -> float:
    params = cfg.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    rotary_dim = int(head_dim * factor)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ModelLoadError(
            f"partial_rotary_factor {factor} gives an odd or empty rotary dim ({rotary_dim})"
        )
    return float(factor)


def _mistral_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    # Mistral (and Ministral 3, Mixtral) window every layer when sliding_window is set; transformers
    # ignores a layer_types in these configs.
    return _window(cfg, None)


def _mixtral_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    experts = int(cfg.get("num_local_experts") or 0)
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    if not 0 < top_k <= experts:
        raise ModelLoadError(
            f"Mixtral needs 0 < num_experts_per_tok <= num_local_experts, got {top_k}, {experts}"
        )
    # The router's softmax weights of the chosen experts are renormalized to sum to 1 (as HF's Mixtral).
    moe = dict(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=int(cfg["intermediate_size"]),
        norm_topk_prob=True,
    )
    return {**moe, **_window(cfg, None)}


def _phi3_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    return dict(partial_rotary_factor=_partial_rotary(cfg), **_window(cfg, None))


def _olmo2_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    return dict(norm_placement="post", qk_norm=True, qk_norm_whole=True)


def _olmo3_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    n = cfg["num_hidden_layers"]
    kinds = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(n)
    ]
    fields = {**_olmo2_fields(cfg), **_window(cfg, list(kinds))}
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:  # transformers 5: one per kind
        theta, scaling = _rope_params(cfg, params.get("full_attention") or {})
        sliding_theta, sliding_scaling = _rope_params(cfg, params.get("sliding_attention") or {})
    else:  # older configs: rope_scaling applies to the full layers only
        theta, scaling = _rope(cfg)
        sliding_theta, sliding_scaling = _rope_params(cfg, scaled=False)
    fields.update(rope_theta=theta, rope_scaling=scaling)
    if (sliding_theta, sliding_scaling) != (theta, scaling):
        fields.update(sliding_rope_theta=sliding_theta, sliding_rope_scaling=sliding_scaling)
    return fields


def _smollm3_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    n = cfg["num_hidden_layers"]
    # no_rope_layers[i] is 1 where layer i uses RoPE (HF's naming), default: every 4th layer has none.
    interval = int(cfg.get("no_rope_layer_interval", 4))
    uses_rope = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
    if len(uses_rope) != n:
        raise ModelLoadError(f"no_rope_layers must have one entry per layer ({n}), got {len(uses_rope)}")
    fields: dict[str, Any] = dict(no_rope_layers=tuple(i for i, rope in enumerate(uses_rope) if not rope))
    if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
        kinds = cfg.get("layer_types") or [
            "full_attention" if uses_rope[i] else "sliding_attention" for i in range(n)
        ]
        fields.update(_window(cfg, list(kinds)))
    return fields


def _granite_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    return dict(
        attention_multiplier=float(cfg.get("attention_multiplier", 1.0)),
        embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
        logits_scaling=float(cfg.get("logits_scaling", 1.0)),
    )


def _glm4_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    # q/k/v carry attention_bias's bias, o_proj none; half of each head rotates, in interleaved pairs.
    params = cfg.get("rope_parameters") or {}
    if "partial_rotary_factor" not in params and "partial_rotary_factor" not in cfg:
        cfg = {**cfg, "partial_rotary_factor": 0.5}  # transformers' default for GLM-4
    return dict(
        norm_placement="sandwich",
        o_proj_bias=False,
        partial_rotary_factor=_partial_rotary(cfg),
        rope_interleaved=True,
    )


def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The text model's config of a multimodal checkpoint (Mistral 3: Mistral or Ministral 3 inside).
    Whether the LM head is tied is the top level's say (transformers ties by it, default true)."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ModelLoadError("config.json lacks required field 'text_config'")
    if text.get("model_type", "mistral") not in ("mistral", "ministral3"):
        raise ModelLoadError(f"unsupported text model {text.get('model_type')!r} in a Mistral 3 checkpoint")
    return {**text, "tie_word_embeddings": cfg.get("tie_word_embeddings", True)}


_FAMILY_FIELDS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "qwen3_moe": lambda cfg: _moe_fields(cfg),
    "mistral": _mistral_fields,
    "ministral3": _mistral_fields,
    "mistral3": _mistral_fields,
    "mixtral": _mixtral_fields,
    "phi3": _phi3_fields,
    "olmo2": _olmo2_fields,
    "olmo3": _olmo3_fields,
    "smollm3": _smollm3_fields,
    "granite": _granite_fields,
    "glm4": _glm4_fields,
}
_TEXT_CONFIG_FAMILIES = ("mistral3",)
_WINDOWED_FAMILIES = ("smollm3",)  # where use_sliding_window=true is read (the others refuse it)


def _moe_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """ModelArch's mixture-of-experts fields from a Qwen3-MoE config (transformers 5 writes the expert
    count as num_local_experts, the published checkpoints as num_experts)."""
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if not experts:
        raise ModelLoadError("config.json lacks required field 'num_experts'")
    try:
        top_k = int(cfg["num_experts_per_tok"])
        inter = int(cfg["moe_intermediate_size"])
    except KeyError as e:
        raise ModelLoadError(f"config.json lacks required field {e.args[0]!r}") from None
    step = int(cfg.get("decoder_sparse_step", 1))
    if not 0 < top_k <= experts:
        raise ModelLoadError(f"num_experts_per_tok must be in 1..num_experts ({experts}), got {top_k}")
    if inter <= 0 or step <= 0:
        raise ModelLoadError("moe_intermediate_size and decoder_sparse_step must be positive")
    return dict(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=inter,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        decoder_sparse_step=step,
        mlp_only_layers=tuple(sorted(int(i) for i in cfg.get("mlp_only_layers") or ())),
    )
