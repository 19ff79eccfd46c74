"""FP8 weights end to end on the CPU: online quantization of tiny random Qwen3 and Llama models, tiny FP8
checkpoints in every layout the loader reads (tests/fp8_checkpoints.py), the checkpoint errors, dummy
weights, options, and the engine.

Agreement criterion. The quantized model against the same model with its weights replaced by their
dequantized values (quant/apply.py dequantize_model), so only the per-token activation quantization
differs: 16 prompts, 4 greedy tokens of the dequantized model each; teacher-forced on those, the
quantized model's top-1 token agrees at >= 85% of positions and the mean |logprob difference| of the
reference's tokens is <= 0.15 nats; the quantized model's own greedy continuation is identical for at least half
of the prompts. Measured here: 90-98% top-1, 0.08-0.11 nats, 10-15 of 16. e4m3 rounds each
activation by up to 6%, and on 64-wide random models that moves logits by ~0.1 nats, flipping the
closest decisions; a single wrong scale (test_the_criterion_catches_a_wrong_scale) fails all three.
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from overnight import LLM
from overnight.errors import ConfigError, ModelLoadError
from overnight.kernels import dispatch
from overnight.loader.model_loader import load_model
from overnight.loader.resolve import resolve_source
from overnight.options import EngineOptions
from overnight.quant.apply import dequantize_model, quantize_model
from overnight.quant.fp8 import FP8_DTYPE, dequantize_weight, expand_block_scales, quantize_weight_per_channel
from overnight.quant.linear import Fp8Linear
from overnight.quant.scheme import QuantScheme, check_fp8_device, resolve_quantization, scheme_from_hf_config
from overnight.tools.budget import DeviceMemory, plan_budget
from tests.fp8_checkpoints import LAYOUTS, fake_quantized_float_checkpoint, make_fp8_checkpoint
from tests.kernel_helpers import DEVICE, ENGINE, NEAR_TIE, agreement, greedy
from tests.parity_helpers import (
    MAX_DLOGPROB,
    MIN_SAME_GREEDY,
    MIN_TOP1,
    PROMPTS,
    compare,
)
from tests.tiny_models import make_tiny_checkpoint
from tests.triton_fp8 import exact_fp8_casts

pytestmark = pytest.mark.slow  # real engines and checkpoints

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


# -- the harness: whole sequences through the model, no engine -----------------------------------------


def assert_agrees_with_dequantized(model: nn.Module) -> None:
    agree = compare(model, dequantize_model(copy.deepcopy(model)))
    assert agree.ok, agree


def fp8_layers(model: nn.Module) -> dict[str, Fp8Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Fp8Linear)}


# -- fixtures ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8w")
    return {family: make_tiny_checkpoint(root, family) for family in ("qwen3", "llama")}


@pytest.fixture(scope="module")
def checkpoints(folders, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8ckpt")
    return {layout: make_fp8_checkpoint(folders["qwen3"], root / layout, layout) for layout in LAYOUTS}


# -- online quantization -----------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_online_quantization_agrees_with_dequantized_model(folders, family):
    model = load_model(resolve_source(str(folders[family]), quantization="fp8"), torch.float32, "cpu")
    layers = fp8_layers(model)
    assert {n.rpartition(".")[2] for n in layers} == set(PROJECTIONS)
    assert len(layers) == 4 * model.arch.num_hidden_layers
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight.dtype == torch.float32
    layer = model.model.layers[0]
    assert layer.input_layernorm.fp8_output and layer.post_attention_layernorm.fp8_output
    assert layer.mlp.act_fn.fp8_output and not model.model.norm.fp8_output
    # each checkpoint projection quantized per row, fused with its scales
    float_weights = load_file(str(folders[family] / "model.safetensors"))
    prefix = "model.layers.1.self_attn."
    parts = [
        quantize_weight_per_channel(float_weights[f"{prefix}{p}.weight"])
        for p in ("q_proj", "k_proj", "v_proj")
    ]
    qkv = model.model.layers[1].self_attn.qkv_proj
    assert torch.equal(qkv.weight.view(torch.uint8), torch.cat([d for d, _ in parts]).view(torch.uint8))
    assert torch.equal(qkv.weight_scale, torch.cat([s for _, s in parts]))
    assert_agrees_with_dequantized(model)


def test_the_criterion_catches_a_wrong_scale(folders):
    model = load_model(resolve_source(str(folders["qwen3"]), quantization="fp8"), torch.float32, "cpu")
    reference = dequantize_model(copy.deepcopy(model))
    with torch.no_grad():  # the "up" half of one layer's gate_up scales off by 2x
        scale = model.model.layers[0].mlp.gate_up_proj.weight_scale
        scale[scale.shape[0] // 2 :] *= 2
    agree = compare(model, reference)
    assert (
        agree.top1 < MIN_TOP1 and agree.mean_dlogprob > MAX_DLOGPROB and agree.same_greedy < MIN_SAME_GREEDY
    ), agree


class KernelPath(nn.Module):
    """The same model run with the Triton kernels on (the interpreter on the CPU)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.inner, self.arch = model, model.arch

    def forward(self, *args):
        previous, dispatch.FORCE_KERNELS = dispatch.FORCE_KERNELS, True
        try:
            with exact_fp8_casts():
                return self.inner(*args)
        finally:
            dispatch.FORCE_KERNELS = previous

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.inner.compute_logits(hidden)


