"""GPTQ checkpoints of the image models on the CPU: Qwen2.5-VL and Gemma 3, each in both of its
tensor-naming layouts (Qwen: transformers 5's model.language_model.* / model.visual.* and the
published model.* / visual.*; Gemma 3: transformers 4's language_model.model.* /
vision_tower.vision_model.* and transformers 5's model.language_model.* / model.vision_tower.*),
4-bit symmetric in groups of 32 (the published group of 128 scaled to the tiny models' 64 and 128
columns; GPTQ's v1 checkpoint_format, zeros stored minus one), without and with act-order (desc_act:
a g_idx shuffling columns among groups, shared by the projections of one input as GPTQ writes it).

Written by tests/int_checkpoints.py from each format's definition; the vision tower (and Gemma's
projector) left float but named nowhere in the quantization_config, as in Qwen's own GPTQ exports
(Qwen2-VL-*-GPTQ-Int4: no modules_to_not_convert): the model keeps it float by itself. The
GPU's packed layers run (PACKED_INT_ON_CPU: the checkpoint's names must meet the model's before the
integer conversion; act-order through WeightOnlyIntLinear's input_perm), and the greedy tokens of a
prompt without an image and one with an image equal transformers' on the dequantized twin (fp32).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from overnight import LLM, SamplingParams
from overnight.quant import apply
from overnight.quant.int_linear import WeightOnlyIntLinear
from tests.int_checkpoints import make_int_checkpoint
from tests.test_vl_quant import (
    LAYOUTS,
    assert_gemma_tower_untouched,
    assert_tower_untouched,
    cases,
    in_layout,
)
from tests.test_vl_quant import prompts as qwen_prompts
from tests.tiny_gemma_vl import (
    GEMMA_LAYOUTS,
    gemma_cases,
    gemma_prompts,
    hf_reference,
    in_gemma_layout,
    make_gemma_vl_checkpoint,
)
from tests.tiny_vl import hf_greedy, make_vl_checkpoint

NEW = 6
ENGINE = dict(dtype="float32", device="cpu", kv_cache_memory_bytes=4 << 20, max_model_len=128)
METHODS = ["gptq-w4-g32-sym", "gptq-w4-g32-sym-descact"]
GREEDY = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)


def assert_packed(model: nn.Module, act_order: bool) -> None:
    """The language model's projections are the GPU's packed layers, act-order ones permuting inputs."""
    layers = model.model.layers  # type: ignore[union-attr]
    for module in (layers[0].self_attn.qkv_proj, layers[-1].mlp.down_proj, layers[0].mlp.gate_up_proj):
        assert isinstance(module, WeightOnlyIntLinear)
        assert (module.input_perm is not None) == act_order


def gptq_checkpoint(src: Path, dst: Path, method: str) -> tuple[Path, Path]:
    """src quantized in `method`, its config naming no float module (see the docstring)."""
    quantized, twin = make_int_checkpoint(src, dst, method)
    config = json.loads((quantized / "config.json").read_text())
    del config["quantization_config"]["modules_to_not_convert"]
    (quantized / "config.json").write_text(json.dumps(config))
    return quantized, twin


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen2_5_vl_gptq")
    native = Path(make_vl_checkpoint(root, "qwen2_5_vl"))
    return {layout: in_layout(native, root / layout, layout) for layout in LAYOUTS}


@pytest.fixture(scope="module")
def gemma(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemma3_vl_gptq")
    native = make_gemma_vl_checkpoint(root)
    return {layout: Path(in_gemma_layout(native, root / layout, layout)) for layout in GEMMA_LAYOUTS}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_qwen25_vl_gptq_matches_transformers_on_the_dequantized_twin(
    qwen, layout, method, tmp_path, monkeypatch
):
    monkeypatch.setattr(apply, "PACKED_INT_ON_CPU", True)
    quantized, twin = gptq_checkpoint(qwen[layout], tmp_path / method, method)
    llm = LLM(str(quantized), **ENGINE)
    model = llm.engine.runner.model  # type: ignore[attr-defined]
    assert_packed(model, method.endswith("descact"))
    assert_tower_untouched(model, quantized)
    from transformers import AutoModelForImageTextToText

    ref = AutoModelForImageTextToText.from_pretrained(twin, dtype=torch.float32).eval()
    tok = llm.get_tokenizer()
    outs = llm.generate(qwen_prompts("qwen2_5_vl"), GREEDY)
    for (text, imgs), out in zip(cases("qwen2_5_vl"), outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(str(twin), tok.encode(text), imgs, NEW, ref), text


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("layout", GEMMA_LAYOUTS)
def test_gemma3_gptq_matches_transformers_on_the_dequantized_twin(
    gemma, layout, method, tmp_path, monkeypatch
):
    monkeypatch.setattr(apply, "PACKED_INT_ON_CPU", True)
    quantized, twin = gptq_checkpoint(gemma[layout], tmp_path / method, method)
    llm = LLM(str(quantized), **ENGINE)
    model = llm.engine.runner.model  # type: ignore[attr-defined]
    assert_packed(model, method.endswith("descact"))
    assert_gemma_tower_untouched(model, quantized)
    outs = llm.generate(gemma_prompts(2), GREEDY)
    ref = hf_reference(str(twin))
    for (text, imgs), out in zip(gemma_cases(2), outs):
        assert list(out.outputs[0].token_ids) == ref.greedy(text, imgs, NEW)[1], text
