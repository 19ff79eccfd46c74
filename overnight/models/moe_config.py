"""The ModelArch fields of the mixture-of-experts families that run on Qwen3-MoE's blocks or beside them
(models/qwen3_moe.py, ernie4_5_moe.py, hunyuan.py): Qwen1.5-MoE / Qwen2-MoE, ERNIE 4.5 (dense and
MoE), OLMoE, Hunyuan (dense and MoE). One small function per family, in models/hf_config.py's
FAMILY_FIELDS; models/registry.py reads the fields all families share (and Qwen3-MoE's routed experts
for Qwen2-MoE) before these.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from overnight.errors import ModelLoadError


def _qwen2_moe_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen1.5-MoE / Qwen2-57B-A14B (models/qwen3_moe.py): Qwen2's attention (q/k/v biases as qkv_bias
    says, none on o_proj), Qwen3-MoE's routed experts and dense layers (registry._moe_fields: softmax
    top-k, norm_topk_prob, decoder_sparse_step, mlp_only_layers), and in every sparse layer a shared
    expert of shared_expert_intermediate_size behind its own sigmoid gate."""
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    if shared <= 0:
        raise ModelLoadError(
            f"Qwen2-MoE needs a positive shared_expert_intermediate_size, got {shared} (a shared expert)"
        )
    return dict(
        attention_bias=bool(cfg.get("qkv_bias", True)),
        o_proj_bias=False,
        shared_expert_intermediate_size=shared,
        shared_expert_gated=True,
    )


def _ernie4_5_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """ERNIE 4.5 (dense 0.3B, and the MoE models' attention): RoPE in interleaved pairs. use_bias
    (biases on every projection, attention and MLPs alike) is refused: no published checkpoint sets it
    and the dense MLP has no biases here."""
    if cfg.get("use_bias"):
        raise ModelLoadError("unsupported ERNIE 4.5 config: use_bias=true (biases on the MLP projections)")
    return dict(rope_interleaved=True, attention_bias=False, o_proj_bias=False)


def _ernie4_5_moe_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """ERNIE-4.5-21B-A3B / 300B-A47B (models/ernie4_5_moe.py): the dense model's attention; layers
    moe_layer_start_index .. moe_layer_end_index (-1: the last), every moe_layer_interval-th, sparse with
    moe_num_experts experts of moe_intermediate_size, moe_k a token, chosen by softmax plus the
    correction bias, and moe_num_shared_experts ungated shared experts; the others dense. The
    vision-language model's per-modality lists are refused by name."""
    fields = _ernie4_5_fields(cfg)
    n = int(cfg["num_hidden_layers"])
    keys = ("moe_num_experts", "moe_k", "moe_layer_start_index", "moe_layer_end_index", "moe_layer_interval")
    lists = [k for k in keys if isinstance(cfg.get(k), (list, tuple))]
    if lists:
        raise ModelLoadError(
            f"unsupported ERNIE 4.5 config: per-modality {', '.join(lists)} (the vision-language model's)"
        )
    experts, top_k = int(cfg.get("moe_num_experts") or 0), int(cfg.get("moe_k") or 0)
    inter = int(cfg.get("moe_intermediate_size") or 0)
    shared = int(cfg.get("moe_num_shared_experts") or 0)
    start, interval = int(cfg.get("moe_layer_start_index", 1)), int(cfg.get("moe_layer_interval", 1))
    end = int(cfg.get("moe_layer_end_index", -1))
    end = n - 1 if end == -1 else end
    problems = []
    if not 0 < top_k <= experts:
        problems.append(f"moe_k must be in 1..moe_num_experts ({experts}), got {top_k}")
    if inter <= 0 or shared < 0 or interval <= 0 or start < 0:
        problems.append(
            "moe_intermediate_size and moe_layer_interval must be positive, moe_num_shared_experts and "
            "moe_layer_start_index not negative"
        )
    if float(cfg.get("moe_norm_min", 1e-12)) != 1e-12:
        problems.append(f"moe_norm_min {cfg['moe_norm_min']} (only 1e-12)")
    if cfg.get("moe_gate", "topk") != "topk":
        problems.append(f"moe_gate {cfg['moe_gate']!r} (only topk)")
    if problems:
        raise ModelLoadError("unsupported ERNIE 4.5 MoE config: " + "; ".join(problems))
    sparse = [(i + 1) % interval == 0 and start <= i <= end for i in range(n)]
    return dict(
        fields,
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=inter,
        norm_topk_prob=True,
        mlp_only_layers=tuple(i for i in range(n) if not sparse[i]),
        shared_expert_intermediate_size=shared * inter,
        shared_expert_gated=False,
        router_scoring="softmax_bias",
    )


