"""GGUF files of OLMoE, Seed-OSS, ERNIE 4.5 (dense and MoE), EXAONE 4.0 and Command R / R+ / Cohere 2
(loader/gguf_families.py; the hybrid families: tests/test_gguf_hybrid_families.py), written from tiny
random transformers models the way llama.cpp's converter writes them (tests/gguf_writers.py), one tensor
each in Q8_0 (the reference model holding the round-tripped values): the arch read back equals the HF
folder's and the engine's greedy tokens equal transformers' in fp32. Also: a tensor type the gguf
package cannot dequantize is refused on reading."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from overnight import LLM
from overnight.errors import ModelLoadError
from overnight.loader.gguf_config import read_gguf
from overnight.loader.resolve import resolve_source
from tests.gguf_writers import (
    check_tokens,
    converter_writer,
    finish,
    mapped,
    quantize_in_place,
    split_experts,
)
from tests.tiny_models import _spread_weights
from tests.tiny_moe import ENGINE, check_waves_token_exact, waves

pytestmark = pytest.mark.slow  # engines beside transformers

# ------------------------------------------------------------------------ OLMoE, Seed-OSS, ERNIE 4.5

DENSE_AND_MOE = {
    # OLMoE: whole-projection q/k norms, 8 experts top-2 without renormalization
    "olmoe": (
        "Olmoe",
        gguf.MODEL_ARCH.OLMOE,
        dict(
            intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            rms_norm_eps=1e-5,
        ),
    ),
    # Seed-OSS: biases on q/k/v and on o_proj, head_dim apart from hidden / heads
    "seed_oss": (
        "SeedOss",
        gguf.MODEL_ARCH.SEED_OSS,
        dict(
            intermediate_size=96, head_dim=24, attention_bias=True, attention_out_bias=True, rms_norm_eps=1e-6
        ),
    ),
    "ernie4_5": (
        "Ernie4_5",
        gguf.MODEL_ARCH.ERNIE4_5,
        dict(intermediate_size=96, head_dim=16, use_bias=False),
    ),
    # ERNIE 4.5 MoE: the first layer dense, then experts plus a shared one, the softmax + correction-bias
    # router (every layer from the start sparse: llama.cpp's rule)
    "ernie4_5_moe": (
        "Ernie4_5_Moe",
        gguf.MODEL_ARCH.ERNIE4_5_MOE,
        dict(
            intermediate_size=96,
            head_dim=16,
            use_bias=False,
            moe_num_experts=8,
            moe_k=2,
            moe_intermediate_size=32,
            moe_num_shared_experts=1,
            moe_layer_start_index=1,
            moe_layer_end_index=-1,
            moe_layer_interval=1,
        ),
    ),
}


def _ernie_moe_metadata(w: gguf.GGUFWriter, cfg) -> None:
    """What convert_hf_to_gguf.py's Ernie4_5MoeModel adds to the base metadata."""
    w.add_expert_count(cfg.moe_num_experts)
    w.add_expert_used_count(cfg.moe_k)
    w.add_interleave_moe_layer_step(cfg.moe_layer_interval)
    w.add_leading_dense_block_count(cfg.moe_layer_start_index)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_count(cfg.moe_num_shared_experts)


