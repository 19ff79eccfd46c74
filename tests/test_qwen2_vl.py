"""Tier (c) for Qwen2-VL with images: Qwen2VLForConditionalGeneration against transformers' model and its
own Qwen2VLProcessor, token-exact greedy in fp32 (each token's logprob within 1e-4 too), on a tiny random
checkpoint (tests/tiny_vl.py: a tower of LayerNorm blocks with quick_gelu fc1 / fc2 MLPs, no windows,
M-RoPE sections [2, 3, 3] not interleaved): the expanded prompt ids equal the processor's; a text-only
prompt, one image and two images of different sizes in one batch through LLM.generate, with prefill
chunks that end inside an image; LLM.chat with image_url data: URIs; the prefix cache telling two
images apart; the tower over several images against transformers' image features; the parameter count
(ours, transformers', ModelArch.num_parameters) and the start-up encoder run; the qwen2-vl-7b preset's
shapes; config reading and refusals; an AWQ checkpoint (the tower kept float); tensor parallelism (the tower
replicated; slow: TP=2 generation token-exact); and, slow, run-batch lines and the server. Text-only mode (limit_mm_per_prompt image 0) is in
tests/test_text_only_images.py, the caption workload on the preset in tests/test_bench_caption.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from overnight import SamplingParams
from overnight.errors import ModelLoadError
from overnight.models.registry import arch_from_hf_config
from tests import image_checks
from tests.parity_helpers import cpu_model
from tests.tiny_vl import (
    IMAGE_PAD,
    TOKENS,
    ProcessorReference,
    check_run_batch_and_server,
    image,
    make_vl_checkpoint,
    words,
)

NEW = 6
P = 14  # patch size: an image of (a P) x (b P) pixels (a, b even) has a * b / 4 tokens
BUDGET = 10  # max_num_batched_tokens: the 12-token image spans two prefill chunks
PLACEHOLDER = "<|vision_start|> <|image_pad|> <|vision_end|>"
START, END = TOKENS.index("<|vision_start|>"), TOKENS.index("<|vision_end|>")
PARAMS = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, logprobs=0)


def qwen2_vl_processor(folder: str) -> Any:
    """transformers' Qwen2VLProcessor on the folder's tokenizer and PIL image processor. Its video processor
    needs torchvision (absent here): built without one, as no video is sent."""
    from transformers import AutoTokenizer, Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.processing_utils import ProcessorMixin

    check = ProcessorMixin.check_argument_for_proper_class

    def without_video(self: Any, name: str, arg: Any) -> Any:
        return None if name == "video_processor" and arg is None else check(self, name, arg)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(ProcessorMixin, "check_argument_for_proper_class", without_video)
        return Qwen2VLProcessor(
            image_processor=Qwen2VLImageProcessorPil.from_pretrained(folder),
            tokenizer=AutoTokenizer.from_pretrained(folder),
            video_processor=None,
        )


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    # seed 1: a checkpoint whose greedy tokens follow the image even where it is one token of 37
    folder = make_vl_checkpoint(tmp_path_factory.mktemp("qwen2_vl"), "qwen2_vl", seed=1)
    llm = image_checks.cpu_vl_llm(folder, max_num_batched_tokens=BUDGET, max_model_len=256)
    return folder, llm, ProcessorReference(folder, qwen2_vl_processor(folder))


CASES = [
    (words(7, 0), []),
    (f"{words(3, 1)} {PLACEHOLDER} {words(1, 2)}", [(4 * P, 6 * P, 2)]),
    (f"{PLACEHOLDER} {words(2, 3)} {PLACEHOLDER} {words(5, 4)}", [(2 * P, 2 * P, 1), (4 * P, 6 * P, 2)]),
    (f"{words(3, 1)} {PLACEHOLDER} {words(1, 2)}", [(4 * P, 6 * P, 9)]),  # case 1, another image
    (f"{words(20, 5)} {PLACEHOLDER}", [(8 * P, 6 * P, 3)]),  # 12 image tokens: more than a chunk
]


def test_generate_with_images_token_exact(setup, monkeypatch):
    folder, llm, ref = setup
    vision = image_checks.engine_of(llm).runner.vision  # type: ignore[attr-defined]
    rows_per_step: list[int] = []
    real_rows = vision.rows

    def counting_rows(scheduled: Any) -> Any:
        out = real_rows(scheduled)
        if out is not None:
            rows_per_step.append(int(out.rows.numel()))
        return out

    monkeypatch.setattr(vision, "rows", counting_rows)
    outs = image_checks.check_generate_cases(llm, ref, CASES, PARAMS, NEW)
    ids = outs[1].prompt_token_ids
    start = ids.index(START)
    assert ids[start : start + 8] == [START, *[IMAGE_PAD] * 6, END]  # (4 x 6 patches) / 4
    assert outs[2].prompt_token_ids.count(IMAGE_PAD) == 1 + 6
    # the image is read: another image of the same size moves the logprobs (tokens may agree)
    a, b = outs[1].outputs[0].cumulative_logprob, outs[3].outputs[0].cumulative_logprob
    assert a is not None and b is not None and abs(a - b) > 1e-2
    # every image row went through a step, and some image was split between two chunks
    assert sum(rows_per_step) == 6 + 7 + 6 + 12
    assert any(0 < r < 6 for r in rows_per_step), rows_per_step


def test_chat_image_url_parts(setup):
    folder, llm, ref = setup
    image_checks.check_chat_image_parts(
        llm, ref, [image(4 * P, 2 * P, 7), words(4, 9), image(2 * P, 4 * P, 8)], PARAMS, NEW
    )


def test_prefix_cache_tells_images_apart(setup):
    folder, llm, ref = setup
    text = f"{words(20, 20)} {PLACEHOLDER} {words(16, 21)}"
    image_checks.check_prefix_cache_tells_images_apart(
        llm, ref, text, (START, END), PARAMS, NEW, opening_marker=True
    )


def test_tower_on_several_images_matches_transformers(setup):
    """Images of different grids encoded in one call (attention never crossing an image, no windows)
    give transformers' image features; a resized odd-sized image too."""
    folder, llm, ref = setup
    imgs = [image(4 * P, 6 * P, 31), image(2 * P, 2 * P, 32), image(90, 50, 33)]
    inputs = ref.processor.image_processor(images=imgs, return_tensors="pt")
    grids = [tuple(int(x) for x in g) for g in inputs["image_grid_thw"]]
    model = cpu_model(folder)  # transformers' reference runs on the CPU: ours does too
    with torch.inference_mode():
        got = model.embed_images(inputs["pixel_values"], grids).embeds
        want = ref.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
    want = torch.cat(list(want)) if isinstance(want, (list, tuple)) else want
    assert got.shape == (sum(t * h * w for t, h, w in grids) // 4, 64)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_parameter_count_and_config(setup):
    folder, llm, ref = setup
    arch = image_checks.check_parameter_count(folder, ref)
    v = arch.vision
    assert arch.architecture == "qwen2_vl" and v is not None
    assert (v.kind, v.hidden_size, v.intermediate_size, v.out_hidden_size) == ("qwen2_vl", 32, 64, 64)
    assert v.hidden_act == "quick_gelu" and v.window_size == 0 and v.fullatt_block_indexes == ()
    assert arch.mrope_section == (2, 3, 3) and not arch.mrope_interleaved
    # the start-up memory run: one image of the processor's max_pixels, (8 P)^2: 8 x 8 patches
    assert image_checks.start_up_encoder_grids(llm, folder) == [[(1, 8, 8)]]


def test_config_refusals(setup):
    folder, llm, ref = setup
    with open(Path(folder) / "config.json") as f:
        cfg = json.load(f)
    v = cfg["vision_config"]
    for change, match in (
        ({**v, "hidden_act": "relu"}, "unsupported Qwen2-VL vision hidden_act 'relu'"),
        ({**v, "mlp_ratio": 0}, "positive embed_dim, mlp_ratio and hidden_size"),
        ({**v, "embed_dim": 30}, "multiple of 4"),
        ({k: x for k, x in v.items() if k != "depth"}, "lacks required field 'depth'"),
    ):
        with pytest.raises(ModelLoadError, match=match):
            arch_from_hf_config({**cfg, "vision_config": change})
    text = {**cfg["text_config"], "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3]}}
    with pytest.raises(ModelLoadError, match="mrope_section"):
        arch_from_hf_config({**cfg, "text_config": text})


def test_dummy_preset_has_the_published_shapes():
    """qwen2-vl-7b (Qwen/Qwen2-VL-7B-Instruct): a 32-block tower of width 1280 (MLP 5120, quick_gelu)
    merging into Qwen2-7B's decoder (3584 wide, 28 layers, 4 KV heads); ours, transformers' and
    ModelArch.num_parameters count the same 8.29B (the tower and merger 675M); the published image
    preprocessing (min 3136, max 12845056 pixels) when no preprocessor_config.json is there."""
    from transformers import AutoModelForImageTextToText, Qwen2VLConfig

    from overnight.loader.model_loader import build_model
    from overnight.loader.resolve import resolve_source
    from overnight.multimodal.qwen_pixels import qwen_image_processor

    source = resolve_source("qwen2-vl-7b", load_format="dummy")
    arch, vision = source.arch, source.arch.vision
    assert vision is not None and (vision.depth, vision.hidden_size, vision.intermediate_size) == (
        32,
        1280,
        5120,
    )
    assert (vision.out_hidden_size, vision.hidden_act, vision.window_size) == (3584, "quick_gelu", 0)
    assert (arch.num_hidden_layers, arch.hidden_size, arch.num_key_value_heads) == (28, 3584, 4)
    assert arch.mrope_section == (16, 24, 24) and not arch.mrope_interleaved and arch.attention_bias
    with open(Path(__file__).parents[1] / "overnight/loader/presets/qwen2-vl-7b.json") as f:
        cfg = {k: v for k, v in json.load(f).items() if k not in ("architectures", "model_type")}
    with torch.device("meta"):
        theirs = AutoModelForImageTextToText.from_config(Qwen2VLConfig(**cfg))
    ours = build_model(source, torch.bfloat16, "meta")
    count = sum(p.numel() for p in ours.parameters())
    assert count == arch.num_parameters() == sum(p.numel() for p in theirs.parameters()) == 8_291_375_616
    assert vision.num_parameters() == sum(p.numel() for p in theirs.model.visual.parameters()) == 675_759_104
    hf = qwen_image_processor(vision, None)
    assert (hf.size.shortest_edge, hf.size.longest_edge) == (3136, 12845056)


def test_tensor_parallel_replicates_the_tower(setup):
    """Each TP=2 rank's share loaded as the checkpoint streams equals slicing the whole model; the tower
    (merger included) is whole on every rank, the decoder's qkv_proj halved."""
    folder, llm, ref = setup
    image_checks.check_tower_replicated(folder, ("visual.",))


@pytest.mark.slow  # starts tensor-parallel processes
def test_tensor_parallel_generation_with_images(setup):
    folder, llm, ref = setup
    image_checks.check_tensor_parallel_cases(
        folder, ref, CASES[:3], PARAMS, NEW, max_num_batched_tokens=BUDGET, max_model_len=256
    )


@pytest.mark.slow
def test_run_batch_and_server(setup, tmp_path):
    folder, llm, ref = setup
    from tests.tiny_vl import WORDS

    check_run_batch_and_server(llm, folder, WORDS, tmp_path, max_model_len=256, new_tokens=NEW)


def test_awq_checkpoint_keeps_the_tower_float(setup, tmp_path, monkeypatch):
    """An AWQ checkpoint (ignoring "visual", as Qwen2-VL-*-AWQ): only the language model quantized (the
    GPU's packed layers), the tower's linears the checkpoint's float tensors; greedy tokens with and
    without an image equal transformers' on the dequantized twin."""
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from overnight import LLM
    from overnight.quant import apply
    from overnight.quant.int_linear import WeightOnlyIntLinear
    from tests.int_checkpoints import make_int_checkpoint
    from tests.tiny_vl import hf_greedy

    folder, llm, ref = setup
    monkeypatch.setattr(apply, "PACKED_INT_ON_CPU", True)  # the names must meet before packing
    quantized, twin = make_int_checkpoint(Path(folder), tmp_path / "awq", "awq-g32")
    engine = LLM(str(quantized), dtype="float32", kv_cache_memory_bytes=4 << 20, max_model_len=128)
    model = image_checks.engine_of(engine).runner.model  # type: ignore[attr-defined]
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, WeightOnlyIntLinear)
    stored = {k.removeprefix("model."): v for k, v in load_file(quantized / "model.safetensors").items()}
    linears = {n: m for n, m in model.visual.named_modules() if isinstance(m, torch.nn.Linear)}
    assert len(linears) == 2 * 4 + 2 and all(type(m) is torch.nn.Linear for m in linears.values())
    for name, module in linears.items():
        assert torch.equal(module.weight, stored[f"visual.{name}.weight"].float()), name
    theirs = AutoModelForImageTextToText.from_pretrained(twin, dtype=torch.float32).eval()
    cases = [(words(6, 0), []), (f"{words(3, 1)} {PLACEHOLDER} {words(4, 2)}", [image(4 * P, 2 * P, 1)])]
    prompts = [{"prompt": t, "multi_modal_data": {"image": i}} if i else t for t, i in cases]
    outs = engine.generate(prompts, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True))
    tok = engine.get_tokenizer()
    for (text, imgs), out in zip(cases, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(str(twin), tok.encode(text), imgs, NEW, theirs)