@pytest.mark.parametrize("layout", ["per-channel", "blocks"])
def test_kernel_path_agrees_with_reference_path(folders, layout):
    """The whole quantized model with the Triton kernels: the fused norm / SiLU quantization, o_proj's
    per-token quantization, the Triton GEMMs (per channel, and blocks kept), against the PyTorch path.
    Not to the ulp: where the two round an fp32 value differently in its last bit, a quantized value
    can land on the neighbouring e4m3 code, and the model carries that on; hence the criterion."""
    source = resolve_source(str(folders["qwen3"]), quantization="fp8")
    if layout == "blocks":
        source = replace(source, quantization=QuantScheme(weight_block=(16, 32), keep_blocks=True))
    model = load_model(source, torch.float32, DEVICE)  # the kernels compiled on a GPU host
    # few, short prompts: the interpreter runs a program per row
    agree = compare(KernelPath(model), model, [p[:6] for p in PROMPTS[:4]], steps=2)
    assert agree.ok, agree


# -- FP8 checkpoints -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_checkpoint_layout_loads_and_agrees(checkpoints, layout):
    folder = checkpoints[layout]
    source = resolve_source(str(folder))
    scheme = source.quantization
    assert scheme is not None and scheme.prequantized
    model = load_model(source, torch.float32, "cpu")
    layers = fp8_layers(model)
    assert len(layers) == 4 * model.arch.num_hidden_layers
    stored = load_file(str(folder / "model.safetensors"))
    k_proj = "model.layers.1.self_attn.k_proj"
    k_rows = slice(model.arch.q_size, model.arch.q_size + model.arch.kv_size)
    qkv = model.model.layers[1].self_attn.qkv_proj
    checkpoint_k = dequantize_weight(
        stored[f"{k_proj}.weight"],
        expand_block_scales(
            stored[f"{k_proj}.{scheme.scale_name}"], scheme.weight_block[0], model.arch.kv_size
        )
        if scheme.weight_block
        else stored[f"{k_proj}.{scheme.scale_name}"].reshape(-1).expand(model.arch.kv_size),
    )
    loaded_k = dequantize_weight(qkv.weight[k_rows], qkv.weight_scale[k_rows])
    if scheme.weight_block is None:  # per tensor / channel: the checkpoint's bytes, scales per row
        assert torch.equal(qkv.weight[k_rows].view(torch.uint8), stored[f"{k_proj}.weight"].view(torch.uint8))
        assert torch.equal(loaded_k, checkpoint_k)
    else:  # requantized per channel: a second rounding, at most half a step
        assert qkv.weight_scale.dim() == 1
        assert ((loaded_k - checkpoint_k).abs() <= checkpoint_k.abs() * 2.0**-4 + 1e-6).all()
    assert_agrees_with_dequantized(model)


def test_block_checkpoint_kept_as_blocks(checkpoints):
    source = resolve_source(str(checkpoints["fp8-block-small"]))
    source = replace(source, quantization=replace(source.quantization, keep_blocks=True))
    model = load_model(source, torch.float32, "cpu")
    stored = load_file(str(checkpoints["fp8-block-small"] / "model.safetensors"))
    down = model.model.layers[0].mlp.down_proj
    assert down.block_k == 32 and down.weight_scale.shape == (64, 4)
    name = "model.layers.0.mlp.down_proj"
    assert torch.equal(down.weight.view(torch.uint8), stored[f"{name}.weight"].view(torch.uint8))
    assert torch.equal(down.weight_scale, expand_block_scales(stored[f"{name}.weight_scale_inv"], 16, 64))
    assert_agrees_with_dequantized(model)


