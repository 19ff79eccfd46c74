"""Quantized image-model checkpoints on the CPU (Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE; Gemma 3 and
Qwen3.5 at the end): integer checkpoints (AWQ, compressed-tensors W4A16 and W8A8; W4A16 per channel for
the MoE, whose experts' 24 columns hold no group of 32) and FP8 block-scaled ones ([128, 128], as
Qwen3-VL-*-FP8) made from a tiny random image model (tests/int_checkpoints.py, tests/fp8_checkpoints.py,
tests/tiny_vl.py), in both tensor-naming layouts (transformers 5's model.language_model.* /
model.visual.*, and the older model.* / visual.*), and online FP8.

Each loads with only the language model quantized: the vision tower's linears are nn.Linear holding
exactly the checkpoint's float tensors, the MoE router float. Tensor-parallel ranks loaded tensor by
tensor hold what is cut from the whole model. Integer checkpoints keep the GPU's packed
layers (PACKED_INT_ON_CPU), so the checkpoint's names must meet the model's before the integer
conversion; the greedy tokens of a prompt with an image and one without equal transformers' on the
dequantized float twin (the MoE: the engine's on that twin, whose per-expert tensors transformers does
not read), fp32. FP8: the engine's greedy tokens (6 prompts, 3 with an image, 12 tokens) against the
same engine with its FP8 layers dequantized in place (quant/apply.dequantize_model), so only the
per-token activation rounding differs, under the FP8 KV cache's criterion (tests/kernel_helpers.py:
each side's token in the other's top 5 at a divergence, which comes only at a near-tie). Measured on the dense models:
90-94% of positions before the first divergence, 0.0007-0.0011 nats mean |logprob difference|, every
divergence within 0.003 nats.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from overnight import LLM, SamplingParams
from overnight.quant import apply
from overnight.quant.apply import dequantize_model
from overnight.quant.int_linear import WeightOnlyIntLinear
from overnight.quant.linear import Fp8Linear
from tests.fp8_checkpoints import make_fp8_checkpoint
from tests.int_checkpoints import make_int_checkpoint
from tests.kernel_helpers import NEAR_TIE, TOP, agreement
from tests.tiny_gemma_vl import gemma_cases, gemma_prompts
from tests.tiny_vl import hf_greedy, image, make_vl_checkpoint, words

NEW = 6
PLACEHOLDER = "<|vision_start|> <|image_pad|> <|vision_end|>"
ENGINE = dict(dtype="float32", device="cpu", kv_cache_memory_bytes=4 << 20, max_model_len=128)
KINDS = ["qwen2_5_vl", "qwen3_vl"]
LAYOUTS = ["transformers5", "legacy"]


def _legacy(name: str) -> str:
    if name.startswith("model.language_model."):
        return "model." + name.removeprefix("model.language_model.")
    return name.removeprefix("model.") if name.startswith("model.visual.") else name


def _transformers5(name: str) -> str:
    name = _legacy(name)
    if name.startswith("visual."):
        return "model." + name
    return "model.language_model." + name.removeprefix("model.") if name.startswith("model.") else name


RENAME = {"transformers5": _transformers5, "legacy": _legacy}


def in_layout(src: Path, dst: Path, layout: str) -> Path:
    """src with its tensors named in `layout`."""
    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    save_file({RENAME[layout](k): v for k, v in tensors.items()}, dst / "model.safetensors")
    return dst


@pytest.fixture(scope="module", params=KINDS)
def floats(request, tmp_path_factory) -> tuple[str, Path, dict[str, Path]]:
    """(kind, the folder transformers saved, that checkpoint in each layout)"""
    root = tmp_path_factory.mktemp(request.param)
    native = Path(make_vl_checkpoint(root, request.param))
    folders = {layout: in_layout(native, root / layout, layout) for layout in LAYOUTS}
    assert any(
        k.startswith("model.language_model.")
        for k in load_file(folders["transformers5"] / "model.safetensors")
    )
    assert any(k.startswith("visual.") for k in load_file(folders["legacy"] / "model.safetensors"))
    return request.param, native, folders


def cases(kind: str, n: int = 2) -> list[tuple[str, list]]:
    """n prompts, every other one with an image"""
    p = 14 if kind == "qwen2_5_vl" else 16
    return [
        (f"{words(3, i)} {PLACEHOLDER} {words(4, i + 10)}", [image(4 * p, 2 * p, i)])
        if i % 2
        else (words(6, i), [])
        for i in range(n)
    ]


def prompts(kind: str, n: int = 2) -> list:
    return [{"prompt": t, "multi_modal_data": {"image": imgs}} if imgs else t for t, imgs in cases(kind, n)]


def assert_tower_untouched(model: nn.Module, folder: Path) -> None:
    """Every linear of the tower is an nn.Linear holding the checkpoint's float tensors."""
    stored = {
        k.removeprefix("model."): v
        for k, v in load_file(folder / "model.safetensors").items()
        if "visual." in k
    }
    linears = {n: m for n, m in model.visual.named_modules() if isinstance(m, nn.Linear)}
    assert linears and all(type(m) is nn.Linear for m in linears.values())
    for name, module in linears.items():
        for part in ("weight", "bias"):
            assert torch.equal(getattr(module, part), as_loaded(stored, f"visual.{name}.{part}", module)), (
                name
            )


