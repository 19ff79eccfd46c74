"""Gemma 3 image checkpoints (Gemma3ForConditionalGeneration) whose quantization_config leaves layers
of the language model float, named in the quantizer's names: transformers 4 held the model as
language_model.model.* and transformers 5 as model.language_model.* (and may save the tensors in the
other layout), while the model here calls them model.layers.* (models/gemma.py,
gemma_checkpoint_names). Each ignore-list format: compressed-tensors `ignore` (llm-compressor, FP8
too), AWQ `modules_to_not_convert` (a substring rule), GPTQ `dynamic` "-:" skips (GPTQModel, a
regular expression) and `modules_in_block_to_quantize`.

End to end (CPU, fp32, the GPU's packed integer layers: PACKED_INT_ON_CPU): a tiny random Gemma 3
checkpoint (tests/tiny_gemma_vl.py) in each tensor layout, quantized (tests/int_checkpoints.py) but
for one layer listed in transformers 4's names and one in transformers 5's; both load as nn.Linear
holding the checkpoint's float weight, the other layers packed, and the greedy tokens of a prompt
with an image and one without equal transformers' on the dequantized twin. Without the aliases the
load fails: a float tensor arrives for a layer built packed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from overnight import LLM, SamplingParams
from overnight.errors import ModelLoadError
from overnight.quant import apply
from overnight.quant.int_linear import WeightOnlyIntLinear
from overnight.quant.linear import Fp8Linear
from tests.int_checkpoints import make_int_checkpoint
from tests.tiny_gemma_vl import (
    GEMMA_LAYOUTS,
    gemma_cases,
    gemma_name,
    gemma_prompts,
    hf_reference,
    in_gemma_layout,
    make_gemma_vl_checkpoint,
)

NEW = 6
ENGINE = dict(dtype="float32", device="cpu", kv_cache_memory_bytes=4 << 20, max_model_len=128)
FORMATS = {"ct": "ct-w4-g32-sym", "awq": "awq-g32", "gptq": "gptq-w4-g32-sym"}
# model name -> the layout its ignore entry is written in: one layer per layout
KEPT = {"model.layers.0.mlp.down_proj": "transformers4", "model.layers.1.self_attn.o_proj": "transformers5"}
QUANTIZED = (
    "model.layers.0.self_attn.o_proj",
    "model.layers.1.mlp.down_proj",
    "model.layers.0.self_attn.qkv_proj",
)


def entries() -> list[str]:
    return [gemma_name(module, layout) for module, layout in KEPT.items()]


def list_ignored(qc: dict[str, Any], fmt: str, names: list[str]) -> None:
    """Add `names` to qc's ignore list the way `fmt`'s quantizer writes it."""
    if fmt == "ct":
        qc["ignore"] = [*qc.get("ignore", []), *names]
    elif fmt == "awq":
        qc["modules_to_not_convert"] = [*(qc.get("modules_to_not_convert") or []), *names]
    else:  # GPTQModel: "-:" and a regular expression re.match'ed against the module's name
        qc["dynamic"] = {f"-:{re.escape(name)}$": {} for name in names}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemma3_quant_names")
    native = make_gemma_vl_checkpoint(root)
    return {layout: Path(in_gemma_layout(native, root / layout, layout)) for layout in GEMMA_LAYOUTS}


@pytest.mark.parametrize("layout", GEMMA_LAYOUTS)
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_layers_ignored_in_either_naming_load_float(layouts, fmt, layout, tmp_path, monkeypatch):
    monkeypatch.setattr(apply, "PACKED_INT_ON_CPU", True)
    kept = tuple(m.removeprefix("model.") for m in KEPT)
    quantized, twin = make_int_checkpoint(layouts[layout], tmp_path / fmt, FORMATS[fmt], keep_float=kept)
    config = json.loads((quantized / "config.json").read_text())
    list_ignored(config["quantization_config"], fmt, entries())
    (quantized / "config.json").write_text(json.dumps(config))

    llm = LLM(str(quantized), **ENGINE)
    model = llm.engine.runner.model  # type: ignore[attr-defined]
    stored = load_file(quantized / "model.safetensors")
    for module in KEPT:
        layer = model.get_submodule(module)
        assert type(layer) is nn.Linear, module
        assert torch.equal(layer.weight, stored[gemma_name(module, layout) + ".weight"].float()), module
    for module in QUANTIZED:
        assert isinstance(model.get_submodule(module), WeightOnlyIntLinear), module
    outs = llm.generate(gemma_prompts(2), SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True))
    ref = hf_reference(str(twin))
    for (text, imgs), out in zip(gemma_cases(2), outs):
        assert list(out.outputs[0].token_ids) == ref.greedy(text, imgs, NEW)[1], text


# -- which layers the quantization pass keeps float, per format and entry layout (no weights) --


def _meta_model(folder: Path) -> nn.Module:
    from overnight.models.registry import arch_from_hf_config, model_class_for

    arch = arch_from_hf_config(json.loads((folder / "config.json").read_text()))
    with torch.device("meta"):
        return model_class_for(arch)(arch)


def _scheme(fmt: str, names: list[str]):
    from overnight.quant.scheme import scheme_from_hf_config

    if fmt == "fp8":  # a block-scaled FP8 checkpoint (its float layers in modules_to_not_convert)
        fp8 = {"quant_method": "fp8", "weight_block_size": [128, 128], "modules_to_not_convert": names}
        return scheme_from_hf_config(fp8, "test")
    if fmt == "ct":
        pytest.importorskip("compressed_tensors")  # reads the quantization_config
    qc: dict[str, Any] = {
        "ct": {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {
                "g": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 4,
                        "type": "int",
                        "symmetric": True,
                        "strategy": "group",
                        "group_size": 32,
                    },
                }
            },
            "ignore": ["lm_head", r"re:.*vision_tower.*"],
        },
        "awq": {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
        "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True},
    }[fmt]
    list_ignored(qc, fmt, names)
    return scheme_from_hf_config(qc, "test")


@pytest.mark.parametrize("entry_layout", [*GEMMA_LAYOUTS, "model"])
@pytest.mark.parametrize("fmt", ["ct", "awq", "gptq", "fp8"])
def test_ignore_entries_match_in_every_layout(layouts, fmt, entry_layout):
    """Both kept layers named in one layout (the model's own names too): float; the rest quantized."""
    names = [m if entry_layout == "model" else gemma_name(m, entry_layout) for m in KEPT]
    model = apply.quantize_model(_meta_model(layouts["transformers5"]), _scheme(fmt, names))
    quantized = Fp8Linear if fmt == "fp8" else WeightOnlyIntLinear
    for module in KEPT:
        assert type(model.get_submodule(module)) is nn.Linear, (module, names)
    for module in QUANTIZED:
        assert isinstance(model.get_submodule(module), quantized), module
    tower = [m for n, m in model.named_modules() if n.startswith(("vision_tower.", "multi_modal_projector."))]
    assert tower and not any(isinstance(m, quantized) for m in tower)


def test_gptq_modules_in_block_to_quantize(layouts):
    """GPTQ's allowlist (transformers' GPTQConfig): modules of a block not listed stay float."""
    from overnight.quant.int_scheme import int_scheme_from_hf_config

    qc = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 32,
        "desc_act": False,
        "modules_in_block_to_quantize": [
            ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
            ["mlp.gate_proj", "mlp.up_proj"],
        ],
    }
    model = apply.quantize_model(_meta_model(layouts["transformers4"]), int_scheme_from_hf_config(qc, "test"))
    for i in range(2):
        layer = model.model.layers[i]
        assert isinstance(layer.self_attn.qkv_proj, WeightOnlyIntLinear)
        assert isinstance(layer.mlp.gate_up_proj, WeightOnlyIntLinear)
        assert type(layer.self_attn.o_proj) is nn.Linear and type(layer.mlp.down_proj) is nn.Linear


def test_gptq_dynamic_overrides_that_mix_schemes_are_refused():
    from overnight.quant.int_scheme import int_scheme_from_hf_config

    base = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}
    same = int_scheme_from_hf_config({**base, "dynamic": {r"+:.*\.o_proj": {"bits": 4}}}, "cfg")
    assert same.ignore == () and same.bits == 4
    with pytest.raises(ModelLoadError, match=r"dynamic override '\+:\.\*v_proj' sets \{'bits': 8\}"):
        int_scheme_from_hf_config({**base, "dynamic": {"+:.*v_proj": {"bits": 8}}}, "cfg")
    with pytest.raises(ModelLoadError, match="modules_in_block_to_quantize must be a list"):
        int_scheme_from_hf_config({**base, "modules_in_block_to_quantize": "q_proj"}, "cfg")
