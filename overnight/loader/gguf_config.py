"""The architecture and generation facts of a GGUF checkpoint, from its metadata alone (read_gguf): the
ModelArch of the families read here (Llama, Qwen2/3, Qwen3-MoE, Mixtral, Gemma 2/3, OLMo 2/3, Granite,
Phi-3, GLM-4, SmolLM3), the stop ids and the chat template. The families read through their
config.json reader rebuild that config in gguf_families.py; RoPE scaling is gguf_rope.py's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from gguf import GGMLQuantizationType

from overnight.arch import ModelArch, RopeValue
from overnight.errors import ModelLoadError
from overnight.loader.gguf_families import CONFIG_FAMILIES, hf_config
from overnight.loader.gguf_file import GGUFFile, dequantizable, f32, read_gguf_file
from overnight.loader.gguf_rope import llama3_rope_config, rope_scaling
from overnight.models.gemma_config import gemma_arch

HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "granite": "GraniteForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "glm4": "Glm4ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
}
GEMMA_FAMILIES = ("gemma2", "gemma3")  # their ModelArch comes from models/gemma_config.py
# GGUF architecture -> ModelArch.architecture, where the names differ
_FAMILIES = {"qwen3moe": "qwen3_moe"}
_PARTIAL_ROTARY = ("phi3", "glm4")


@dataclass(frozen=True)
class GGUFInfo:
    arch: ModelArch
    hf_architecture: str
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    chat_template: str | None
    max_position_embeddings: int
    tie_word_embeddings: bool


def read_gguf(path: str) -> GGUFInfo:
    """The architecture and generation facts of a GGUF checkpoint, without touching the weights."""
    f = read_gguf_file(path)
    md = f.metadata
    name = md.get("general.architecture")
    if name not in HF_ARCHITECTURES and name not in CONFIG_FAMILIES:
        supported = ", ".join([*HF_ARCHITECTURES, *CONFIG_FAMILIES])
        raise ModelLoadError(f"{path}: GGUF architecture {name!r} is not supported (supported: {supported})")
    embd = f.tensors.get("token_embd.weight")
    if embd is None:
        raise ModelLoadError(f"{path}: GGUF file has no token_embd.weight tensor")
    unreadable = sorted({t.ggml_type.name for t in f.tensors.values() if not dequantizable(t.ggml_type)})
    if unreadable:  # refused before the model is built rather than midway through its weights
        first = next(t.name for t in f.tensors.values() if t.ggml_type.name in unreadable)
        raise ModelLoadError(
            f"{path}: GGUF tensor type {', '.join(unreadable)} cannot be dequantized (first: {first}); "
            "re-quantize the file to a type the gguf package reads (F32, F16, BF16, Q4_0..Q8_0, K- or "
            "I-quants, MXFP4)"
        )
    if name in CONFIG_FAMILIES:
        from overnight.models.registry import arch_from_hf_config  # the families' config.json reader

        experts = [t.ggml_type for t in f.tensors.values() if re.search(r"\.ffn_\w+_exps\.weight$", t.name)]
        mxfp4 = bool(experts) and all(t == GGMLQuantizationType.MXFP4 for t in experts)
        cfg = hf_config(md, f.tensors.keys(), path, embd.shape[0], llama3_rope_config(f, name), mxfp4)
        return _info(md, arch_from_hf_config(cfg), cfg["architectures"][0])

    def get(key: str, default: Any = None) -> Any:
        value = md.get(f"{name}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {name}.{key}")
        return value

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    kv_heads = get("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer counts; only uniform ones fit a dense transformer
        if len(set(kv_heads)) != 1:
            raise ModelLoadError(
                f"{path}: per-layer KV head counts {sorted(set(kv_heads))} are not supported"
            )
        kv_heads = kv_heads[0]
    # rope.dimension_count is the rotated part of a head where rotation is partial (phi3, glm4).
    rotary_dims = None if name in _PARTIAL_ROTARY else md.get(f"{name}.rope.dimension_count")
    head_dim = int(md.get(f"{name}.attention.key_length") or rotary_dims or hidden // heads)
    theta = f32(get("rope.freq_base", 10000.0))
    context = int(get("context_length"))
    tie = "output.weight" not in f.tensors
    moe = _moe_fields(f, name)
    family = "mixtral" if name == "llama" and moe else _FAMILIES.get(name, name)
    if name == "olmo2" and md.get(f"{name}.attention.sliding_window"):
        family = "olmo3"  # OLMo 3 converts to olmo2 files with a window
    scaling = rope_scaling(f, name, head_dim, theta)
    gemma = _gemma_config(md, name, embd.shape[0], tie) if name in GEMMA_FAMILIES else None
    arch = (
        gemma_arch(gemma, name, HF_ARCHITECTURES[name])
        if gemma
        else ModelArch(
            architecture=family,
            # The embedding rows are what the weights need; converters pad the token list to match them.
            vocab_size=embd.shape[0],
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length", md.get(f"{name}.expert_feed_forward_length"))),
            num_hidden_layers=int(get("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(kv_heads),
            head_dim=head_dim,
            rms_norm_eps=f32(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=context,
            tie_word_embeddings=tie,
            attention_bias="blk.0.attn_q.bias" in f.tensors,
            o_proj_bias="blk.0.attn_output.bias" in f.tensors,
            qk_norm="blk.0.attn_q_norm.weight" in f.tensors,
            **moe,
            **_family_fields(f, name, head_dim, theta, scaling),
        )
    )
    hf_architecture = {"mixtral": "MixtralForCausalLM", "olmo3": "Olmo3ForCausalLM"}.get(
        family, HF_ARCHITECTURES[name]
    )
    return _info(md, arch, hf_architecture)


def _info(md: dict[str, Any], arch: ModelArch, hf_architecture: str) -> GGUFInfo:
    """The GGUFInfo of a file whose ModelArch is known: stop ids and chat template from the metadata."""
    # Stop on end-of-sequence and, where the file names them, end-of-turn / end-of-message.
    eos: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if key in md and int(md[key]) not in eos:
            eos.append(int(md[key]))
    bos = md.get("tokenizer.ggml.bos_token_id")
    return GGUFInfo(
        arch=arch,
        hf_architecture=hf_architecture,
        eos_token_ids=tuple(eos),
        bos_token_id=None if bos is None else int(bos),
        chat_template=md.get("tokenizer.chat_template"),
        max_position_embeddings=arch.max_position_embeddings,
        tie_word_embeddings=arch.tie_word_embeddings,
    )


def _gemma_config(md: dict[str, Any], name: str, vocab: int, tie: bool) -> dict[str, Any]:
    """A Gemma 2/3 GGUF's metadata as the config.json keys models/gemma_config.py reads, with the
    conventions of llama.cpp, which writes these files: the query scale is 1/sqrt(hidden / heads) for
    the 27B models (46 layers Gemma 2, 62 layers Gemma 3) and 1/sqrt(head_dim) otherwise; Gemma 3's
    sliding layers rotate with theta 10000, and one layer in six is full unless the file says which."""

    def get(key: str, default: Any = None) -> Any:
        return md.get(f"{name}.{key}", default)

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    layers = int(get("block_count"))
    head_dim = int(get("attention.key_length") or hidden // heads)
    is_27b = layers == {"gemma2": 46, "gemma3": 62}[name]
    cfg: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=f32(get("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=int(get("context_length")),
        tie_word_embeddings=tie,
        sliding_window=int(get("attention.sliding_window", 4096)),
        query_pre_attn_scalar=hidden // heads if is_27b else head_dim,
        rope_theta=f32(get("rope.freq_base", 10000.0 if name == "gemma2" else 1e6)),
        final_logit_softcapping=get("final_logit_softcapping"),
    )
    if name == "gemma2":
        cfg["attn_logit_softcapping"] = get("attn_logit_softcapping")
    else:
        cfg["rope_local_base_freq"] = 10000.0
        if get("rope.scaling.type", "none") == "linear":
            cfg["rope_scaling"] = {"rope_type": "linear", "factor": f32(get("rope.scaling.factor"))}
    pattern = get("attention.sliding_window_pattern")
    if isinstance(pattern, list):  # per layer: true for a sliding layer
        cfg["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    elif pattern:
        cfg["sliding_window_pattern"] = int(pattern)
    return cfg


def _moe_fields(f: GGUFFile, name: str) -> dict[str, Any]:
    """ModelArch's mixture-of-experts fields: counts from the metadata, and every layer without a
    router tensor (ffn_gate_inp) among mlp_only_layers. llama.cpp renormalizes Qwen3-MoE's top-k
    weights unless the file says otherwise (expert_weights_norm)."""
    md = f.metadata
    experts = int(md.get(f"{name}.expert_count") or 0)
    if not experts:
        return {}
    if name == "llama":  # Mixtral: every layer sparse, the chosen experts' weights renormalized
        if "blk.0.ffn_gate_exps.weight" not in f.tensors:
            raise ModelLoadError(f"{f.path}: Mixtral GGUF files with per-expert tensors are not supported")
        return dict(
            num_experts=experts,
            num_experts_per_tok=int(md[f"{name}.expert_used_count"]),
            moe_intermediate_size=int(
                md.get(f"{name}.expert_feed_forward_length") or md[f"{name}.feed_forward_length"]
            ),
            norm_topk_prob=True,
        )
    if name != "qwen3moe":
        raise ModelLoadError(
            f"{f.path}: mixture-of-experts GGUF files are supported for qwen3moe and llama (Mixtral) only, not {name}"
        )
    layers = int(md[f"{name}.block_count"])
    try:
        return dict(
            num_experts=experts,
            num_experts_per_tok=int(md[f"{name}.expert_used_count"]),
            moe_intermediate_size=int(md[f"{name}.expert_feed_forward_length"]),
            norm_topk_prob=bool(md.get(f"{name}.expert_weights_norm", True)),
            mlp_only_layers=tuple(
                i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in f.tensors
            ),
        )
    except KeyError as e:
        raise ModelLoadError(f"{f.path}: GGUF metadata lacks {e.args[0]}") from None


def _family_fields(
    f: GGUFFile, name: str, head_dim: int, theta: float, scaling: tuple[tuple[str, RopeValue], ...] | None
) -> dict[str, Any]:
    """ModelArch fields of the families whose blocks differ from Llama's (OLMo 2/3's post-norms,
    whole-projection q/k norms and windows, Granite's multipliers, Phi-3's partial rotary and window)."""
    md = f.metadata
    window = int(md.get(f"{name}.attention.sliding_window") or 0)
    layers = int(md[f"{name}.block_count"])
    if name == "olmo2":
        fields: dict[str, Any] = dict(norm_placement="post", qk_norm_whole=True)
        if window:  # OLMo 3: which layers are windowed, and their RoPE unscaled (as in HF's configs)
            pattern = md.get(f"{name}.attention.sliding_window_pattern")
            if not isinstance(pattern, list) or len(pattern) != layers:
                raise ModelLoadError(
                    f"{f.path}: {name}.attention.sliding_window_pattern must list every layer"
                )
            kinds = tuple("sliding_attention" if p else "full_attention" for p in pattern)
            if "sliding_attention" in kinds:
                fields.update(layer_types=kinds, sliding_window=window)
                if scaling is not None:
                    fields.update(sliding_rope_theta=theta)
        return fields
    if name == "phi3":  # the converter writes window 0 for none (Phi-4)
        rotary = int(md.get(f"{name}.rope.dimension_count") or head_dim)
        fields = dict(partial_rotary_factor=rotary / head_dim)
        if window:
            fields.update(layer_types=("sliding_attention",) * layers, sliding_window=window)
        return fields
    if window:
        raise ModelLoadError(f"{f.path}: sliding-window GGUF files ({name}) are not supported yet")
    if name == "smollm3":  # llama.cpp's fixed rule (no metadata): every 4th layer has no RoPE
        return dict(no_rope_layers=tuple(i for i in range(layers) if (i + 1) % 4 == 0))
    if name == "glm4":  # sandwich norms; part of each head rotates, in interleaved pairs (HF's layout)
        rotary = int(md.get(f"{name}.rope.dimension_count") or head_dim // 2)
        return dict(norm_placement="sandwich", partial_rotary_factor=rotary / head_dim, rope_interleaved=True)
    if name == "granite":
        return dict(
            attention_multiplier=f32(md.get(f"{name}.attention.scale", 1.0)),
            embedding_multiplier=f32(md.get(f"{name}.embedding_scale", 1.0)),
            residual_multiplier=f32(md.get(f"{name}.residual_scale", 1.0)),
            logits_scaling=f32(md.get(f"{name}.logit_scale", 1.0)),
        )
    return {}
