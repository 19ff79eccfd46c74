"""Gemma 2/3 GGUF files, written here the way llama.cpp's converter writes them (tensor names of the gguf
package, every norm stored as 1 + w, Gemma 2's softcaps and Gemma 3's linear RoPE factor in the
metadata, 27B-style query scale rules), read back: the architecture as transformers configures the same
model, and the engine's greedy tokens equal to transformers' on the original weights.
"""

from __future__ import annotations

import random

import gguf
import numpy as np
import pytest
import torch

from overnight import LLM, SamplingParams
from overnight.loader.gguf import iter_gguf_weights
from overnight.loader.gguf_config import read_gguf
from tests.test_engine_parity import hf_greedy
from tests.test_gguf import gguf_writer

pytestmark = pytest.mark.slow  # real engines beside transformers

_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def tiny(arch: str):
    """Untied (a tiny random tied model repeats its last token); head_dim = hidden / heads, so the
    query scale is the same under either of llama.cpp's rules."""
    import transformers as tf

    common = dict(
        vocab_size=211,
        hidden_size=48,
        intermediate_size=80,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        query_pre_attn_scalar=12,
        max_position_embeddings=256,
        sliding_window=7,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    if arch == "gemma2":
        cfg = tf.Gemma2Config(
            **common, num_hidden_layers=4, attn_logit_softcapping=20.0, final_logit_softcapping=15.0
        )
        model = tf.Gemma2ForCausalLM(cfg)
    else:  # six layers: one full among five sliding, llama.cpp's fixed Gemma 3 pattern
        rope = {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
        }
        cfg = tf.Gemma3TextConfig(**common, num_hidden_layers=6, rope_parameters=rope)
        model = tf.Gemma3ForCausalLM(cfg)
    model.eval().set_attn_implementation("eager")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.2 * (torch.rand(p.shape, generator=gen) - 0.5))
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return model


def gguf_name(name: str) -> str:
    if name in _GLOBAL:
        return _GLOBAL[name]
    _, _, layer, rest = name.split(".", 3)
    return f"blk.{layer}.{_NAMES[rest]}"


def write_gguf(path: str, arch: str, model) -> None:
    cfg = model.config
    w = gguf_writer(path, arch, cfg)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    else:
        full = cfg.rope_parameters["full_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    w.add_eos_token_id(1)
    w.add_bos_token_id(2)
    for name, t in model.state_dict().items():
        a = t.numpy().astype(np.float32)
        if name.endswith("norm.weight"):
            a = a + 1.0  # llama.cpp stores Gemma's norms as 1 + w
        w.add_tensor(gguf_name(name), a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_gguf_matches_transformers(arch, tmp_path):
    model = tiny(arch)
    path = str(tmp_path / f"{arch}.gguf")
    write_gguf(path, arch, model)

    info = read_gguf(path)
    a, cfg = info.arch, model.config
    assert info.hf_architecture == f"{arch.capitalize()}ForCausalLM"
    assert [a.layer_window(i) for i in range(a.num_hidden_layers)] == [
        cfg.sliding_window if t == "sliding_attention" else None for t in cfg.layer_types
    ]
    assert a.attention_scale == pytest.approx(cfg.query_pre_attn_scalar**-0.5)
    if arch == "gemma3":
        assert (a.rope_theta, a.local_rope_theta, a.rope_factor) == (100000.0, 10000.0, 4.0)
    else:
        assert (a.attn_logit_softcapping, a.final_logit_softcapping) == (20.0, 15.0)
    weights = dict(iter_gguf_weights(path))
    norm = "model.layers.1.post_feedforward_layernorm.weight"
    torch.testing.assert_close(weights[norm], model.state_dict()[norm])  # 1 + w read back as w

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 211) for _ in range(n)] for n in (3, 11, 20, 33)]
    llm = LLM(
        path, skip_tokenizer_init=True, dtype="float32", kv_cache_memory_bytes=4 << 20, max_model_len=64
    )
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 8)[0], f"prompt of {len(prompt)} tokens"
    assert len({t for out in outs for t in out.outputs[0].token_ids}) > 12  # varied: not an echo
