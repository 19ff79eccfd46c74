"""The ModelArch fields of config.json where a family differs from Llama: per layer kind RoPE, windows,
partial / interleaved rotation, NoPE layers, norm placement, Granite's multipliers, Mixtral's, GLM-4.5's,
MiniMax-M2's and DeepSeek's experts, and the text model of a Mistral 3 checkpoint. One small function
per family (FAMILY_FIELDS), the newer families' in models/dense_config.py and moe_config.py; the RoPE and
window readers they share in models/field_readers.py; models/registry.py reads the fields all families
share.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from overnight.errors import ModelLoadError
from overnight.models.dense_config import DENSE_FAMILY_FIELDS
from overnight.models.field_readers import rope_params, window_fields
from overnight.models.moe_config import MOE_FAMILY_FIELDS


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
    return window_fields(cfg, None)


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
    return {**moe, **window_fields(cfg, None)}


def _phi3_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    return dict(partial_rotary_factor=_partial_rotary(cfg), **window_fields(cfg, None))


def _olmo2_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    return dict(norm_placement="post", qk_norm=True, qk_norm_whole=True)


def _olmo3_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    n = cfg["num_hidden_layers"]
    kinds = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(n)
    ]
    fields = {**_olmo2_fields(cfg), **window_fields(cfg, list(kinds))}
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:  # transformers 5: one per kind
        theta, scaling = rope_params(cfg, params.get("full_attention") or {})
        sliding_theta, sliding_scaling = rope_params(cfg, params.get("sliding_attention") or {})
    else:  # older configs: rope_scaling applies to the full layers only
        theta, scaling = rope_params(cfg)
        sliding_theta, sliding_scaling = rope_params(cfg, scaled=False)
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
        fields.update(window_fields(cfg, list(kinds)))
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


def _glm4_moe_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """GLM-4.5 / 4.6: q/k/v biases (attention_bias) and none on o_proj, optional per-head q/k norms,
    partial rotate-half RoPE (not GLM-4's interleaved pairs), the first first_k_dense_replace layers
    dense, the others routed experts plus n_shared_experts ungated shared experts, and the grouped
    sigmoid router (layers/moe_grouped_router.py)."""
    params = cfg.get("rope_parameters") or {}
    if "partial_rotary_factor" not in params and "partial_rotary_factor" not in cfg:
        cfg = {**cfg, "partial_rotary_factor": 0.5}  # transformers' default for GLM-4.5
    dense = int(cfg.get("first_k_dense_replace", 1))
    return dict(
        o_proj_bias=False,
        qk_norm=bool(cfg.get("use_qk_norm", False)),
        partial_rotary_factor=_partial_rotary(cfg),
        router_scoring="sigmoid",
        **_routed_experts(cfg, tuple(range(min(dense, int(cfg["num_hidden_layers"]))))),
    )


def _routed_experts(cfg: dict[str, Any], dense_layers: tuple[int, ...]) -> dict[str, Any]:
    """The routed and shared experts and the grouped router's constants of GLM-4.5 and DeepSeek configs
    (n_routed_experts, n_group, topk_group, ...), checked; dense_layers keep the dense MLP."""
    experts = int(cfg.get("n_routed_experts") or cfg.get("num_local_experts") or 0)
    if not experts:
        raise ModelLoadError("config.json lacks required field 'n_routed_experts'")
    if "moe_intermediate_size" not in cfg:
        raise ModelLoadError("config.json lacks required field 'moe_intermediate_size'")
    inter, top_k = int(cfg["moe_intermediate_size"]), int(cfg.get("num_experts_per_tok") or 0)
    groups, topk_groups = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    shared = int(cfg.get("n_shared_experts", 1) or 0)
    scaling = float(cfg.get("routed_scaling_factor", 1.0))
    problems = []
    if groups < 1 or experts % groups or experts // groups < 2:
        problems.append(f"n_group {groups} must split n_routed_experts {experts} into groups of 2 or more")
    elif not 1 <= topk_groups <= groups:
        problems.append(f"topk_group must be in 1..n_group ({groups}), got {topk_groups}")
    elif not 1 <= top_k <= topk_groups * (experts // groups):
        problems.append(
            f"num_experts_per_tok must be in 1..{topk_groups * (experts // groups)} (the experts of the "
            f"topk_group best groups), got {top_k}"
        )
    if inter <= 0 or shared < 0 or min(dense_layers, default=0) < 0 or not scaling > 0:
        problems.append(
            "moe_intermediate_size and routed_scaling_factor must be positive, n_shared_experts and "
            "first_k_dense_replace not negative"
        )
    if problems:
        raise ModelLoadError("; ".join(problems))
    return dict(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=inter,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        mlp_only_layers=dense_layers,
        shared_expert_intermediate_size=shared * inter,
        shared_expert_gated=False,
        n_group=groups,
        topk_group=topk_groups,
        routed_scaling_factor=scaling,
    )


def _minimax_m2_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """MiniMax-M2 / M2.1 (models/minimax_m2.py): every layer sparse, intermediate_size the width of each
    of num_local_experts experts, no shared expert; the sigmoid router with its correction bias over one
    group, the chosen weights renormalized; RMSNorm over the whole q and k projections (qk_norm_type
    "per_layer": one statistic over all heads, not per head); partial rotate-half RoPE of rotary_dim
    dims. The options transformers' model does not have (MiniMax-Text-01's lightning-attention layers,
    a shared expert, softmax scoring, per-head q/k norms) are refused by name."""
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    params = cfg.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    rotary_dim = cfg.get("rotary_dim")
    if factor is None:  # the published configs say rotary_dim (64 of head_dim 128)
        factor = rotary_dim / head_dim if rotary_dim else 1.0
    elif rotary_dim is not None and int(head_dim * float(factor)) != int(rotary_dim):
        raise ModelLoadError(
            f"rotary_dim {rotary_dim} disagrees with partial_rotary_factor {factor} of head_dim {head_dim}"
        )
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    problems = []
    if not 0 < top_k <= experts:
        problems.append(f"num_experts_per_tok must be in 1..num_local_experts ({experts}), got {top_k}")
    if any(int(kind) != 1 for kind in cfg.get("attn_type_list") or ()):
        problems.append(
            "attn_type_list names lightning-attention layers (MiniMax-Text-01's); only full attention"
        )
    if cfg.get("scoring_func", "sigmoid") != "sigmoid":
        problems.append(f"scoring_func {cfg['scoring_func']!r} (only sigmoid)")
    if cfg.get("use_routing_bias") is False:
        problems.append("use_routing_bias false (the router's e_score_correction_bias is required)")
    if cfg.get("use_qk_norm") is False or cfg.get("qk_norm_type", "per_layer") != "per_layer":
        problems.append("q/k norms other than qk_norm_type per_layer")
    if int(cfg.get("shared_intermediate_size") or 0):
        problems.append("shared_intermediate_size > 0 (a shared expert)")
    if problems:
        raise ModelLoadError("unsupported MiniMax-M2 config: " + "; ".join(problems))
    return dict(
        qk_norm=True,
        qk_norm_whole=True,
        partial_rotary_factor=_partial_rotary(
            {**cfg, "partial_rotary_factor": factor, "rope_parameters": {}}
        ),
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=int(cfg["intermediate_size"]),
        norm_topk_prob=True,
        router_scoring="sigmoid",
    )


def _deepseek_fields(cfg: dict[str, Any], family: str) -> dict[str, Any]:
    """DeepSeek-V2 / V3 and GLM-4.7-Flash: multi-head latent attention (models/deepseek.py), RoPE over the
    qk_rope_head_dim dims only (head_dim, as transformers sets it), in interleaved pairs for V2 and for
    V3 / GLM-4.7-Flash with rope_interleave; the first first_k_dense_replace layers dense (GLM-4.7-Flash:
    its mlp_layer_types), V3's sigmoid router with the correction bias, V2's softmax one."""
    n = int(cfg["num_hidden_layers"])
    try:
        kv_rank, rope = int(cfg["kv_lora_rank"]), int(cfg["qk_rope_head_dim"])
        nope, v = int(cfg["qk_nope_head_dim"]), int(cfg["v_head_dim"])
    except KeyError as e:
        raise ModelLoadError(f"config.json lacks required field {e.args[0]!r}") from None
    q_rank = int(cfg.get("q_lora_rank") or 0)
    if min(kv_rank, rope, nope, v) <= 0 or q_rank < 0 or rope % 2:
        raise ModelLoadError(
            "kv_lora_rank, qk_nope_head_dim, v_head_dim and an even qk_rope_head_dim must be positive, "
            f"got {kv_rank}, {nope}, {v}, {rope}"
        )
    if family == "glm4_moe_lite":
        kinds = cfg.get("mlp_layer_types") or ["dense"] + ["sparse"] * (n - 1)
        if len(kinds) != n or not set(kinds) <= {"dense", "sparse"}:
            raise ModelLoadError(f"mlp_layer_types must name dense or sparse for each of {n} layers")
        dense = tuple(i for i, kind in enumerate(kinds) if kind == "dense")
    else:
        dense = tuple(range(min(int(cfg.get("first_k_dense_replace") or 0), n)))
    if family == "deepseek_v2":
        method = cfg.get("topk_method") or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise ModelLoadError(f"unsupported topk_method {method!r} (greedy, group_limited_greedy)")
        grouping = {} if method == "group_limited_greedy" else {"n_group": 1, "topk_group": 1}
        experts = _routed_experts({**cfg, **grouping, "norm_topk_prob": False}, dense)  # never read by V2
        routing: dict[str, Any] = dict(router_scoring="softmax_group", rope_interleaved=True)
    else:
        scoring = cfg.get("scoring_func", "sigmoid")
        if scoring != "sigmoid":
            raise ModelLoadError(f"unsupported scoring_func {scoring!r} for {family} (sigmoid)")
        experts = _routed_experts(cfg, dense)
        routing = dict(router_scoring="sigmoid", rope_interleaved=bool(cfg.get("rope_interleave", True)))
    factor = _partial_rotary({**cfg, "head_dim": rope}) if family == "glm4_moe_lite" else 1.0
    return dict(
        head_dim=rope,
        num_key_value_heads=int(cfg["num_attention_heads"]),
        o_proj_bias=bool(cfg.get("attention_bias", False)),
        partial_rotary_factor=factor,
        q_lora_rank=q_rank,
        kv_lora_rank=kv_rank,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=v,
        **experts,
        **routing,
    )


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The text model's config of a multimodal checkpoint (Mistral 3: Mistral or Ministral 3 inside).
    Whether the LM head is tied is the top level's say (transformers ties by it, default true)."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ModelLoadError("config.json lacks required field 'text_config'")
    if text.get("model_type", "mistral") not in ("mistral", "ministral3"):
        raise ModelLoadError(f"unsupported text model {text.get('model_type')!r} in a Mistral 3 checkpoint")
    return {**text, "tie_word_embeddings": cfg.get("tie_word_embeddings", True)}


def family_fields(family: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The fields where `family` differs from Llama ({} for Llama, Qwen2, Qwen3)."""
    read = FAMILY_FIELDS.get(family)
    return read(cfg) if read is not None else {}


FAMILY_FIELDS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
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
    "glm4_moe": _glm4_moe_fields,
    "minimax_m2": _minimax_m2_fields,
    "deepseek_v2": partial(_deepseek_fields, family="deepseek_v2"),
    "deepseek_v3": partial(_deepseek_fields, family="deepseek_v3"),
    "glm4_moe_lite": partial(_deepseek_fields, family="glm4_moe_lite"),
    **MOE_FAMILY_FIELDS,  # Qwen2-MoE, ERNIE 4.5, OLMoE, Hunyuan (models/moe_config.py)
    **DENSE_FAMILY_FIELDS,  # Seed-OSS, EXAONE 4, Apertus, Cohere (models/dense_config.py)
}
TEXT_CONFIG_FAMILIES = ("mistral3",)
WINDOWED_FAMILIES = ("smollm3",)  # where use_sliding_window=true is read (the others refuse it)
