"""The pre-load weight estimate (loader/fit.py, `overnight budget`) counts each projection of a quantized
checkpoint in the form the loaded model holds it: the layers a checkpoint's ignore list keeps float
(compressed-tensors `ignore`, fbgemm_fp8 / AWQ `modules_to_not_convert`, GPTQ `dynamic` "-:" skips) in
the compute dtype, the rest FP8 or packed. Each tiny checkpoint is loaded and the estimate compared with
the bytes of the loaded model's parameters and its quantized layers' buffers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import overnight.quant.apply as apply
from overnight.loader.fit import GIB, dense_kept, linear_formats, weight_bytes
from overnight.loader.model_loader import load_model
from overnight.loader.resolve import resolve_source
from overnight.quant.int_linear import Int8Linear, WeightOnlyIntLinear
from overnight.quant.int_moe import IntExperts
from overnight.quant.linear import Fp8Linear
from overnight.quant.names import module_matches
from tests.fbgemm_checkpoints import write_fbgemm
from tests.fp8_checkpoints import PROJECTIONS, make_fp8_checkpoint
from tests.int_checkpoints import make_int_checkpoint
from tests.tiny_models import make_tiny_checkpoint

QUANTIZED = (Fp8Linear, WeightOnlyIntLinear, Int8Linear, IntExperts)


def _held_bytes(model: nn.Module) -> int:
    """What the estimate counts: every parameter (shared ones once), the quantized layers' buffers and
    FP8 experts' row scales (plain tensors of layers/moe.py's Experts)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(
        b.numel() * b.element_size()
        for m in model.modules()
        if isinstance(m, QUANTIZED)
        for b in m.buffers(recurse=False)
    )
    scales = [
        getattr(m, name, None)
        for m in model.modules()
        if isinstance(m, apply.QuantizedAfterLoad)
        for name in ("gate_up_scale", "down_scale")
    ]
    return params + buffers + sum(t.numel() * t.element_size() for t in scales if t is not None)


def _check_estimate(folder: Path, float_layers: int) -> nn.Module:
    """Load `folder` on the CPU in float32; the estimate equals what the model holds, the checkpoint
    keeps `float_layers` of its projections as nn.Linear, and without its ignore list the estimate
    would be short by exactly their difference."""
    source = resolve_source(str(folder))
    scheme = source.quantization
    assert scheme is not None
    fp8, int_linear = linear_formats(scheme, "cpu")
    assert fp8 or int_linear is not None
    model = load_model(source, torch.float32, "cpu")
    always = getattr(model, "unquantized_linear", ())  # a MoE router: float whatever the checkpoint
    kept = [
        m
        for n, m in model.named_modules()
        if type(m) is nn.Linear and not n.endswith("lm_head") and not module_matches(n, always)
    ]
    assert len(kept) == float_layers
    estimate = weight_bytes(
        source.arch, torch.float32, fp8, loaded=True, int_linear=int_linear, scheme=scheme
    )
    assert estimate == _held_bytes(model)
    params, rows = dense_kept(source.arch, scheme, int_linear is not None and int_linear[2])
    if int_linear is not None and int_linear[2]:  # stacks of experts the ignore list keeps float
        stacks = [m for m in model.modules() if isinstance(m, apply.QuantizedAfterLoad)]
        params -= sum(m.gate_up_proj.numel() + m.down_proj.numel() for m in stacks)  # type: ignore[attr-defined]
        rows -= sum(m.gate_up_proj.shape[0] * sum(m.gate_up_proj.shape[1:]) for m in stacks)  # type: ignore[attr-defined]
    assert params == sum(m.weight.numel() for m in kept) and rows == sum(m.out_features for m in kept)
    unaware = weight_bytes(source.arch, torch.float32, fp8, loaded=True, int_linear=int_linear)
    assert unaware < estimate
    return model


