"""Llama 4's ModelArch from config.json: Llama4ForCausalLM's text config (model_type llama4_text) or the
text_config of a Llama4ForConditionalGeneration checkpoint (Scout 17B-16E, Maverick 17B-128E), read as
transformers' Llama4TextConfig reads it (its defaults are the published models').

    layer i          RoPE (interleaved pairs, llama3 scaling)   attention
    no_rope_layers[i] == 1 (default: (i + 1) % 4 != 0)          chunked: the query's own chunk of
                                                                attention_chunk_size positions
    otherwise        none (NoPE), q scaled by the position     full (global)

MoE layers: moe_layers, else every interleave_moe_layer_step-th layer (HF's rule, is_moe_layer's with
decoder_sparse_step); their experts are of `intermediate_size`, the shared expert too, and the dense
layers' MLPs of `intermediate_size_mlp`. A ConditionalGeneration checkpoint with a vision_config also
gets its vision tower (VisionArch kind "llama4", models/vision/config.py; models/llama4_vl.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from overnight.arch import ModelArch
from overnight.errors import ModelLoadError
from overnight.models.field_readers import checked_rope, rope_params
from overnight.models.vision.config import llama4_vision_arch

LAYER_KINDS = ("full_attention", "chunked_attention")


def llama4_arch(cfg: dict[str, Any]) -> ModelArch:
    """ModelArch of a Llama 4 config; ModelLoadError for what the model does not implement."""
    text = cfg.get("text_config") if "text_config" in cfg else cfg
    if not isinstance(text, dict):
        raise ModelLoadError("config.json lacks required field 'text_config'")
    tie = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    try:
        arch = checked_rope(ModelArch(**_fields(text), tie_word_embeddings=bool(tie)))
    except KeyError as e:
        raise ModelLoadError(f"config.json lacks required field {e.args[0]!r}") from None
    if "text_config" in cfg and isinstance(cfg.get("vision_config"), dict):
        return replace(arch, vision=llama4_vision_arch(cfg, arch.hidden_size))
    return arch


def _fields(text: dict[str, Any]) -> dict[str, Any]:
    if text.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"unsupported hidden_act {text['hidden_act']!r} for Llama 4 (only silu)")
    n = int(text["num_hidden_layers"])
    heads = int(text["num_attention_heads"])
    experts = int(text.get("num_local_experts", 16))
    top_k = int(text.get("num_experts_per_tok", 1))
    if not 0 < top_k <= experts:
        raise ModelLoadError(f"num_experts_per_tok must be in 1..num_local_experts ({experts}), got {top_k}")
    # transformers' default theta for Llama 4 is 500000 (a config without one means it)
    theta, scaling = rope_params({"rope_theta": 500000.0, **text})
    attention_bias = bool(text.get("attention_bias", False))  # on q, k, v and o alike
    tuning = bool(text.get("attn_temperature_tuning", True))
    floor_scale = float(text.get("floor_scale", 8192))
    if tuning and not floor_scale > 0:
        raise ModelLoadError(f"floor_scale must be positive with attn_temperature_tuning, got {floor_scale}")
    return dict(
        architecture="llama4",
        vocab_size=int(text["vocab_size"]),
        hidden_size=int(text["hidden_size"]),
        intermediate_size=int(text.get("intermediate_size_mlp", 16384)),  # the dense layers' MLP
        num_hidden_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=int(text.get("num_key_value_heads") or heads),
        head_dim=int(text.get("head_dim") or 128),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-5)),
        rope_theta=theta,
        rope_scaling=scaling,
        rope_interleaved=True,  # transformers rotates (2i, 2i + 1) as complex numbers
        max_position_embeddings=int(text.get("max_position_embeddings", 131072)),
        attention_bias=attention_bias,
        o_proj_bias=attention_bias,
        qk_l2_norm=bool(text.get("use_qk_norm", True)),
        attn_floor_scale=floor_scale if tuning else 0.0,
        attn_scale=float(text.get("attn_scale", 0.1)) if tuning else 0.0,
        **_layer_kinds(text, n),
        **_moe_layers(text, n, experts, top_k),
    )


def _layer_kinds(text: dict[str, Any], n: int) -> dict[str, Any]:
    """no_rope_layers (HF: 1 where layer i rotates) and the chunked layers. Without an
    attention_chunk_size the chunked layers attend to everything (transformers cannot build their
    mask then; vLLM runs them as full attention, and so does this)."""
    interval = int(text.get("no_rope_layer_interval", 4))
    uses_rope = text.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
    if len(uses_rope) != n:
        raise ModelLoadError(f"no_rope_layers must have one entry per layer ({n}), got {len(uses_rope)}")
    kinds = text.get("layer_types") or ["chunked_attention" if r else "full_attention" for r in uses_rope]
    if len(kinds) != n or not set(kinds) <= set(LAYER_KINDS):
        raise ModelLoadError(f"layer_types must name {' or '.join(LAYER_KINDS)} for each of {n} layers")
    chunk = text.get("attention_chunk_size")
    if chunk is not None and int(chunk) < 1:
        raise ModelLoadError(f"attention_chunk_size must be positive, got {chunk}")
    fields: dict[str, Any] = dict(no_rope_layers=tuple(i for i, rope in enumerate(uses_rope) if not rope))
    if chunk is not None and "chunked_attention" in kinds:
        fields.update(layer_types=tuple(kinds), attention_chunk_size=int(chunk))
    return fields


def _moe_layers(text: dict[str, Any], n: int, experts: int, top_k: int) -> dict[str, Any]:
    """The MoE fields: moe_layers when the config lists them (the others dense, mlp_only_layers), else
    every interleave_moe_layer_step-th layer (decoder_sparse_step)."""
    inter = int(text.get("intermediate_size", 8192))
    listed = text.get("moe_layers")
    step = int(text.get("interleave_moe_layer_step", 1))
    if listed is not None:
        moe = {int(i) for i in listed}
        if not moe <= set(range(n)):
            raise ModelLoadError(f"moe_layers must name layers 0..{n - 1}, got {sorted(moe)}")
        step, dense = 1, tuple(i for i in range(n) if i not in moe)
    elif step < 1:
        raise ModelLoadError(f"interleave_moe_layer_step must be positive, got {step}")
    else:
        dense = ()
    if experts < 1 or inter < 1:
        raise ModelLoadError("num_local_experts and intermediate_size must be positive")
    return dict(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=inter,
        decoder_sparse_step=step,
        mlp_only_layers=dense,
        shared_expert_intermediate_size=inter,  # one shared expert of the routed experts' size
        shared_expert_gated=False,
        router_scoring="llama4",
    )