def as_loaded(stored: dict[str, torch.Tensor], name: str, module: nn.Linear) -> torch.Tensor:
    """A tower tensor of the checkpoint in the layout loading leaves (qwen_vit.SwiGLU.after_load_: gate
    and up fused into gate_up, the MLP's width padded with zeros)."""

    def rows(t: torch.Tensor, n: int) -> torch.Tensor:
        return torch.cat([t, t.new_zeros(n - t.shape[0], *t.shape[1:])])

    mlp, _, part = name.rpartition(".")
    if mlp.endswith(".gate_up"):
        base = mlp.removesuffix("gate_up")
        width = module.out_features // 2
        return torch.cat([rows(stored[f"{base}{p}.{part}"].float(), width) for p in ("gate_proj", "up_proj")])
    if mlp.endswith(".mlp.down_proj") and part == "weight":
        return rows(stored[name].float().t(), module.in_features).t()
    return stored[name].float()


@pytest.mark.parametrize("method", ["awq-g32", "ct-w4-g32-sym"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_int_checkpoint_matches_transformers_on_the_dequantized_twin(
    floats, layout, method, tmp_path, monkeypatch
):
    """AWQ (ignoring "visual", as Qwen2.5-VL-*-AWQ) and compressed-tensors W4A16 (ignoring
    re:.*visual\..*)."""
    kind, native, folders = floats
    monkeypatch.setattr(apply, "PACKED_INT_ON_CPU", True)  # the GPU's packed layers: names must meet
    quantized, _ = make_int_checkpoint(folders[layout], tmp_path / "int", method)
    llm = LLM(str(quantized), **ENGINE)
    model = llm.engine.runner.model  # type: ignore[attr-defined]
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, WeightOnlyIntLinear)
    assert isinstance(model.model.layers[2].mlp.down_proj, WeightOnlyIntLinear)
    assert_tower_untouched(model, quantized)
    # transformers on the twin of the checkpoint it saved (the other layout's differs only in names)
    from transformers import AutoModelForImageTextToText

    reference = native.parent / f"{method}-native-deq"
    if not reference.exists():
        make_int_checkpoint(native, native.parent / f"{method}-native", method)
    ref = AutoModelForImageTextToText.from_pretrained(reference, dtype=torch.float32).eval()
    outs = llm.generate(prompts(kind), SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True))
    tok = llm.get_tokenizer()
    for (text, imgs), out in zip(cases(kind), outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(
            str(reference), tok.encode(text), imgs, NEW, ref
        ), text


def _greedy(llm: LLM, kind: str) -> list[tuple[list[int], list[dict]]]:
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=TOP)
    outs = llm.generate(gemma_prompts() if kind == "gemma3" else prompts(kind, 6), params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]