@pytest.mark.parametrize("variant", sorted(DENSE_AND_MOE))
def test_dense_and_moe_gguf_token_exact(tmp_path, variant):
    import transformers

    family, gguf_arch, fields = DENSE_AND_MOE[variant]
    common = dict(
        vocab_size=384, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip
    cfg = getattr(transformers, f"{family}Config")(**{**common, **fields})
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(cfg).eval()
    _spread_weights(model, 0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("e_score_correction_bias"):  # transformers starts it at zeros
                param.copy_(0.05 * torch.randn(param.shape))
    quantize_in_place(model.model.layers[1].self_attn.v_proj.weight, Q.Q8_0, transposed=False)
    model.save_pretrained(tmp_path / "hf")
    path = tmp_path / f"{variant}.gguf"
    w = converter_writer(path, gguf.MODEL_ARCH_NAMES[gguf_arch], cfg)
    if variant == "ernie4_5_moe":
        _ernie_moe_metadata(w, cfg)
    tensors = mapped(model.state_dict(), gguf_arch, cfg.num_hidden_layers, split_experts)
    finish(w, tensors, {"blk.1.attn_v.weight": Q.Q8_0})

    info = read_gguf(str(path))
    assert info.hf_architecture == f"{family}ForCausalLM"
    assert info.arch == resolve_source(str(tmp_path / "hf")).arch
    llm = LLM(str(path), **ENGINE)
    check_waves_token_exact(llm, model, waves(cfg.vocab_size))


# ------------------------------------------------------------------------------------------ EXAONE 4.0


def _llama3_rope_freqs(cfg) -> np.ndarray:
    """The per-frequency divisors the converter writes as rope_freqs.weight for Llama 3 RoPE scaling."""
    rope = cfg.rope_parameters
    dim = cfg.head_dim
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_exaone4_gguf_token_exact(tmp_path):
    """The 32B's shape: sliding / full without RoPE / sliding, Llama 3 RoPE as rope_freqs."""
    variant = "exaone4"
    from tests.dense_family_checks import make_model

    # Llama 3 scaling with two frequencies between its bands, the least rope_freqs recovers it from
    changes = {}
    if variant == "exaone4":
        rope = dict(
            rope_type="llama3", rope_theta=10000.0, factor=4.0, low_freq_factor=1.0, high_freq_factor=8.0
        )
        changes["rope_parameters"] = {**rope, "original_max_position_embeddings": 128}
    model = make_model(variant, **changes)
    cfg = model.config
    quantize_in_place(model.model.layers[2].mlp.down_proj.weight, Q.Q8_0, transposed=False)
    model.save_pretrained(tmp_path / "hf")
    path = tmp_path / f"{variant}.gguf"
    w = converter_writer(path, "exaone4", cfg)
    w.add_vocab_size(cfg.vocab_size)
    extra = {}
    if cfg.sliding_window is not None:
        w.add_sliding_window(cfg.sliding_window)
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    if cfg.rope_parameters.get("rope_type") == "llama3":
        extra["rope_freqs.weight"] = _llama3_rope_freqs(cfg)
    sd = dict(model.state_dict())
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight")  # a tied checkpoint has none
    tensors = mapped(sd, gguf.MODEL_ARCH.EXAONE4, cfg.num_hidden_layers, lambda name, a: None)
    finish(w, {**tensors, **extra}, {"blk.2.ffn_down.weight": Q.Q8_0})

    info = read_gguf(str(path))
    assert info.hf_architecture == "Exaone4ForCausalLM"
    hf = resolve_source(str(tmp_path / "hf")).arch
    # The divisors fix Llama 3's band only up to an equivalent (orig, low, high): the factor is the same,
    # and the frequencies it gives (every position's rotation) are checked by the tokens.
    assert dict(info.arch.rope_scaling or {}).get("factor") == dict(hf.rope_scaling or {}).get("factor")
    assert dataclasses.replace(info.arch, rope_scaling=hf.rope_scaling) == hf
    llm = LLM(str(path), **ENGINE)
    check_waves_token_exact(llm, model, waves(cfg.vocab_size))


# ----------------------------------------------------------------------------- Command R, Cohere 2


@pytest.mark.parametrize("variant", ["cohere", "cohere-plus", "cohere2"])
def test_cohere_gguf_token_exact(tmp_path, variant):
    """Command R (tied, logit scale), R+ (per-head q/k norms) and Cohere 2 with llama.cpp's fixed window
    pattern (three sliding layers, then a full one without RoPE)."""
    from tests.dense_family_checks import make_model

    # Cohere 2's files are always tied (llama.cpp's cohere2 has no output tensor)
    changes = (
        dict(num_hidden_layers=4, sliding_window_pattern=4, tie_word_embeddings=True)
        if variant == "cohere2"
        else {}
    )
    model = make_model(variant, **changes)
    cfg = model.config
    quantize_in_place(model.model.layers[1].self_attn.o_proj.weight, Q.Q8_0, transposed=False)
    model.save_pretrained(tmp_path / "hf")
    path = tmp_path / f"{variant}.gguf"
    arch = "cohere2" if variant == "cohere2" else "command-r"
    w = converter_writer(path, arch, SimpleNamespace(**{**cfg.to_dict(), "head_dim": None}))
    w.add_layer_norm_eps(cfg.layer_norm_eps)
    w.add_logit_scale(cfg.logit_scale)
    if variant == "cohere2":
        w.add_sliding_window(cfg.sliding_window)
        w.add_vocab_size(cfg.vocab_size)
        w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    sd = dict(model.state_dict())
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight")
    gguf_arch = gguf.MODEL_ARCH.COHERE2 if variant == "cohere2" else gguf.MODEL_ARCH.COMMAND_R
    tensors = mapped(sd, gguf_arch, cfg.num_hidden_layers, lambda name, a: None)
    finish(w, tensors, {"blk.1.attn_output.weight": Q.Q8_0})

    info = read_gguf(str(path))
    assert info.hf_architecture == ("Cohere2ForCausalLM" if variant == "cohere2" else "CohereForCausalLM")
    assert info.arch == resolve_source(str(tmp_path / "hf")).arch
    check_tokens(LLM(str(path), **ENGINE), model, waves(cfg.vocab_size))


def test_unsupported_tensor_type_is_refused_before_loading(tmp_path):
    """A tensor type the gguf package cannot dequantize (Q8_1, llama.cpp's activation-only type) is named
    when the file is read, before any model is built."""
    from tests.dense_family_checks import make_model

    model = make_model("seed_oss")
    path = tmp_path / "q8_1.gguf"
    w = converter_writer(path, "seed_oss", model.config)
    tensors = mapped(
        model.state_dict(), gguf.MODEL_ARCH.SEED_OSS, model.config.num_hidden_layers, lambda n, a: None
    )
    raw = np.zeros((96, 64 // 32 * 40), dtype=np.uint8)  # [96, 64] in Q8_1 blocks of 32 values, 40 bytes
    del tensors["blk.1.ffn_up.weight"]
    for name, a in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))
    w.add_tensor("blk.1.ffn_up.weight", raw, raw_dtype=Q.Q8_1)
    finish(w, {}, {})
    with pytest.raises(
        ModelLoadError, match=r"type Q8_1 cannot be dequantized \(first: blk\.1\.ffn_up\.weight\)"
    ):
        read_gguf(str(path))
