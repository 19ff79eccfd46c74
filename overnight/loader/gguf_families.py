"""GGUF files of the families read through their config.json reader (gpt-oss, Qwen1.5-MoE / Qwen2-MoE):
the file's metadata written back as the config.json dict models/registry.arch_from_hf_config reads, so
their ModelArch has one source of truth; and their tensor names, as llama.cpp's converter writes them
(gguf-py's tensor map and convert_hf_to_gguf.py), taken back to HF checkpoint names.

Converter facts these rely on:
  - neither family's q/k rows are permuted (both rotate halves, llama.cpp's NEOX RoPE);
  - gpt-oss: experts stacked [E, out, in] as ffn_{gate,up,down}_exps (gate and up de-interleaved from
    the checkpoint's gate_up_proj), or with the converter's fused option one ffn_gate_up_exps holding the
    gate rows then the up rows; biases as the same names' .bias; MXFP4 experts repacked to ggml's MXFP4
    type; the router as ffn_gate_inp (weight and bias); the sinks as attn_sinks.weight; the norm after
    attention as post_attention_norm. Windows alternate with the first layer windowed (llama.cpp's fixed
    rule, as HF's default layer_types); the file states the window, the expert width and YaRN's factor
    and original context.
  - qwen2moe: experts as ffn_*_exps, the shared expert as ffn_*_shexp and its one-row sigmoid gate as
    ffn_gate_inp_shexp (a vector where the converter squeezed it); expert_feed_forward_length and
    expert_shared_feed_forward_length give the two widths.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import numpy as np

from overnight.errors import ModelLoadError

# GGUF general.architecture -> the HF architecture whose config.json reader takes the rebuilt config
CONFIG_FAMILIES = {
    "gpt-oss": "GptOssForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
}
_MODEL_TYPES = {"gpt-oss": "gpt_oss", "qwen2moe": "qwen2_moe"}

# Per decoder layer: GGUF name suffix -> HF name suffix (stacked experts are handled apart).
_ATTENTION = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
}
LAYER_NAMES = {
    "gpt-oss": {
        **_ATTENTION,
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "attn_sinks.weight": "self_attn.sinks",
        "ffn_gate_inp.weight": "mlp.router.weight",
        "ffn_gate_inp.bias": "mlp.router.bias",
    },
    "qwen2moe": {
        **_ATTENTION,
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "ffn_gate_inp.weight": "mlp.gate.weight",
        "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
        "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
        "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
        "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
        # a layer the file keeps dense (mlp_only_layers)
        "ffn_gate.weight": "mlp.gate_proj.weight",
        "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
    },
}


def hf_config(md: dict[str, Any], tensors: Collection[str], path: str, vocab: int) -> dict[str, Any]:
    """The config.json dict of a `CONFIG_FAMILIES` file. `vocab` is the embedding's row count (the
    converter pads the token list to it); `tensors` the file's tensor names."""
    name = md["general.architecture"]

    def get(key: str, default: Any = None) -> Any:
        value = md.get(f"{name}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {name}.{key}")
        return value

    heads = int(get("attention.head_count"))
    kv_heads = get("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        if len(set(kv_heads)) != 1:
            raise ModelLoadError(
                f"{path}: per-layer KV head counts {sorted(set(kv_heads))} are not supported"
            )
        kv_heads = kv_heads[0]
    hidden = int(get("embedding_length"))
    layers = int(get("block_count"))
    cfg: dict[str, Any] = dict(
        architectures=[CONFIG_FAMILIES[name]],
        model_type=_MODEL_TYPES[name],
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(kv_heads),
        head_dim=int(md.get(f"{name}.attention.key_length") or hidden // heads),
        rms_norm_eps=_f32(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=_f32(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length")),
        tie_word_embeddings="output.weight" not in tensors,
        num_experts_per_tok=int(get("expert_used_count")),
    )
    scaling = _rope_scaling(md, name, path)
    experts = int(get("expert_count"))
    if name == "gpt-oss":
        if scaling is not None:
            scaling["truncate"] = False  # gpt-oss's YaRN keeps the unrounded correction range (as HF's)
        cfg.update(
            num_local_experts=experts,
            intermediate_size=int(get("expert_feed_forward_length")),
            sliding_window=int(get("attention.sliding_window")),
            attention_bias="blk.0.attn_q.bias" in tensors,
        )
    else:  # qwen2moe; llama.cpp renormalizes the top-k weights only where the file asks
        cfg.update(
            num_experts=experts,
            intermediate_size=int(get("feed_forward_length", 0)) or int(get("expert_feed_forward_length")),
            moe_intermediate_size=int(get("expert_feed_forward_length")),
            shared_expert_intermediate_size=int(get("expert_shared_feed_forward_length")),
            norm_topk_prob=bool(md.get(f"{name}.expert_weights_norm", False)),
            qkv_bias="blk.0.attn_q.bias" in tensors,
            decoder_sparse_step=1,
            mlp_only_layers=[i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors],
        )
    if scaling is not None:
        cfg["rope_scaling"] = scaling
    return cfg


def _rope_scaling(md: dict[str, Any], name: str, path: str) -> dict[str, Any] | None:
    kind = md.get(f"{name}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind != "yarn":
        raise ModelLoadError(f"{path}: RoPE scaling type {kind!r} is not supported for {name} GGUF files")
    keys = {
        "factor": "rope.scaling.factor",
        "original_max_position_embeddings": "rope.scaling.original_context_length",
        "attention_factor": "rope.scaling.attn_factor",
        "beta_fast": "rope.scaling.yarn_beta_fast",
        "beta_slow": "rope.scaling.yarn_beta_slow",
    }
    # transformers' YaRN betas where the file leaves them out (the published gpt-oss configs state these)
    out: dict[str, Any] = {"rope_type": "yarn", "beta_fast": 32.0, "beta_slow": 1.0}
    for k, key in keys.items():
        if f"{name}.{key}" in md:
            out[k] = _f32(md[f"{name}.{key}"])
    for required in ("factor", "original_max_position_embeddings"):
        if required not in out:
            raise ModelLoadError(f"{path}: YaRN RoPE scaling without {name}.{keys[required]}")
    out["original_max_position_embeddings"] = int(out["original_max_position_embeddings"])
    return out


def _f32(value: float) -> float:
    """The shortest decimal that rounds to the same float32 (files store 1e-5 as 9.99999975e-06)."""
    return float(str(np.float32(value)))


class ExpertStacks:
    """Stacked expert tensors ([E, out, in] weights, [E, out] biases) -> HF per-expert names.

    Weights become mlp.experts.{e}.{gate,up,down}_proj.weight. Biases (gpt-oss) have no per-expert
    checkpoint form: they go whole to the experts' stacked parameters, mlp.experts.gate_up_bias
    ([E, 2I]: gate then up) and mlp.experts.down_bias; a file with separate gate and up biases has the
    first held here until the second arrives."""

    _SUFFIXES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_up_exps")

    def __init__(self) -> None:
        self._half_biases: dict[str, dict[str, np.ndarray]] = {}  # layer prefix -> {"gate"|"up": [E, I]}

    @classmethod
    def handles(cls, suffix: str) -> bool:
        return suffix.rpartition(".")[0] in cls._SUFFIXES

    def tensors(self, layer: str, suffix: str, w: np.ndarray) -> list[tuple[str, np.ndarray]]:
        """HF (name, array) pairs for the stacked tensor `suffix` of layer `layer`, possibly none yet."""
        stem, _, kind = suffix.rpartition(".")
        proj = stem.removeprefix("ffn_").removesuffix("_exps")  # gate / up / down / gate_up
        prefix = f"model.layers.{layer}.mlp.experts"
        if kind == "weight":
            if proj == "gate_up":  # gate rows, then up rows
                gate, up = np.split(w, 2, axis=1)
                return [
                    *((f"{prefix}.{e}.gate_proj.weight", gate[e]) for e in range(w.shape[0])),
                    *((f"{prefix}.{e}.up_proj.weight", up[e]) for e in range(w.shape[0])),
                ]
            return [(f"{prefix}.{e}.{proj}_proj.weight", w[e]) for e in range(w.shape[0])]
        if kind != "bias":
            raise ModelLoadError(f"unexpected GGUF tensor blk.{layer}.{suffix}")
        if proj in ("down", "gate_up"):
            return [(f"{prefix}.{proj}_bias", w)]
        halves = self._half_biases.setdefault(prefix, {})
        halves[proj] = w
        if len(halves) < 2:
            return []
        del self._half_biases[prefix]
        return [(f"{prefix}.gate_up_bias", np.concatenate([halves["gate"], halves["up"]], axis=1))]

    def check_done(self, path: str) -> None:
        if self._half_biases:
            lonely = sorted(f"{p}: {', '.join(h)} bias only" for p, h in self._half_biases.items())
            raise ModelLoadError(f"{path}: expert gate and up biases come in pairs ({'; '.join(lonely)})")


def reshaped(hf: str, w: np.ndarray) -> np.ndarray:
    """The checkpoint's shape where the converter squeezed it: Qwen2-MoE's shared expert gate is [1, H]."""
    if hf.endswith("shared_expert_gate.weight") and w.ndim == 1:
        return w[None, :]
    return w
