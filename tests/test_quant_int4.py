"""Integer-weight checkpoints (AWQ, GPTQ, compressed-tensors W4A16 / W8A16 / W8A8) on the CPU.

Each layout is written by tests/int_checkpoints.py from a tiny random model, with its dequantized twin
(a float checkpoint of exactly the weights the layout decodes to, computed there from the format's
definition). Checked here:

- the loader's dequantized weights are bit-exact against that twin, and for compressed-tensors against
  the package's own decompressor (PackedQuantizationCompressor.decompress; it no longer applies
  weight_g_idx, so the act-order layout is checked against the twin only);
- the packed layers the GPU runs (quant/int_linear.py, here through their torch reference) hold the same
  weights once repacked (g_idx permutation included) and give the same greedy tokens;
- the engine's fp32 greedy tokens equal transformers' on the dequantized twin, for every format, dense
  (Qwen3) and MoE (Qwen3-MoE, experts dequantized at load);
- malformed or unsupported configs are refused by name before any weight is read.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from overnight.errors import ModelLoadError
from overnight.loader.model_loader import load_model
from overnight.loader.resolve import resolve_source
from overnight.quant import apply
from overnight.quant.apply import dequantize_model
from overnight.quant.int_checkpoint import dequantized
from overnight.quant.int_linear import Int8Linear, WeightOnlyIntLinear
from overnight.quant.int_moe import IntExperts
from overnight.quant.int_scheme import IntScheme
from tests.int_checkpoints import LAYOUTS, make_int_checkpoint
from tests.tiny_models import load_reference, make_tiny_checkpoint

# one per format: CT W4A16 (act-order, zero points), CT W8A16, CT W8A8, AWQ, GPTQ (act-order, v1)
MOE_LAYOUTS = ("ct-w4-g32-asym-gidx", "ct-w8-g16-sym", "ct-w8a8", "awq-g32", "gptq-w4-g16-asym-descact")


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    root = tmp_path_factory.mktemp("int-dense")
    src = make_tiny_checkpoint(root / "src", "qwen3")
    return {name: make_int_checkpoint(src, root / name, name) for name in LAYOUTS}


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    root = tmp_path_factory.mktemp("int-moe")
    src = make_tiny_checkpoint(root / "src", "qwen3_moe")
    return {name: make_int_checkpoint(src, root / name, name) for name in MOE_LAYOUTS}


def _modules(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Checkpoint tensors grouped by module, for the projections only."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        module, _, kind = name.rpartition(".")
        if "_proj" in module:
            out.setdefault(module, {})[kind] = t
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_dequantized_weights_are_bit_exact(dense, layout):
    quantized, twin = dense[layout]
    scheme = resolve_source(str(quantized)).quantization
    assert isinstance(scheme, IntScheme)
    reference = load_file(twin / "model.safetensors")
    modules = _modules(load_file(quantized / "model.safetensors"))
    assert len(modules) == 2 * 7
    for module, parts in modules.items():
        assert torch.equal(dequantized(module, parts, scheme), reference[f"{module}.weight"]), module


@pytest.mark.parametrize(
    "layout", [n for n, lay in LAYOUTS.items() if lay.method == "ct" and not lay.act_order]
)
def test_compressed_tensors_own_decompression_agrees(dense, layout):
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    quantized, _ = dense[layout]
    qc = json.loads((quantized / "config.json").read_text())["quantization_config"]
    ct_scheme = QuantizationConfig.model_validate(qc).config_groups["group_0"]
    scheme = resolve_source(str(quantized)).quantization
    for module, parts in _modules(load_file(quantized / "model.safetensors")).items():
        theirs = PackedQuantizationCompressor.decompress(dict(parts), ct_scheme)["weight"]
        ours = dequantized(module, parts, scheme).to(theirs.dtype)
        assert torch.equal(ours, theirs), module


def _same_weights(model: torch.nn.Module, twin: Path) -> None:
    reference = load_model(resolve_source(str(twin)), torch.float32, "cpu").state_dict()
    ours = model.state_dict()
    assert ours.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(ours[name], tensor), name


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_layers_hold_the_same_weights(dense, layout, monkeypatch):
    """The GPU's layout, built on the CPU: repacked codes (columns sorted by group for act-order), float32
    scales and zeros; dequantized back it is the twin exactly, and the packed model's greedy tokens (its
    torch reference path) equal the twin's."""
    from tests.parity_helpers import PROMPTS, greedy_tokens

    quantized, twin = dense[layout]
    monkeypatch.setattr(apply, "PACKED_INT_ON_CPU", True)
    model = load_model(resolve_source(str(quantized)), torch.float32, "cpu")
    kind = Int8Linear if LAYOUTS[layout].method == "ct-w8a8" else WeightOnlyIntLinear
    layers = [m for m in model.modules() if isinstance(m, kind)]
    assert len(layers) == 2 * 4  # qkv, o, gate_up, down per layer
    if LAYOUTS[layout].act_order:
        assert all(m.input_perm is not None for m in layers)
    _same_weights(dequantize_model(copy.deepcopy(model)), twin)
    if kind is WeightOnlyIntLinear:  # W8A8 quantizes activations: its tokens are not the twin's
        prompts = PROMPTS[:4]
        ref = load_model(resolve_source(str(twin)), torch.float32, "cpu")
        assert greedy_tokens(model, prompts, 4) == greedy_tokens(ref, prompts, 4)


