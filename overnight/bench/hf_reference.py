"""A transformers model for the same source as ours: the comparison engine in benchmarks and the
reference in parity checks. GGUF sources get our dequantized weights (transformers' own GGUF import
takes tens of seconds); dummy sources get transformers' own random init."""

from __future__ import annotations

import torch

from overnight.arch import ModelArch
from overnight.loader.source import ModelSource


def hf_config(arch: ModelArch, hf_architecture: str):
    import transformers

    common = dict(
        vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_hidden_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads,
        head_dim=arch.head_dim,
        rms_norm_eps=arch.rms_norm_eps,
        max_position_embeddings=arch.max_position_embeddings,
        tie_word_embeddings=arch.tie_word_embeddings,
    )
    # Other families' blocks differ from Llama's in ways a LlamaConfig cannot say: refuse them rather
    # than compare against a different model (a checkpoint folder loads with its own class instead).
    unlike_llama = [
        name
        for name, differs in (
            ("sliding windows", bool(arch.layer_types)),
            ("partial or interleaved rotary", arch.rotary_dim != arch.head_dim or arch.rope_interleaved),
            ("per-layer RoPE", bool(arch.no_rope_layers) or arch.sliding_rope_theta is not None),
            ("norm placement", arch.norm_placement != "pre" or arch.qk_norm_whole),
            ("multipliers", arch.attention_multiplier is not None or arch.logits_scaling != 1.0),
            ("experts", arch.num_experts > 0 and arch.architecture != "qwen3_moe"),
        )
        if differs
    ]
    if unlike_llama:
        raise ValueError(
            f"no random transformers reference for {arch.architecture}: {', '.join(unlike_llama)}"
        )
    rope: dict = {"rope_type": "default", "rope_theta": arch.rope_theta}
    if arch.rope_scaling:
        rope = {"rope_type": "llama3", "rope_theta": arch.rope_theta, **arch.rope_scaling_dict()}
    if arch.architecture == "qwen3_moe":
        cls = transformers.Qwen3MoeConfig
        common.update(
            num_experts=arch.num_experts,
            num_experts_per_tok=arch.num_experts_per_tok,
            moe_intermediate_size=arch.moe_intermediate_size,
            norm_topk_prob=arch.norm_topk_prob,
            decoder_sparse_step=arch.decoder_sparse_step,
            mlp_only_layers=list(arch.mlp_only_layers),
        )
    elif arch.architecture == "qwen3":
        cls = transformers.Qwen3Config
    elif arch.architecture == "qwen2":
        cls = transformers.Qwen2Config
    else:
        cls = transformers.LlamaConfig
        common["attention_bias"] = arch.attention_bias
    return cls(**common, rope_parameters=rope)


def build_hf_model(source: ModelSource, device: torch.device, dummy: bool, dtype: torch.dtype | None = None):
    import transformers

    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if source.kind == "hf" and not dummy:
        return transformers.AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype).to(device).eval()
    config = hf_config(source.arch, source.hf_architecture)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    if source.kind == "gguf" and not dummy:
        from overnight.loader.gguf import iter_gguf_weights

        state = {name: t.to(dtype) for name, t in iter_gguf_weights(source.path)}
        model.load_state_dict(state, strict=False)
        if source.arch.tie_word_embeddings:
            model.tie_weights()
    return model.to(device).eval()