def assert_fp8_agrees(folder: Path, kind: str, layer: type = Fp8Linear, **options) -> nn.Module:
    """The engine on `folder` against itself with its quantized layers (of type `layer`) dequantized."""
    llm = LLM(str(folder), **ENGINE, **options)
    model = llm.engine.runner.model  # type: ignore[attr-defined]
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, layer)
    assert isinstance(model.model.layers[-1].self_attn.o_proj, layer)
    reference = LLM(str(folder), **ENGINE, **options)
    dequantize_model(reference.engine.runner.model)  # type: ignore[attr-defined]
    agree = agreement(_greedy(reference, kind), _greedy(llm, kind))
    assert agree.share >= 0.25 and agree.mean_abs_dlogprob <= 0.1, agree
    assert agree.divergences_in_top and max(agree.divergence_gaps, default=0.0) < NEAR_TIE, agree
    return model


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_block_checkpoint_agrees_with_its_dequantized_weights(floats, layout, tmp_path):
    kind, _, folders = floats
    folder = make_fp8_checkpoint(folders[layout], tmp_path / "fp8", "fp8-block")
    ignored = json.loads((folder / "config.json").read_text())["quantization_config"][
        "modules_to_not_convert"
    ]
    assert "lm_head" in ignored and all("visual." in m for m in ignored[1:]) and len(ignored) > 8
    model = assert_fp8_agrees(folder, kind)
    assert_tower_untouched(model, folder)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_w8a8_checkpoint_agrees_with_its_dequantized_weights(floats, layout, tmp_path, monkeypatch):
    """compressed-tensors W8A8 (int8 weights per channel, activations per token, as
    RedHatAI/Qwen2.5-VL-*-quantized.w8a8): its activation rounding judged as FP8's."""
    from overnight.quant.int_linear import Int8Linear

    kind, _, folders = floats
    monkeypatch.setattr(apply, "PACKED_INT_ON_CPU", True)
    folder, _ = make_int_checkpoint(folders[layout], tmp_path / "w8a8", "ct-w8a8")
    model = assert_fp8_agrees(folder, kind, layer=Int8Linear)
    assert_tower_untouched(model, folder)


def test_online_fp8_quantizes_the_language_model_only(floats):
    kind, _, folders = floats
    model = assert_fp8_agrees(folders["transformers5"], kind, quantization="fp8")
    assert_tower_untouched(model, folders["transformers5"])


def test_ignore_lists_name_modules_in_either_layout(floats):
    """An ignore list in transformers 5's names (model.language_model.*, model.visual.*) keeps those
    modules in the compute dtype, as one in the model's own names does; other layers are quantized."""
    from overnight.models.registry import arch_from_hf_config, model_class_for
    from overnight.quant.apply import quantize_model
    from overnight.quant.scheme import QuantScheme

    _, native, _ = floats
    arch = arch_from_hf_config(json.loads((native / "config.json").read_text()))
    for down in ("model.language_model.layers.1.mlp.down_proj", "model.layers.1.mlp.down_proj"):
        with torch.device("meta"):
            model = model_class_for(arch)(arch)
        quantize_model(model, QuantScheme(prequantized=True, ignore=(down, r"re:model\.visual\..*")))
        layers = model.model.layers
        assert type(layers[1].mlp.down_proj) is nn.Linear, down
        assert isinstance(layers[0].mlp.down_proj, Fp8Linear)
        assert isinstance(layers[1].mlp.gate_up_proj, Fp8Linear)
        assert all(not isinstance(m, Fp8Linear) for m in model.visual.modules())