@pytest.mark.parametrize("layout", ["gptq-w4-g16-asym-descact", "ct-w8-g16-sym", "ct-w8a8"])
def test_packed_layers_kernel_path_matches_reference(dense, layout, monkeypatch):
    """Each packed layer of a loaded checkpoint through its kernel path (the Triton GEMM in the
    interpreter; W8A8 through its int8 GEMM, not the W8A16 small-batch path) against its torch reference
    path, on the same inputs."""
    from overnight.kernels import dispatch, int8_gemm

    monkeypatch.setattr(int8_gemm, "W8A16_MAX_M", 0)
    monkeypatch.setattr(apply, "PACKED_INT_ON_CPU", True)
    model = load_model(resolve_source(str(dense[layout][0])), torch.float32, "cpu")
    layers = [m for m in model.modules() if isinstance(m, (WeightOnlyIntLinear, Int8Linear))]
    gen = torch.Generator().manual_seed(0)
    for layer in layers:
        x = torch.randn(3, layer.in_features, generator=gen)
        monkeypatch.setattr(dispatch, "FORCE_KERNELS", False)
        ref = layer(x)
        monkeypatch.setattr(dispatch, "FORCE_KERNELS", True)
        torch.testing.assert_close(layer(x), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("layout", MOE_LAYOUTS)
def test_moe_experts_packed_or_dequantized(moe, monkeypatch, layout):
    """Qwen3-MoE on the GPU's layout: experts packed (IntExperts) for weight-only layouts without
    act-order, dequantized at load (Experts) for act-order and W8A8; either way the same weights as the
    twin, bit for bit, and the router stays float. Packed experts' greedy tokens (their torch reference
    path) equal the twin's."""
    from tests.parity_helpers import PROMPTS, greedy_tokens

    monkeypatch.setattr(apply, "PACKED_INT_ON_CPU", True)
    quantized, twin = moe[layout]
    model = load_model(resolve_source(str(quantized)), torch.float32, "cpu")
    lay = LAYOUTS[layout]
    packed = lay.method != "ct-w8a8" and not lay.act_order
    assert isinstance(model.model.layers[0].mlp.experts, IntExperts) == packed
    assert type(model.model.layers[0].mlp.gate) is torch.nn.Linear
    _same_weights(dequantize_model(copy.deepcopy(model)), twin)
    if packed:
        ref = load_model(resolve_source(str(twin)), torch.float32, "cpu")
        assert greedy_tokens(model, PROMPTS[:4], 4) == greedy_tokens(ref, PROMPTS[:4], 4)


def test_packed_experts_kernel_path_matches_reference(moe, monkeypatch):
    from overnight.kernels import dispatch

    monkeypatch.setattr(apply, "PACKED_INT_ON_CPU", True)
    model = load_model(resolve_source(str(moe["awq-g32"][0])), torch.float32, "cpu")
    experts = model.model.layers[1].mlp.experts
    assert isinstance(experts, IntExperts)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, experts.hidden_size, generator=gen)
    weights, ids = torch.topk(torch.randn(5, experts.num_experts, generator=gen).softmax(-1), 2)
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", False)
    ref = experts(x, weights, ids.int())
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", True)
    torch.testing.assert_close(experts(x, weights, ids.int()), ref, atol=1e-4, rtol=1e-4)


# -- the engine against transformers on the dequantized model --------------------------------------


def _engine_matches_transformers(quantized: Path, twin: Path) -> None:
    from overnight import LLM, SamplingParams
    from tests.test_engine_parity import hf_greedy, prompts_for

    llm = LLM(
        str(quantized), skip_tokenizer_init=True, dtype="float32", device="cpu", kv_cache_memory_bytes=4 << 20
    )
    assert llm.engine.config.model.quantization == resolve_source(str(quantized)).quantization.name
    ref = load_reference(twin)
    prompts = prompts_for(ref.config.vocab_size, n=6)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(ref, prompt, 8)[0], f"prompt of {len(prompt)} tokens"


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_engine_greedy_equals_transformers_dense(dense, layout):
    _engine_matches_transformers(*dense[layout])