def test_fbgemm_llama4_experts_and_shared_expert(tmp_path):
    """Llama 4's FP8 experts beside an ignore list naming a layer's attention and a shared expert's
    down_proj (Maverick-FP8's kind of list)."""
    from tests.test_fbgemm_fp8 import LLAMA4_IGNORE
    from tests.test_llama4 import make_llama4_checkpoint

    src = make_llama4_checkpoint(tmp_path / "l4")
    write_fbgemm(src, tmp_path / "fp8", tmp_path / "deq", LLAMA4_IGNORE)
    _check_estimate(tmp_path / "fp8", float_layers=3)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("fit-llama"), "llama")


def test_fbgemm_modules_to_not_convert(tiny_llama, tmp_path):
    """Meta's layout: a parent module (layer 0's attention: q/k/v fused and o_proj) and an exact name."""
    ignore = ["model.layers.0.self_attn", "model.layers.1.mlp.down_proj", "lm_head"]
    write_fbgemm(tiny_llama, tmp_path / "fp8", tmp_path / "deq", ignore)
    _check_estimate(tmp_path / "fp8", float_layers=3)


def test_compressed_tensors_fp8_ignore(tiny_llama, tmp_path):
    """compressed-tensors' "re:" entries: every layer's down_proj left float."""
    projections = tuple(p for p in PROJECTIONS if p != "down_proj")
    out = make_fp8_checkpoint(
        tiny_llama,
        tmp_path / "ct",
        "ct-channel-dynamic",
        projections=projections,
        config_extra={"ignore": ["lm_head", "re:.*down_proj$"]},
    )
    layers = json.loads((out / "config.json").read_text())["num_hidden_layers"]
    _check_estimate(out, float_layers=layers)


def _edit_quantization_config(folder: Path, **fields: object) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"].update(fields)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.fixture
def packed_on_cpu(monkeypatch):
    """The GPU's packed integer layers, on the CPU (what linear_formats then counts too)."""
    monkeypatch.setattr(apply, "PACKED_INT_ON_CPU", True)


def test_gptq_dynamic_skip(tiny_llama, tmp_path, packed_on_cpu):
    quantized, _ = make_int_checkpoint(
        tiny_llama, tmp_path / "gptq", "gptq-w8-g32-asym-v2", keep_float=("layers.1.mlp.down_proj",)
    )
    _edit_quantization_config(quantized, dynamic={r"-:.*layers\.1\.mlp\.down_proj": {}})
    _check_estimate(quantized, float_layers=1)


def test_awq_modules_to_not_convert(tiny_llama, tmp_path, packed_on_cpu):
    quantized, _ = make_int_checkpoint(
        tiny_llama, tmp_path / "awq", "awq-g32", keep_float=("layers.0.mlp.down_proj",)
    )
    _edit_quantization_config(quantized, modules_to_not_convert=["layers.0.mlp.down_proj"])
    _check_estimate(quantized, float_layers=1)


# Llama-3.1-405B's shapes (its config.json) with an fbgemm_fp8 quantization_config; the ignore list is
# illustrative of Meta's release (attention of every layer and the first and last layers kept bf16).
LLAMA_405B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=16384,
    intermediate_size=53248, num_hidden_layers=126, num_attention_heads=128, num_key_value_heads=8,
    hidden_act="silu", max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
    rope_theta=500000.0, torch_dtype="bfloat16",
)  # fmt: skip
LLAMA_405B_IGNORE = [
    *(
        f"model.layers.{i}.self_attn.{p}"
        for i in range(126)
        for p in ("q_proj", "k_proj", "v_proj", "o_proj")
    ),
    *(f"model.layers.{i}.mlp.{p}" for i in (0, 125) for p in ("gate_proj", "up_proj", "down_proj")),
    "lm_head",
]