# -- Qwen3-VL-MoE: quantized checkpoints store each expert's projections apart, as the published ones do --


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> dict[str, Path]:
    """The tiny Qwen3-VL-MoE with its fused experts split (mlp.experts.<e>.gate_proj ...), per layout."""
    root = tmp_path_factory.mktemp("qwen3_vl_moe")
    native = Path(make_vl_checkpoint(root, "qwen3_vl_moe"))
    split: dict[str, torch.Tensor] = {}
    for name, t in load_file(native / "model.safetensors").items():
        prefix = name.removesuffix("gate_up_proj").removesuffix("down_proj")
        if name.endswith("mlp.experts.gate_up_proj"):  # transformers 5: [E, 2I, H]
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                split[f"{prefix}{e}.gate_proj.weight"] = t[e, :inter].contiguous()
                split[f"{prefix}{e}.up_proj.weight"] = t[e, inter:].contiguous()
        elif name.endswith("mlp.experts.down_proj"):  # [E, H, I]
            for e in range(t.shape[0]):
                split[f"{prefix}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            split[name] = t
    out = {}
    for layout in LAYOUTS:
        folder = root / f"split-{layout}"
        shutil.copytree(native, folder)
        save_file({RENAME[layout](k): v for k, v in split.items()}, folder / "model.safetensors")
        out[layout] = folder
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_moe_w4a16_checkpoint_matches_the_engine_on_its_dequantized_twin(moe, layout, tmp_path, monkeypatch):
    """compressed-tensors W4A16 per channel (the experts' 24 columns hold no group of 32)."""
    monkeypatch.setattr(apply, "PACKED_INT_ON_CPU", True)
    quantized, twin = make_int_checkpoint(moe[layout], tmp_path / "w4a16", "ct-w4-channel-asym")
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    llm = LLM(str(quantized), **ENGINE)
    model = llm.engine.runner.model  # type: ignore[attr-defined]
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, WeightOnlyIntLinear)
    assert type(model.model.layers[0].mlp.gate) is nn.Linear  # the router stays float
    assert_tower_untouched(model, quantized)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts("qwen3_vl_moe"), params)]
    ref = LLM(str(twin), **ENGINE)
    assert got == [list(o.outputs[0].token_ids) for o in ref.generate(prompts("qwen3_vl_moe"), params)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_moe_fp8_block_checkpoint_agrees_with_its_dequantized_weights(moe, layout, tmp_path):
    folder = make_fp8_checkpoint(moe[layout], tmp_path / "fp8", "fp8-block")
    stored = load_file(folder / "model.safetensors")
    assert any(k.endswith("experts.3.down_proj.weight_scale_inv") for k in stored)
    model = assert_fp8_agrees(folder, "qwen3_vl_moe")
    assert model.model.layers[0].mlp.experts.gate_up_scale is not None  # experts dequantized, then FP8 again
    assert type(model.model.layers[0].mlp.gate) is nn.Linear
    assert_tower_untouched(model, folder)


def test_qwen35_tower_stays_float_under_an_integer_scheme(tmp_path):
    """Qwen3.5's image model (whose hybrid layers take integer, not FP8, weights): its tower stays
    nn.Linear under a scheme whose ignore list names the tower in transformers 5's names (or not at
    all), and an ignore entry model.language_model.* keeps that text layer float."""
    from overnight.models.registry import arch_from_hf_config, model_class_for
    from overnight.quant.apply import quantize_model
    from overnight.quant.int_scheme import IntScheme

    folder = Path(make_vl_checkpoint(tmp_path, "qwen3_5"))
    arch = arch_from_hf_config(json.loads((folder / "config.json").read_text()))
    kept = "model.language_model.layers.3.mlp.down_proj"
    for ignore in ((kept, "model.visual.blocks.0.attn.qkv"), (kept,)):
        with torch.device("meta"):
            model = model_class_for(arch)(arch)
        quantize_model(model, IntScheme("compressed-tensors", 4, 32, True, ignore=ignore))
        assert isinstance(model.model.layers[0].linear_attn.out_proj, WeightOnlyIntLinear)
        assert type(model.model.layers[3].mlp.down_proj) is nn.Linear
        assert isinstance(model.model.layers[2].mlp.down_proj, WeightOnlyIntLinear)
        assert all(type(m) is nn.Linear for m in model.visual.modules() if isinstance(m, nn.Linear))


@pytest.mark.parametrize("method", ["awq-g32", "fp8-block"])
def test_tensor_parallel_shards_of_quantized_checkpoints(floats, method, tmp_path, monkeypatch):
    """Each of 2 ranks, its tensors renamed before they are converted and sliced as they stream in,
    holds exactly what tensor parallelism cuts from the whole loaded model (transformers 5's names)."""
    from overnight.loader.resolve import resolve_source
    from tests.tp_helpers import streamed_equals_sliced

    _, _, folders = floats
    monkeypatch.setattr(apply, "PACKED_INT_ON_CPU", True)
    if method == "fp8-block":
        folder = make_fp8_checkpoint(folders["transformers5"], tmp_path / "fp8", method)
    else:
        folder, _ = make_int_checkpoint(folders["transformers5"], tmp_path / "int", method)
    source = resolve_source(str(folder))
    for rank in range(2):
        streamed = streamed_equals_sliced(source, rank)
        assert type(streamed.model.layers[0].mlp.down_proj) is not nn.Linear  # quantized, row-parallel
        assert all(type(m) is nn.Linear for m in streamed.visual.modules() if isinstance(m, nn.Linear))


def assert_gemma_tower_untouched(model: nn.Module, folder: Path) -> None:
    """The SigLIP tower's and projector's linears are nn.Linear holding the checkpoint's tensors."""
    stored = {
        k.removeprefix("model.").replace("vision_model.", ""): v
        for k, v in load_file(folder / "model.safetensors").items()
    }
    tower = [
        (n, m)
        for n, m in model.named_modules()
        if n.startswith(("vision_tower.", "multi_modal_projector.")) and isinstance(m, nn.Linear)
    ]
    assert tower and all(type(m) is nn.Linear for _, m in tower)
    for name, module in tower:
        assert torch.equal(module.weight, stored[f"{name}.weight"].float()), name


@pytest.fixture(scope="module")
def gemma(tmp_path_factory) -> Path:
    from tests.tiny_gemma_vl import make_gemma_vl_checkpoint

    return Path(make_gemma_vl_checkpoint(tmp_path_factory.mktemp("gemma3_vl")))


@pytest.mark.parametrize("layout", ["fp8-block", "online"])
def test_gemma3_fp8_agrees_with_its_dequantized_weights(gemma, layout, tmp_path):
    if layout == "online":
        model = assert_fp8_agrees(gemma, "gemma3", quantization="fp8")
        assert_gemma_tower_untouched(model, gemma)
    else:
        folder = make_fp8_checkpoint(gemma, tmp_path / "fp8", layout)
        assert_gemma_tower_untouched(assert_fp8_agrees(folder, "gemma3"), folder)


def test_gemma3_int_checkpoint_matches_transformers_on_the_dequantized_twin(gemma, tmp_path, monkeypatch):
    """Gemma 3's image checkpoint (language_model.model.*, vision_tower.vision_model.*) in
    compressed-tensors W4A16, its SigLIP tower and projector ignored: renamed before the integer
    conversion, the tower float, a text prompt's and an image prompt's tokens transformers' on the twin."""
    from tests.tiny_gemma_vl import hf_reference

    monkeypatch.setattr(apply, "PACKED_INT_ON_CPU", True)
    quantized, twin = make_int_checkpoint(gemma, tmp_path / "w4a16", "ct-w4-g32-sym")
    llm = LLM(str(quantized), **ENGINE)
    model = llm.engine.runner.model  # type: ignore[attr-defined]
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, WeightOnlyIntLinear)
    assert_gemma_tower_untouched(model, quantized)
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    outs = llm.generate(gemma_prompts(2), params)
    ref = hf_reference(str(twin))
    for (text, imgs), out in zip(gemma_cases(2), outs):
        assert list(out.outputs[0].token_ids) == ref.greedy(text, imgs, NEW)[1], text