def _olmoe_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """OLMoE (models/qwen3_moe.py's model with flags): pre-norm blocks (not OLMo 2's post-norm) with
    RMSNorms over the whole q and k projections, every layer sparse, intermediate_size the width of each
    of num_experts experts, softmax top-k without renormalization unless norm_topk_prob. clip_qkv
    (clamping q, k, v) is refused: the published checkpoints leave it null."""
    experts, top_k = int(cfg.get("num_experts") or 0), int(cfg.get("num_experts_per_tok") or 0)
    problems = []
    if not 0 < top_k <= experts:
        problems.append(f"num_experts_per_tok must be in 1..num_experts ({experts}), got {top_k}")
    if cfg.get("clip_qkv") is not None:
        problems.append(f"clip_qkv {cfg['clip_qkv']} (only null)")
    if cfg.get("head_dim") not in (None, cfg["hidden_size"] // cfg["num_attention_heads"]):
        problems.append("head_dim other than hidden_size / num_attention_heads")
    if problems:
        raise ModelLoadError("unsupported OLMoE config: " + "; ".join(problems))
    return dict(
        qk_norm=True,
        qk_norm_whole=True,
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=int(cfg["intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
    )


def _hunyuan_fields(cfg: dict[str, Any], moe: bool) -> dict[str, Any]:
    """Hunyuan dense and MoE (models/hunyuan.py): per-head q/k RMSNorms after RoPE; dynamic RoPE with an
    `alpha` read as transformers does, a base of theta * alpha^(d / (d - 2)) (factor 1 only); MoE: every
    layer sparse with num_experts experts of intermediate_size, moe_topk a token (softmax, renormalized)
    and one shared MLP of intermediate_size. Per-layer lists must repeat one value; cross-layer attention
    (use_cla) and other shared-expert counts are refused by name."""
    problems = []
    if cfg.get("use_cla"):
        problems.append("use_cla=true (cross-layer attention)")
    if cfg.get("use_qk_norm") is False:
        problems.append("use_qk_norm=false")
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    fields: dict[str, Any] = dict(qk_norm=True, qk_norm_after_rope=True)
    alpha = params.get("alpha")
    if params.get("rope_type", params.get("type")) == "dynamic" and alpha:
        if float(params.get("factor") or 1.0) != 1.0:
            problems.append(f"dynamic RoPE with alpha and factor {params['factor']} (only 1.0)")
        theta = float(params.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
        d = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
        fields.update(rope_theta=theta * float(alpha) ** (d / (d - 2)), rope_scaling=None)

    def one_value(key: str, default: int) -> int:
        value = cfg.get(key, default)
        values = value if isinstance(value, list) else [value]
        if len(set(values)) != 1:
            problems.append(f"{key} differing between layers")
            return int(values[0])
        return int(values[0] or 0)

    if moe:
        experts, top_k = one_value("num_experts", 0), one_value("moe_topk", 1)
        inter = int(cfg["intermediate_size"])
        if not 0 < top_k <= experts:
            problems.append(f"moe_topk must be in 1..num_experts ({experts}), got {top_k}")
        if one_value("moe_intermediate_size", inter) != inter:
            problems.append("moe_intermediate_size other than intermediate_size")
        if one_value("num_shared_expert", 1) != 1 or cfg.get("use_mixed_mlp_moe") is False:
            problems.append("a shared MLP count other than one (num_shared_expert, use_mixed_mlp_moe)")
        fields.update(
            num_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=inter,
            norm_topk_prob=True,
            shared_expert_intermediate_size=inter,
            shared_expert_gated=False,
        )
    if problems:
        raise ModelLoadError("unsupported Hunyuan config: " + "; ".join(problems))
    return fields


MOE_FAMILY_FIELDS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "qwen2_moe": _qwen2_moe_fields,
    "ernie4_5": _ernie4_5_fields,
    "ernie4_5_moe": _ernie4_5_moe_fields,
    "olmoe": _olmoe_fields,
    "hunyuan_v1_dense": partial(_hunyuan_fields, moe=False),
    "hunyuan_v1_moe": partial(_hunyuan_fields, moe=True),
}