def _rewrite(folder, tmp_path, edit_tensors=None, edit_config=None, name="edited"):
    out = tmp_path / name
    out.mkdir()
    tensors = load_file(str(folder / "model.safetensors"))
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    if edit_config:
        edit_config(config)
    (out / "config.json").write_text(json.dumps(config))
    return out


def _load(folder):
    return load_model(resolve_source(str(folder)), torch.float32, "cpu")


def test_missing_scale_tensor(checkpoints, tmp_path):
    name = "model.layers.1.self_attn.k_proj.weight_scale_inv"
    folder = _rewrite(checkpoints["fp8-block"], tmp_path, lambda t: t.pop(name))
    with pytest.raises(ModelLoadError, match=f"every FP8 weight needs its scale.*missing: {name}"):
        _load(folder)


def test_misshapen_scale_tensor(checkpoints, tmp_path):
    name = "model.layers.0.mlp.down_proj.weight_scale_inv"
    folder = _rewrite(checkpoints["fp8-block-small"], tmp_path, lambda t: t.update({name: torch.ones(3, 4)}))
    with pytest.raises(
        ModelLoadError, match=r"down_proj.weight_scale_inv is \[3, 4\]; .* 16 x 32 blocks needs \[4, 4\]"
    ):
        _load(folder)


def test_bad_input_scale_and_fp8_lm_head(checkpoints, tmp_path):
    name = "model.layers.0.self_attn.q_proj.input_scale"
    folder = _rewrite(
        checkpoints["ct-tensor-static"], tmp_path, lambda t: t.update({name: torch.tensor(0.0)})
    )
    with pytest.raises(ModelLoadError, match="input_scale must hold positive finite scales"):
        _load(folder)
    folder = _rewrite(
        checkpoints["ct-channel-dynamic"],
        tmp_path,
        lambda t: t.update({"lm_head.weight": t["lm_head.weight"].to(FP8_DTYPE)}),
        name="fp8-head",
    )
    with pytest.raises(ModelLoadError, match="lm_head.weight is FP8, but lm_head is not an FP8 layer"):
        _load(folder)


@pytest.mark.parametrize(
    "qc, match",
    [
        ({"quant_method": "bitsandbytes", "bits": 4}, "quantization method 'bitsandbytes' is not supported"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "FP8 format 'e5m2' is not supported"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "two positive integers"),
        ({"quant_method": "fp8", "weight_block_size": [128, 16]}, "16 columns is not supported"),
        (
            {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {}}},
            "compressed-tensors quantization_config is malformed",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "group"}}},
            },
            "strategy 'group'",
        ),
    ],
)
def test_unsupported_quantization_configs(checkpoints, tmp_path, qc, match):
    folder = _rewrite(
        checkpoints["fp8-block"], tmp_path, edit_config=lambda c: c.update(quantization_config=qc)
    )
    with pytest.raises(ModelLoadError, match=match):
        resolve_source(str(folder))


# -- schemes, options, devices -------------------------------------------------------------------------------


def test_published_configs_parse():
    qwen = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    }
    scheme = scheme_from_hf_config(qwen)
    assert scheme == QuantScheme(prequantized=True, weight_block=(128, 128), scale_name="weight_scale_inv")
    assert scheme.block_k is None  # requantized per channel by default
    assert replace(scheme, keep_blocks=True).block_k == 128
    ct = scheme_from_hf_config(LAYOUTS["ct-tensor-static"][0])
    assert ct.input_scales and ct.weight_block is None and ct.scale_name == "weight_scale"
    assert ct.ignores("lm_head") and not ct.ignores("model.layers.0.mlp.down_proj")
    assert QuantScheme(ignore=("re:.*layers\\.0\\..*",)).ignores("model.layers.0.mlp.down_proj")
    assert "per token" in scheme.describe() and "128x128" in scheme.describe()