def test_fp8_checkpoint_with_a_quantized_tower_loads_it_dequantized(floats, tmp_path):
    """A checkpoint that quantized the tower anyway (no ignore entry for it): its FP8 tower tensors are
    dequantized with their scales as they load, and the tower runs in the compute dtype."""
    from overnight.quant.fp8 import dequantize_weight, expand_block_scales, quantize_weight_blocks

    kind, _, folders = floats
    folder = make_fp8_checkpoint(folders["transformers5"], tmp_path / "fp8", "fp8-block-small")
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]["modules_to_not_convert"]
    (folder / "config.json").write_text(json.dumps(config))
    tensors = load_file(folder / "model.safetensors")
    qkv = "model.visual.blocks.1.attn.qkv"
    data, grid = quantize_weight_blocks(tensors[f"{qkv}.weight"].float(), (16, 32))
    tensors[f"{qkv}.weight"], tensors[f"{qkv}.weight_scale_inv"] = data, grid
    save_file(tensors, folder / "model.safetensors")
    model = LLM(str(folder), **ENGINE).engine.runner.model  # type: ignore[attr-defined]
    loaded = model.visual.blocks[1].attn.qkv
    assert type(loaded) is nn.Linear
    rows = expand_block_scales(grid, 16, data.shape[0])
    assert torch.equal(loaded.weight, dequantize_weight(data, rows).float())
