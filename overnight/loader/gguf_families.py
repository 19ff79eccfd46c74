"""GGUF files of the families read through their config.json reader (gpt-oss, Qwen1.5-MoE / Qwen2-MoE,
DeepSeek-V2 / V3 / Kimi, OLMoE, Seed-OSS, ERNIE 4.5, EXAONE 4.0, Command R / Cohere 2, LFM2, LFM2-MoE,
Granite 4.0-H, Nemotron-H): the file's metadata written back as the config.json dict that
models/registry.arch_from_hf_config reads, so their ModelArch has one source of truth. Their tensors, as llama.cpp's converter names them (gguf-py's
tensor map and convert_hf_to_gguf.py), go back to HF checkpoint names in gguf_tensors.py.

Converter facts these rely on:
  - gpt-oss's and qwen2moe's q/k rows are not permuted (both rotate halves, llama.cpp's NEOX RoPE);
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
  - deepseek2: MLA's tensors as attn_q or attn_q_a / attn_q_a_norm / attn_q_b, attn_kv_a_mqa,
    attn_kv_a_norm, and kv_b_proj either whole (attn_kv_b, older converters) or split per head into
    attn_k_b (transposed) and attn_v_b (newer ones, for llama.cpp's absorbed attention); no row
    permutation (llama.cpp rotates DeepSeek's adjacent pairs, as HF does); the router's correction
    bias as exp_probs_b.bias; the leading dense layers, shared experts, groups, gating function and
    routed scale in the metadata.
  - the dense families and OLMoE / ERNIE 4.5 MoE: gguf-py's names, no permutation (ERNIE's and
    Cohere's interleaved RoPE is llama.cpp's normal mode; the others rotate halves); Cohere 2's windows
    by llama.cpp's fixed rule (every 4th layer full), EXAONE 4's from the per-layer pattern; LFM2's
    conv layers marked by 0 KV heads, its kernel squeezed to [C, L], its final norm token_embd_norm.
  - granitehybrid: Mamba2 layers marked by 0 KV heads (ssm_* tensors: A stored as -exp(A_log), A and D
    as [heads, 1], the gated norm as [groups, inner / groups], the conv kernel squeezed), q/k rows
    permuted as for llama, the shared MLP's and the experts' fused gate/up split in two, RoPE only
    where rope.scaling.finetuned is set (the converter sets it for Bamba and attention-only models);
    nemotron_h goes through the same converter, its block pattern only in the per-layer KV head
    counts and feed-forward widths (the MoE nemotron_h_moe files are not supported).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from overnight.errors import ModelLoadError
from overnight.loader.gguf_file import f32
from overnight.loader.gguf_rope import yarn_rope_config

# GGUF general.architecture -> the HF architecture whose config.json reader takes the rebuilt config
# (deepseek2: DeepseekV3ForCausalLM where the router is sigmoid, the file's expert_gating_func 2)
CONFIG_FAMILIES = {
    "gpt-oss": "GptOssForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "deepseek2": "DeepseekV2ForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "seed_oss": "SeedOssForCausalLM",
    "ernie4_5": "Ernie4_5ForCausalLM",
    "ernie4_5-moe": "Ernie4_5_MoeForCausalLM",
    "exaone4": "Exaone4ForCausalLM",
    "command-r": "CohereForCausalLM",
    "cohere2": "Cohere2ForCausalLM",
    "lfm2": "Lfm2ForCausalLM",
    "lfm2moe": "Lfm2MoeForCausalLM",
    "granitehybrid": "GraniteMoeHybridForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
}
_MODEL_TYPES = {
    "gpt-oss": "gpt_oss",
    "qwen2moe": "qwen2_moe",
    "deepseek2": "deepseek_v2",
    "olmoe": "olmoe",
    "seed_oss": "seed_oss",
    "ernie4_5": "ernie4_5",
    "ernie4_5-moe": "ernie4_5_moe",
    "exaone4": "exaone4",
    "command-r": "cohere",
    "cohere2": "cohere2",
    "lfm2": "lfm2",
    "lfm2moe": "lfm2_moe",
    "granitehybrid": "granitemoehybrid",
    "nemotron_h": "nemotron_h",
}
# The families whose routed experts take the shared metadata keys below (expert_count, expert_used_count)
_ROUTED = ("gpt-oss", "qwen2moe", "deepseek2", "olmoe")
_SIGMOID = 2  # gguf.ExpertGatingFuncType.SIGMOID; a file without the key is softmax (llama.cpp's rule)


def hf_config(
    md: dict[str, Any],
    tensors: Collection[str],
    path: str,
    vocab: int,
    llama3: dict[str, Any] | None = None,
    mxfp4_experts: bool = False,
) -> dict[str, Any]:
    """The config.json dict of a `CONFIG_FAMILIES` file. `vocab` is the embedding's row count (the
    converter pads the token list to it); `tensors` the file's tensor names; `llama3` the Llama 3 RoPE
    scaling recovered from a rope_freqs tensor (gguf_rope.py), if any. `mxfp4_experts`: every expert weight
    of the file is MXFP4, which gpt-oss then keeps packed as its published checkpoints are (the
    config says quant_method mxfp4; gguf_tensors.mxfp4_to_checkpoint repacks the blocks); a file
    whose experts were requantized to other types is dequantized instead."""
    name = md["general.architecture"]

    def get(key: str, default: Any = None) -> Any:
        value = md.get(f"{name}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {name}.{key}")
        return value

    heads = int(get("attention.head_count"))
    kv_heads = get("attention.head_count_kv", heads)
    if name == "deepseek2":  # newer files state MLA's latent as one KV head; the checkpoint's are per head
        kv_heads = heads
    lfm2_kinds = None
    if name in ("lfm2", "lfm2moe", "granitehybrid", "nemotron_h"):  # per layer: 0 KV heads, no attention
        counts = kv_heads if isinstance(kv_heads, list) else [kv_heads] * int(get("block_count"))
        lfm2_kinds = ["full_attention" if c else "conv" for c in counts]
        kv_heads = [c for c in counts if c] or [heads]
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
        rms_norm_eps=f32(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=f32(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length")),
        tie_word_embeddings="output.weight" not in tensors,
    )
    scaling = yarn_rope_config(md, name, path) or llama3
    if name == "exaone4":  # windowed layers as the file lists them (the full ones then take no RoPE)
        cfg["intermediate_size"] = int(get("feed_forward_length"))
        window = int(md.get(f"{name}.attention.sliding_window") or 0)
        pattern = md.get(f"{name}.attention.sliding_window_pattern")
        if window:
            if not isinstance(pattern, list) or len(pattern) != layers:
                raise ModelLoadError(f"{path}: {name}.attention.sliding_window_pattern must list every layer")
            cfg.update(
                sliding_window=window,
                layer_types=["sliding_attention" if p else "full_attention" for p in pattern],
            )
    if name == "seed_oss":  # dense: biases on q/k/v, and on o_proj where the file has one
        cfg.update(
            intermediate_size=int(get("feed_forward_length")),
            attention_bias="blk.0.attn_q.bias" in tensors,
            attention_out_bias="blk.0.attn_output.bias" in tensors,
        )
    if name.startswith("ernie4_5"):  # no projection biases (use_bias) in any published checkpoint
        cfg.update(intermediate_size=int(get("feed_forward_length")), use_bias="blk.0.attn_q.bias" in tensors)
    if name == "ernie4_5-moe":
        cfg.update(_ernie_moe_config(md, tensors, path, layers))
    if name in ("command-r", "cohere2"):  # both always tied: llama.cpp's files have no output tensor
        cfg.update(
            intermediate_size=int(get("feed_forward_length")),
            layer_norm_eps=f32(get("attention.layer_norm_epsilon", 1e-5)),
            logit_scale=f32(get("logit_scale", 1.0)),
            use_qk_norm="blk.0.attn_q_norm.weight" in tensors,
        )
        rotary = md.get(f"{name}.rope.dimension_count")
        if rotary is not None and int(rotary) != hidden // heads:
            raise ModelLoadError(
                f"{path}: partial rotary ({rotary} of {hidden // heads} dims) is not supported"
            )
        if name == "cohere2":  # llama.cpp's fixed rule: every 4th layer full (and without RoPE)
            cfg.update(sliding_window=int(get("attention.sliding_window")), sliding_window_pattern=4)
    if name == "granitehybrid":
        cfg.update(_granite_hybrid_config(md, tensors, path, lfm2_kinds or [], hidden))
    if name == "nemotron_h":
        cfg.update(_nemotron_h_config(md, tensors, path, lfm2_kinds or []))
    if name == "lfm2moe":  # llama.cpp's fixed routing: sigmoid plus the expert bias, renormalized
        if not any(t.endswith("exp_probs_b.bias") for t in tensors):
            raise ModelLoadError(
                f"{path}: LFM2-MoE files without an expert bias (exp_probs_b) are not supported"
            )
        cfg.update(
            num_experts=int(get("expert_count")),
            num_experts_per_tok=int(get("expert_used_count")),
            moe_intermediate_size=int(get("expert_feed_forward_length")),
            num_dense_layers=int(md.get(f"{name}.leading_dense_block_count") or 0),
            use_expert_bias=True,
            norm_topk_prob=True,
        )
    if name in ("lfm2", "lfm2moe"):  # the file's feed_forward_length is the width already adjusted
        ff = int(get("feed_forward_length"))
        cfg.update(
            layer_types=lfm2_kinds,
            conv_L_cache=int(get("shortconv.l_cache")),
            norm_eps=cfg["rms_norm_eps"],
            intermediate_size=ff,
            block_ff_dim=ff,
            block_auto_adjust_ff_dim=False,
        )
    if name not in _ROUTED:  # the others' configs are complete here
        if scaling is not None:
            cfg["rope_scaling"] = scaling
        return cfg
    cfg["num_experts_per_tok"] = int(get("expert_used_count"))
    experts = int(get("expert_count"))
    if name == "deepseek2":
        cfg.update(_deepseek_config(md, path, experts))
        if scaling is not None and f"{name}.rope.scaling.yarn_log_multiplier" in md:
            # the converter writes 0.1 * mscale_all_dim; mscale equals it in the published configs
            mscale = round(float(md[f"{name}.rope.scaling.yarn_log_multiplier"]) / 0.1, 6)
            scaling.update(mscale=mscale, mscale_all_dim=mscale)
    elif name == "olmoe":  # each expert is intermediate_size wide; no renormalization unless the file says
        cfg.update(
            num_experts=experts,
            intermediate_size=int(md.get(f"{name}.expert_feed_forward_length") or get("feed_forward_length")),
            norm_topk_prob=bool(md.get(f"{name}.expert_weights_norm", False)),
        )
    elif name == "gpt-oss":
        if scaling is not None:
            scaling["truncate"] = False  # gpt-oss's YaRN keeps the unrounded correction range (as HF's)
        cfg.update(
            num_local_experts=experts,
            intermediate_size=int(get("expert_feed_forward_length")),
            sliding_window=int(get("attention.sliding_window")),
            attention_bias="blk.0.attn_q.bias" in tensors,
        )
        if mxfp4_experts:
            cfg["quantization_config"] = {"quant_method": "mxfp4"}
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


def _deepseek_config(md: dict[str, Any], path: str, experts: int) -> dict[str, Any]:
    """DeepSeek-V2 / V3 / Kimi (deepseek2 files): MLA's widths, the routed and shared experts, the
    router. Newer converters write MLA as one latent KV head (key_length = kv_lora_rank + rope dims) and
    the per-head widths in key_length_mla / value_length_mla; older ones the per-head widths in
    key_length / value_length."""

    def get(key: str, default: Any = None) -> Any:
        value = md.get(f"deepseek2.{key}", default)
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks deepseek2.{key}")
        return value

    mla = "deepseek2.attention.key_length_mla" in md
    rope = int(get("rope.dimension_count"))
    qk_head = int(get("attention.key_length_mla" if mla else "attention.key_length"))
    v3 = int(md.get("deepseek2.expert_gating_func", 1)) == _SIGMOID
    groups = int(md.get("deepseek2.expert_group_count") or 1)
    cfg: dict[str, Any] = dict(
        kv_lora_rank=int(get("attention.kv_lora_rank")),
        q_lora_rank=int(md.get("deepseek2.attention.q_lora_rank") or 0) or None,
        qk_rope_head_dim=rope,
        qk_nope_head_dim=qk_head - rope,
        v_head_dim=int(get("attention.value_length_mla" if mla else "attention.value_length")),
        intermediate_size=int(get("feed_forward_length")),
        first_k_dense_replace=int(md.get("deepseek2.leading_dense_block_count") or 0),
        n_routed_experts=experts,
        moe_intermediate_size=int(get("expert_feed_forward_length")),
        n_shared_experts=int(md.get("deepseek2.expert_shared_count") or 0),
        routed_scaling_factor=f32(md.get("deepseek2.expert_weights_scale") or 1.0),
        n_group=groups,
        topk_group=int(md.get("deepseek2.expert_group_used_count") or 1),
    )
    if v3:  # the converter writes expert_weights_norm only when true
        cfg.update(
            architectures=["DeepseekV3ForCausalLM"],
            model_type="deepseek_v3",
            scoring_func="sigmoid",
            norm_topk_prob=bool(md.get("deepseek2.expert_weights_norm", False)),
            rope_interleave=True,  # llama.cpp rotates DeepSeek's adjacent pairs; the rows are not permuted
        )
    else:
        cfg["topk_method"] = "group_limited_greedy" if groups > 1 else "greedy"
    return cfg


def _granite_hybrid_config(
    md: dict[str, Any], tensors: Collection[str], path: str, kinds: list[str], hidden: int
) -> dict[str, Any]:
    """Granite 4.0-H (granitehybrid files): Mamba2 layers where the KV head count is 0; Granite's
    multipliers; the experts of feed_forward_length and the shared MLP of
    expert_shared_feed_forward_length; RoPE only where rope.scaling.finetuned says (the converter's
    flag for it; Granite 4.0-H has none)."""

    def get(key: str, default: Any = None) -> Any:
        value = md.get(f"granitehybrid.{key}", default)
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks granitehybrid.{key}")
        return value

    inner, heads = int(get("ssm.inner_size")), int(get("ssm.time_step_rank"))
    experts = int(md.get("granitehybrid.expert_count") or 0)
    cfg: dict[str, Any] = dict(
        layer_types=["attention" if k == "full_attention" else "mamba" for k in kinds],
        position_embedding_type="rope" if md.get("granitehybrid.rope.scaling.finetuned") else "nope",
        mamba_n_heads=heads,
        mamba_d_head=inner // heads,
        mamba_n_groups=int(get("ssm.group_count")),
        mamba_d_state=int(get("ssm.state_size")),
        mamba_d_conv=int(get("ssm.conv_kernel")),
        mamba_expand=inner // hidden,
        mamba_conv_bias=any(t.endswith("ssm_conv1d.bias") for t in tensors),
        mamba_proj_bias=any(t.endswith("ssm_in.bias") for t in tensors),
        attention_multiplier=f32(get("attention.scale", 1.0)),
        embedding_multiplier=f32(get("embedding_scale", 1.0)),
        residual_multiplier=f32(get("residual_scale", 1.0)),
        logits_scaling=f32(get("logit_scale", 1.0)),
        intermediate_size=int(get("feed_forward_length")),
        shared_intermediate_size=int(get("expert_shared_feed_forward_length", get("feed_forward_length"))),
        num_local_experts=experts,
    )
    if inner % hidden or inner % heads:
        raise ModelLoadError(f"{path}: ssm.inner_size {inner} must be a multiple of the width and the heads")
    if experts:
        cfg["num_experts_per_tok"] = int(get("expert_used_count"))
    return cfg


def _nemotron_h_config(
    md: dict[str, Any], tensors: Collection[str], path: str, kinds: list[str]
) -> dict[str, Any]:
    """Nemotron-H (nemotron_h files; the MoE nemotron_h_moe ones are refused by name): the block pattern
    from the per-layer counts (KV heads: attention "*", feed-forward width: MLP "-", neither: Mamba2
    "M"), the Mamba2 sizes, attention without position encoding."""

    def get(key: str, default: Any = None) -> Any:
        value = md.get(f"nemotron_h.{key}", default)
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks nemotron_h.{key}")
        return value

    ff = get("feed_forward_length")
    ff = ff if isinstance(ff, list) else [ff] * len(kinds)
    widths = {int(w) for w in ff if w}
    if len(widths) != 1:
        raise ModelLoadError(f"{path}: MLP widths {sorted(widths)} (one width for every MLP block expected)")
    inner, heads = int(get("ssm.inner_size")), int(get("ssm.time_step_rank"))
    pattern = "".join(
        "*" if k == "full_attention" else "-" if w else "M" for k, w in zip(kinds, ff, strict=True)
    )
    return dict(
        hybrid_override_pattern=pattern,
        intermediate_size=widths.pop(),
        mamba_num_heads=heads,
        mamba_head_dim=inner // heads,
        n_groups=int(get("ssm.group_count")),
        ssm_state_size=int(get("ssm.state_size")),
        conv_kernel=int(get("ssm.conv_kernel")),
        use_conv_bias=any(t.endswith("ssm_conv1d.bias") for t in tensors),
        use_bias=any(t.endswith("ssm_in.bias") for t in tensors),
        layer_norm_epsilon=f32(get("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings=False,
    )


def _ernie_moe_config(md: dict[str, Any], tensors: Collection[str], path: str, layers: int) -> dict[str, Any]:
    """ERNIE 4.5 MoE: the converter writes moe_layer_start_index as leading_dense_block_count and
    moe_layer_interval as interleave_moe_layer_step, and not moe_layer_end_index (llama.cpp runs every
    layer from the start sparse); the last layer with a router is taken as the end."""

    def get(key: str) -> Any:
        value = md.get(f"ernie4_5-moe.{key}")
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks ernie4_5-moe.{key}")
        return value

    routed = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in tensors]
    return dict(
        moe_num_experts=int(get("expert_count")),
        moe_k=int(get("expert_used_count")),
        moe_intermediate_size=int(get("expert_feed_forward_length")),
        moe_num_shared_experts=int(md.get("ernie4_5-moe.expert_shared_count") or 0),
        moe_layer_start_index=int(md.get("ernie4_5-moe.leading_dense_block_count") or 0),
        moe_layer_interval=int(md.get("ernie4_5-moe.interleave_moe_layer_step") or 1),
        moe_layer_end_index=routed[-1] if routed else -1,
    )