def test_option_resolution(checkpoints, folders):
    assert resolve_quantization(None, None) is None
    assert resolve_quantization("fp8", None) == QuantScheme()
    ckpt = QuantScheme(prequantized=True)
    assert resolve_quantization("fp8", ckpt) is ckpt and resolve_quantization(None, ckpt) is ckpt
    with pytest.raises(ConfigError, match="unknown quantization 'int4'; supported: fp8"):
        resolve_quantization("int4", None)
    fp8_folder = str(checkpoints["fp8-block"])
    assert resolve_source(fp8_folder, quantization="fp8") == resolve_source(fp8_folder)
    assert resolve_source(str(folders["qwen3"])).quantization is None


def test_gpu_without_fp8_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(
        ConfigError, match=r"compute capability 8.9 or newer.*A100 is 8.0.*drop --quantization fp8"
    ):
        check_fp8_device("cuda:0", QuantScheme())
    with pytest.raises(ConfigError, match="bf16 checkpoint"):
        check_fp8_device("cuda:0", QuantScheme(prequantized=True))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_fp8_device("cuda:0", QuantScheme())
    check_fp8_device("cpu", QuantScheme())


def test_dummy_weights_are_the_quantized_float_dummy(folders):
    source = resolve_source(str(folders["llama"]), "dummy")
    quantized = load_model(replace(source, quantization=QuantScheme()), torch.float32, "cpu", seed=5)
    expected = quantize_model(load_model(source, torch.float32, "cpu", seed=5), QuantScheme())
    a, b = dict(quantized.named_parameters()), dict(expected.named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name


def test_budget_counts_fp8_weights():
    source = resolve_source("qwen3-8b", "dummy")
    arch = source.arch
    bf16, fp8 = arch.weight_bytes(2), arch.weight_bytes(2, fp8_linear=True)
    assert bf16 == arch.num_parameters() * 2
    assert 0.5 * bf16 < fp8 < 0.62 * bf16  # projections halve; embeddings and LM head stay bf16
    gpu = DeviceMemory("H200", 141 << 30, 140 << 30)
    opts = EngineOptions(model="qwen3-8b", load_format="dummy", dtype="bfloat16", mode="batch")
    plain = plan_budget(opts, source, gpu)
    quant = plan_budget(opts, resolve_source("qwen3-8b", "dummy", "fp8"), gpu)
    assert quant.weights_bytes == fp8 and quant.budget_bytes - plain.budget_bytes == bf16 - fp8


# -- the engine ----------------------------------------------------------------------------------------------


def test_engine_online_fp8_agrees_with_fake_quantized_float_model(folders, tmp_path):
    """LLM(quantization="fp8") against LLM on the same checkpoint with each projection replaced by its
    FP8 round trip: the greedy tokens agree until a near-tie, with each side's token in the other's top
    5 (the FP8 KV cache's criterion, tests/test_fp8_kv.py). Over 16 tokens the activation rounding
    reaches a near-tie in most prompts: measured 48% of positions before the first divergence, every
    divergence within 0.45 nats, 0.06 nats mean |logprob difference| before it."""
    reference = fake_quantized_float_checkpoint(folders["qwen3"], tmp_path / "fake")
    llm = LLM(str(folders["qwen3"]), quantization="fp8", **ENGINE)
    assert llm.engine.config.model.quantization == "fp8"
    assert isinstance(llm.engine.runner.model.model.layers[0].mlp.down_proj, Fp8Linear)
    agree = agreement(greedy(LLM(str(reference), **ENGINE)), greedy(llm))
    assert agree.share >= 0.35 and agree.mean_abs_dlogprob <= 0.1, agree
    assert agree.divergences_in_top and max(agree.divergence_gaps, default=0.0) < NEAR_TIE, agree


def test_engine_runs_fp8_checkpoints_as_they_are(checkpoints):
    folder = str(checkpoints["ct-channel-dynamic"])
    plain = LLM(folder, **ENGINE)
    assert plain.engine.config.model.quantization == "fp8"  # from config.json, no option needed
    asked = LLM(folder, quantization="fp8", **ENGINE)
    assert greedy(plain) == greedy(asked)
    with pytest.raises(ConfigError, match="unknown quantization 'int8'"):
        LLM(folder, quantization="int8", **ENGINE)


def test_cli_flag():
    import argparse

    from overnight.options import add_engine_args, options_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert options_from_args(parser.parse_args(["--quantization", "fp8"]), "offline").quantization == "fp8"
    assert options_from_args(parser.parse_args([]), "offline").quantization is None
