"""GGUF files of the dense families llama.cpp names (olmo2, granite, and Mixtral as a llama file with
stacked experts), written here from tiny transformers models the way llama.cpp's converter lays them out:
the architecture read back must equal the safetensors one, and the model must give the same logits."""

from __future__ import annotations

import dataclasses
import math

import gguf
import numpy as np
import pytest
import torch

from overnight.loader.gguf_config import read_gguf
from overnight.loader.model_loader import load_model
from overnight.loader.resolve import resolve_source
from tests.parity_helpers import GLOBAL_TO_GGUF, LAYER_TO_GGUF
from tests.test_gguf import converter_permute, gguf_writer
from tests.test_models import PagedCache
from tests.tiny_families import make_family_checkpoint, make_family_model

LAYER_NAMES = {
    **LAYER_TO_GGUF,
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
}
GGUF_ARCH = {
    "olmo2": "olmo2",
    "olmo3": "olmo2",
    "granite": "granite",
    "mixtral": "llama",
    "phi3": "phi3",
    "glm4": "glm4",
    "smollm3": "smollm3",
}
# SmolLM3 as llama.cpp can hold it: NoPE on every 4th layer (its fixed rule), no window.
CHANGES = {"smollm3": dict(num_hidden_layers=4, no_rope_layers=None, use_sliding_window=False)}


def _tensors(variant: str, sd: dict[str, torch.Tensor], cfg) -> dict[str, np.ndarray]:
    out = {}
    for name, t in sd.items():
        a = t.numpy().astype(np.float32)
        if name in GLOBAL_TO_GGUF:
            out[GLOBAL_TO_GGUF[name]] = a
            continue
        _, _, layer, rest = name.split(".", 3)
        if GGUF_ARCH[variant] in ("llama", "granite", "smollm3"):  # the converter's q/k row order
            if rest == "self_attn.q_proj.weight":
                a = converter_permute(a, cfg.num_attention_heads)
            elif rest == "self_attn.k_proj.weight":
                a = converter_permute(a, cfg.num_key_value_heads)
        if rest == "mlp.experts.gate_up_proj":  # [E, 2I, H] -> stacked gate and up
            gate, up = np.split(a, 2, axis=1)
            out[f"blk.{layer}.ffn_gate_exps.weight"] = np.ascontiguousarray(gate)
            out[f"blk.{layer}.ffn_up_exps.weight"] = np.ascontiguousarray(up)
        elif rest == "mlp.experts.down_proj":
            out[f"blk.{layer}.ffn_down_exps.weight"] = a
        elif rest == "self_attn.qkv_proj.weight":  # Phi-3: fused in the checkpoint and the file
            out[f"blk.{layer}.attn_qkv.weight"] = a
        elif rest == "mlp.gate_up_proj.weight":  # Phi-3: gate and up, both in ffn_up
            out[f"blk.{layer}.ffn_up.weight"] = a
        elif rest == "post_self_attn_layernorm.weight":  # GLM-4's sandwich norms
            out[f"blk.{layer}.post_attention_norm.weight"] = a
        elif rest == "post_mlp_layernorm.weight":
            out[f"blk.{layer}.post_ffw_norm.weight"] = a
        elif variant.startswith("olmo") and rest == "post_attention_layernorm.weight":
            out[f"blk.{layer}.post_attention_norm.weight"] = a  # OLMo 2's norm after attention
        else:
            out[f"blk.{layer}.{LAYER_NAMES[rest]}"] = a
    return out


def write_family_gguf(path: str, variant: str) -> None:
    model = make_family_model(variant, **CHANGES.get(variant, {}))
    cfg = model.config
    arch = GGUF_ARCH[variant]
    w = gguf_writer(path, arch, cfg)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)  # OLMo 3: one per layer kind
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if cfg.rope_parameters.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(cfg.rope_parameters["factor"])
    if variant == "granite":
        w.add_float32(f"{arch}.attention.scale", cfg.attention_multiplier)
        w.add_float32(f"{arch}.embedding_scale", cfg.embedding_multiplier)
        w.add_float32(f"{arch}.residual_scale", cfg.residual_multiplier)
        w.add_float32(f"{arch}.logit_scale", cfg.logits_scaling)
    if variant == "phi3":  # as llama.cpp's converter writes Phi-3 (LongRoPE factors as tensors)
        rope = cfg.rope_parameters
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        w.add_rope_dimension_count(int(head_dim * rope["partial_rotary_factor"]))
        w.add_sliding_window(cfg.sliding_window or 0)
        w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        scale = cfg.max_position_embeddings / cfg.original_max_position_embeddings
        w.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(cfg.original_max_position_embeddings))
        )
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    if variant == "olmo3":  # as llama.cpp's converter writes OLMo 3: window, pattern, YaRN
        w.add_sliding_window(cfg.sliding_window)
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_attn_factors(0.1 * math.log(rope["factor"]) + 1.0)
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if variant == "glm4":
        w.add_key_length(cfg.head_dim)
        w.add_rope_dimension_count(int(cfg.head_dim * cfg.rope_parameters["partial_rotary_factor"]))
    if variant == "mixtral":
        w.add_expert_count(cfg.num_local_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    w.add_eos_token_id(2)
    for name, a in _tensors(variant, model.state_dict(), cfg).items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("variant", sorted(GGUF_ARCH))
def test_family_gguf_reads_like_safetensors(tmp_path, variant):
    path = str(tmp_path / f"{variant}.gguf")
    write_family_gguf(path, variant)
    folder = make_family_checkpoint(tmp_path, variant, **CHANGES.get(variant, {}))
    info, hf = read_gguf(path), resolve_source(str(folder)).arch
    # A llama file carries no sliding window (Mixtral's tiny model has one; the prompt stays inside it);
    # Phi-3's file states LongRoPE's attention factor, which the config leaves to be derived.
    same = dict(layer_types=hf.layer_types, sliding_window=hf.sliding_window) if variant == "mixtral" else {}
    scaling = dict(info.arch.rope_scaling or ())
    if variant == "phi3":
        assert scaling.pop("attention_factor") == pytest.approx(math.sqrt(1 + math.log(8) / math.log(32)))
    if variant == "olmo3":
        assert scaling.pop("attention_factor") == pytest.approx(0.1 * math.log(4) + 1)
        assert hf.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
        assert hf.layer_types and hf.sliding_window == 7
    assert dataclasses.replace(info.arch, rope_scaling=tuple(scaling.items()) or None, **same) == hf
    ours = load_model(resolve_source(path), torch.float32, "cpu")
    ref = load_model(resolve_source(str(folder)), torch.float32, "cpu")
    # Within the window of 7 for Mixtral (its llama file has none), past it for the others.
    prompt = [5, 17, 99, 3, 150, 42] + ([] if variant == "mixtral" else [7, 8, 9, 10, 11, 12])
    (got,) = PagedCache(ours.arch).step(ours, [("a", prompt)])
    (expected,) = PagedCache(ref.arch).step(ref, [("a", prompt)])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