@pytest.mark.slow
@pytest.mark.parametrize("layout", MOE_LAYOUTS)
def test_engine_greedy_equals_transformers_moe(moe, layout):
    _engine_matches_transformers(*moe[layout])


# -- refusals ---------------------------------------------------------------------------------------


def _with_config(folder: Path, dst: Path, edit) -> Path:
    shutil.copytree(folder, dst)
    config = json.loads((dst / "config.json").read_text())
    edit(config["quantization_config"])
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _group(qc):
    return qc["config_groups"]["group_0"]


REFUSALS = {
    "gptq-3bit": ("gptq-w4-g32-sym", lambda qc: qc.update(bits=3), "3-bit"),
    "gptq-marlin-format": ("gptq-w4-g32-sym", lambda qc: qc.update(checkpoint_format="marlin"), "marlin"),
    "gptq-lm-head": ("gptq-w4-g32-sym", lambda qc: qc.update(lm_head=True), "LM head"),
    "gptq-odd-group": ("gptq-w4-g32-sym", lambda qc: qc.update(group_size=12), "group_size 12"),
    "awq-gemv": ("awq-g32", lambda qc: qc.update(version="gemv"), "'gemv'"),
    "awq-no-zero": ("awq-g32", lambda qc: qc.update(zero_point=False), "zero_point"),
    "ct-3bit": ("ct-w4-g32-sym", lambda qc: _group(qc)["weights"].update(num_bits=3), "3-bit"),
    "ct-tensor": (
        "ct-w4-g32-sym",
        lambda qc: _group(qc)["weights"].update(strategy="tensor", group_size=None),
        "'tensor'",
    ),
    "ct-malformed": (
        "ct-w4-g32-sym",
        lambda qc: _group(qc)["weights"].update(strategy="sideways"),
        "malformed",
    ),
    "gptq-pack-int16": ("gptq-w4-g32-sym", lambda qc: qc.update(pack_dtype="int16"), "pack_dtype"),
    "ct-rotated": (
        "ct-w4-g32-sym",
        lambda qc: qc.update(transform_config={"config_groups": {"r": {}}}),
        "transform_config",
    ),
    "ct-sparse-24": (
        "ct-w4-g32-sym",
        lambda qc: qc.update(sparsity_config={"format": "sparse-24-bitmask"}),
        "sparsity",
    ),
    "ct-static-acts": (
        "ct-w8a8",
        lambda qc: _group(qc)["input_activations"].update(dynamic=False, strategy="tensor"),
        "static",
    ),
    "ct-channel-group-order": (
        "ct-w4-channel-asym",
        lambda qc: _group(qc)["weights"].update(actorder="group"),
        "needs the group strategy",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_unsupported_configs_are_refused_by_name(dense, tmp_path, case):
    """At resolve time, from config.json alone: before the model is built or any weight is read."""
    layout, edit, message = REFUSALS[case]
    folder = _with_config(dense[layout][0], tmp_path / case, edit)
    with pytest.raises(ModelLoadError, match=message):
        resolve_source(str(folder))


def test_missing_part_is_named(dense, tmp_path):
    quantized, _ = dense["gptq-w4-g16-asym-descact"]
    broken = tmp_path / "broken"
    shutil.copytree(quantized, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.g_idx"]
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"layers\.1\.self_attn\.k_proj\.g_idx"):
        load_model(resolve_source(str(broken)), torch.float32, "cpu")


def test_unquantized_layer_not_in_ignore_list_is_named(dense, tmp_path, monkeypatch):
    """A float o_proj in a checkpoint whose config says every Linear is quantized: on the GPU layout the
    loader names the mismatch instead of reporting missing parameters."""
    monkeypatch.setattr(apply, "PACKED_INT_ON_CPU", True)
    quantized, twin = dense["awq-g32"]
    broken = tmp_path / "float-o"
    shutil.copytree(quantized, broken)
    tensors = load_file(broken / "model.safetensors")
    for part in ("qweight", "qzeros", "scales"):
        del tensors[f"model.layers.0.self_attn.o_proj.{part}"]
    tensors["model.layers.0.self_attn.o_proj.weight"] = load_file(twin / "model.safetensors")[
        "model.layers.0.self_attn.o_proj.weight"
    ]
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"o_proj.*ignore list"):
        load_model(resolve_source(str(broken)), torch.float32, "cpu")


@pytest.mark.parametrize(
    "layout,file", [("gptq-w4-g16-asym-descact", "quantize_config.json"), ("awq-g32", "quant_config.json")]
)
def test_quantizer_config_file_without_quantization_config(dense, tmp_path, layout, file):
    """Older AutoGPTQ / AutoAWQ folders: the config lives in the quantizer's own file (AutoAWQ's keys)."""
    folder = tmp_path / layout
    shutil.copytree(dense[layout][0], folder)
    config = json.loads((folder / "config.json").read_text())
    qc = config.pop("quantization_config")
    qc.pop("quant_method")
    if file == "quant_config.json":
        qc = {"zero_point": True, "q_group_size": qc["group_size"], "w_bit": 4, "version": "GEMM"}
    (folder / file).write_text(json.dumps(qc))
    (folder / "config.json").write_text(json.dumps(config))
    assert resolve_source(str(folder)).quantization == resolve_source(str(dense[layout][0])).quantization


def test_fp8_option_on_an_int_checkpoint_is_refused(dense):
    from overnight.errors import ConfigError

    with pytest.raises(ConfigError, match="fp8"):
        resolve_source(str(dense["awq-g32"][0]), quantization="fp8")


# -- memory accounting ------------------------------------------------------------------------------


def test_weight_bytes_count_packed_projections():
    """Qwen3-8B with int4 projections in groups of 128: half a byte per projection weight plus a float32
    scale and zero per group; embeddings, LM head and norms in bf16. On the CPU (dequantized at load)
    the weights count in the compute dtype."""
    from overnight.loader.fit import linear_formats, weight_bytes

    arch = resolve_source("qwen3-8b", "dummy").arch
    scheme = IntScheme(method="gptq", bits=4, group_size=128, symmetric=True)
    fp8, int_linear = linear_formats(scheme, "cuda")
    assert (fp8, int_linear) == (False, (4, 128, True))
    assert linear_formats(scheme, "cpu") == (False, None)
    bf16 = weight_bytes(arch, torch.bfloat16)
    int4 = weight_bytes(arch, torch.bfloat16, int_linear=int_linear)
    projections = arch.num_linear_parameters()  # dense model: every projection is packed
    assert int4 == bf16 - 2 * projections + projections // 2 + 8 * (projections // 128)
    assert 0.35 < int4 / bf16 < 0.42  # ~6.4 GB against ~16.4 GB
    int8 = weight_bytes(arch, torch.bfloat16, int_linear=(8, 0, False))
    assert int4 < int8 < weight_bytes(arch, torch.bfloat16, fp8_linear=True) + 8 * 10**7


def test_weight_bytes_count_packed_experts():
    """Qwen3-30B-A3B in int4 groups of 128: the experts packed too (~61 GB in bf16, ~17 GB packed);
    with act-order (experts dequantized at load) they count in bf16."""
    from overnight.loader.fit import linear_formats, weight_bytes

    arch = resolve_source("qwen3-30b-a3b", "dummy").arch
    packed = linear_formats(IntScheme(method="gptq", bits=4, group_size=128, symmetric=False), "cuda")[1]
    ordered = linear_formats(
        IntScheme(method="gptq", bits=4, group_size=128, symmetric=False, act_order=True), "cuda"
    )[1]
    assert packed == (4, 128, True) and ordered == (4, 128, False)
    bf16 = weight_bytes(arch, torch.bfloat16)
    assert 0.25 < weight_bytes(arch, torch.bfloat16, int_linear=packed) / bf16 < 0.32
    assert weight_bytes(arch, torch.bfloat16, int_linear=ordered) / bf16 > 0.9


def test_budget_on_a_gpu_counts_the_packed_weights(dense):
    """`overnight budget` for an int4 checkpoint on a (described) GPU: packed bytes, named as such."""
    from overnight.options import EngineOptions
    from overnight.tools.budget import GIB, DeviceMemory, plan_budget

    gpu = DeviceMemory("NVIDIA H200", total_bytes=int(139.8 * GIB), free_bytes=int(139.3 * GIB))
    quantized, twin = dense["gptq-w4-g32-sym"]
    packed = plan_budget(EngineOptions(model=str(quantized)), resolve_source(str(quantized)), gpu)
    dense_plan = plan_budget(EngineOptions(model=str(twin)), resolve_source(str(twin)), gpu)
    assert packed.weights_bytes is not None and dense_plan.weights_bytes is not None
    assert packed.weights_bytes < dense_plan.weights_bytes
    assert "int4 weights" in packed.pool_source