def test_budget_counts_a_405b_ignore_list(tmp_path):
    """`overnight budget` on a 405B-shaped fbgemm_fp8 checkpoint whose ignore list keeps attention and
    layers 0 and 125 in bf16: its weights count ~454 GiB (the MLPs of 124 layers in FP8), not the
    ~382 GiB of every projection in FP8."""
    from overnight.options import EngineOptions
    from overnight.tools.budget import DeviceMemory, plan_budget, render

    qc = {
        "quant_method": "fbgemm_fp8",
        "activation_scale_ub": 1200.0,
        "modules_to_not_convert": LLAMA_405B_IGNORE,
    }
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_405B, "quantization_config": qc}))
    source = resolve_source(str(tmp_path), "dummy")
    arch = source.arch
    h, layers = arch.hidden_size, arch.num_hidden_layers
    attention = h * (arch.q_size + 2 * arch.kv_size) + arch.q_size * h
    mlp = 3 * h * arch.intermediate_size
    assert dense_kept(arch, source.quantization) == (
        layers * attention + 2 * mlp,
        layers * (arch.q_size + 2 * arch.kv_size + h) + 2 * (2 * arch.intermediate_size + h),
    )
    every_fp8 = weight_bytes(arch, torch.bfloat16, True, loaded=True)
    honoured = weight_bytes(arch, torch.bfloat16, True, loaded=True, scheme=source.quantization)
    assert 375 * GIB < every_fp8 < 385 * GIB and 450 * GIB < honoured < 458 * GIB
    h100 = DeviceMemory("NVIDIA H100 80GB HBM3", total_bytes=int(79.1 * GIB), free_bytes=int(78.6 * GIB))
    plan = plan_budget(
        EngineOptions(model=str(tmp_path), dtype="bfloat16", tensor_parallel_size=8), source, h100
    )
    assert plan.weights_bytes is not None
    assert abs(plan.weights_bytes - honoured / 8) < 0.2 * GIB
    text = render(plan, "llama-405b-fp8", arch, "bfloat16")
    assert f"{plan.weights_bytes / GIB:.1f} GiB FP8 weights" in text
    assert f"{every_fp8 / 8 / GIB:.1f} GiB FP8 weights" not in text


def test_gptq_modules_in_block_to_quantize(tiny_llama, tmp_path, packed_on_cpu):
    """An allowlist: only attention quantized, the MLPs float; symmetric (no zero points held)."""
    mlp = tuple(f"layers.{i}.mlp.{p}" for i in range(3) for p in ("gate_proj", "up_proj", "down_proj"))
    quantized, _ = make_int_checkpoint(tiny_llama, tmp_path / "gptq", "gptq-w4-g32-sym", keep_float=mlp)
    blocks = [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"]]
    _edit_quantization_config(quantized, modules_in_block_to_quantize=blocks)
    _check_estimate(quantized, float_layers=2 * 3)  # gate/up fused, down_proj: per layer


def test_compressed_tensors_int_experts_ignored(tmp_path, packed_on_cpu):
    """Packed integer experts (IntExperts) but layer 0's, which the ignore list keeps float, and a dense
    projection: o_proj of layer 1."""
    src = make_tiny_checkpoint(tmp_path / "src", "qwen3_moe")
    experts = tuple(
        f"layers.0.mlp.experts.{e}.{p}" for e in range(8) for p in ("gate_proj", "up_proj", "down_proj")
    )
    quantized, _ = make_int_checkpoint(
        src, tmp_path / "ct", "ct-w8-g16-sym", keep_float=(*experts, "layers.1.self_attn.o_proj")
    )
    config = json.loads((quantized / "config.json").read_text())
    ignore = config["quantization_config"]["ignore"]
    extra = [r"re:.*layers\.0\.mlp\.experts\..*", "model.layers.1.self_attn.o_proj"]
    _edit_quantization_config(quantized, ignore=[*ignore, *extra])
    model = _check_estimate(quantized, float_layers=1)
    packed = [type(layer.mlp.experts) is IntExperts for layer in model.model.layers]
    assert packed == [False, True, True]
