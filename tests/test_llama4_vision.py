"""Tier (c) for Llama 4 with images: against transformers' Llama4ForConditionalGeneration and its
Llama4Processor's expansion of <|image|>, token-exact greedy in fp32 (each token's logprob within 1e-4
too), on a tiny random checkpoint (tests/tiny_llama4_vl.py): the expanded prompt ids equal the HF
processor's; one image, two images of different canvases in one prompt and a text-only prompt in one
batch through LLM.generate with multi_modal_data, with 16-token prefill chunks that end inside images;
LLM.chat with image_url data: URIs; a prefix-cache hit on the same image and none past the start of a
different one; the tower over several images' tiles in one call against transformers' image features;
the tiles against transformers' Llama4ImageProcessor (where torchvision, its backend, is installed) and
the canvas choice on hand-worked sizes; the config reader and its refusals; the parameter count and the
start-up encoder run; tensor-parallel shards (the tower whole on each rank) and, slow, TP=2 generation;
online FP8 with the tower float; and, slow, run-batch lines and the server. Text-only mode is in test_text_only_images.py."""

from __future__ import annotations

import json

import pytest
import torch

from overnight import LLM, SamplingParams
from overnight.errors import ModelLoadError
from overnight.models.registry import arch_from_hf_config
from overnight.multimodal.llama4_prompt import Llama4Prompt, Llama4Tiles
from tests import image_checks
from tests.parity_helpers import cpu_model
from tests.tiny_llama4_vl import (
    IDS,
    MAX_TILES,
    PER_TILE,
    TILE,
    WORDS,
    hf_image_processor,
    hf_reference,
    make_llama4_vl_checkpoint,
)
from tests.tiny_vl import check_run_batch_and_server, image, words

NEW = 8
BUDGET = 16  # max_num_batched_tokens: an image of 4 tiles (4 x 5 + 5 span tokens) takes several chunks
START, END, PATCH = IDS["<|image_start|>"], IDS["<|image_end|>"], IDS["<|patch|>"]
IMG, XSEP, YSEP = IDS["<|image|>"], IDS["<|tile_x_separator|>"], IDS["<|tile_y_separator|>"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = make_llama4_vl_checkpoint(tmp_path_factory.mktemp("llama4_vl"))
    llm = image_checks.cpu_vl_llm(folder, max_num_batched_tokens=BUDGET, max_model_len=512)
    return folder, llm, hf_reference(folder)


def prompt(*parts: str) -> str:
    return "<|begin_of_text|> <|header_start|> " + " ".join(parts) + " <|eot|> <|header_start|>"


CASES = [
    (prompt(words(3, 1, WORDS), "<|image|>", words(4, 2, WORDS)), [(16, 12, 1)]),  # one tile
    # 50 x 20 (w x h): a 1 x 3 canvas; 30 x 70: 3 x 1; each with the whole image after its tiles
    (prompt("<|image|>", words(2, 3, WORDS), "<|image|>", words(5, 4, WORDS)), [(50, 20, 2), (30, 70, 3)]),
    (prompt(words(7, 0, WORDS)), []),
    (prompt(words(3, 1, WORDS), "<|image|>", words(4, 2, WORDS)), [(16, 12, 5)]),  # case 0, another image
]
PARAMS = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, logprobs=0)


def test_generate_with_images_token_exact(setup):
    folder, llm, ref = setup
    outs = image_checks.check_generate_cases(llm, ref, CASES, PARAMS, NEW)
    ids = outs[0].prompt_token_ids  # one tile: no canvas tiles, only <|image|> and its patches
    start = ids.index(START)
    assert ids[start : start + PER_TILE + 3] == [START, IMG] + [PATCH] * PER_TILE + [END]
    ids = outs[1].prompt_token_ids  # a 1 x 3 canvas, then a 3 x 1 one
    assert ids.index(START) < BUDGET < ids.index(END)  # the first prefill chunk ends inside the image
    first = ids[ids.index(START) + 1 : ids.index(END)]
    tile = [PATCH] * PER_TILE
    assert first == tile + [XSEP] + tile + [XSEP] + tile + [YSEP] + [IMG] + tile
    assert ids.count(PATCH) == (4 + 4) * PER_TILE and ids.count(YSEP) == 1 + 3
    assert outs[0].outputs[0].token_ids != outs[3].outputs[0].token_ids  # the image is read


def test_chat_image_url_parts(setup):
    folder, llm, ref = setup
    image_checks.check_chat_image_parts(
        llm, ref, [image(70, 35, 7), words(4, 9, WORDS), image(16, 40, 8)], PARAMS, NEW
    )


def test_prefix_cache_tells_images_apart(setup):
    """A repeated prompt hits the prefix cache past its image (the tower runs once for it); the same text
    with another image hits only the blocks before the image starts. Both still match transformers."""
    folder, llm, ref = setup
    text = prompt(words(20, 20, WORDS), "<|image|>", words(20, 21, WORDS))
    image_checks.check_prefix_cache_tells_images_apart(
        llm, ref, text, (START, END), PARAMS, NEW, opening_marker=True
    )


def test_bad_image_prompts_are_refused(setup):
    folder, llm, ref = setup
    image_checks.check_bad_image_prompts_refused(
        llm, prompt("<|image|> w20"), "<|image|>", Llama4Prompt, r"no <\|image\|> / <\|tile_x_separator\|> / "
    )


def test_tower_on_several_images_matches_transformers(setup):
    """Images of different canvases encoded in one call give transformers' image features (projected)
    at their <|patch|> rows, zeros at the separators and <|image|>."""
    folder, llm, ref = setup
    imgs = [image(50, 20, 31), image(16, 16, 32), image(30, 70, 33)]
    ours = [llm._images.pixels(im) for im in imgs]  # type: ignore[union-attr]
    assert [g for _, g, _ in ours] == [(4, 4, 12), (1, 4, 4), (4, 12, 4)]
    model = cpu_model(folder)  # transformers' reference runs on the CPU: ours does too
    pixels = torch.cat([p for p, _, _ in ours])
    with torch.inference_mode():
        got = model.embed_images(pixels, [g for _, g, _ in ours]).embeds
        tiles = pixels.view(-1, 3, TILE, TILE)
        feats = ref.model.get_image_features(
            tiles, vision_feature_select_strategy="default"
        ).last_hidden_state
        want = ref.model.multi_modal_projector(feats.flatten(0, 1))
    span = [t for _, g, _ in ours for t in Llama4Prompt(model.arch.vision, folder).span(g)]
    assert got.shape[0] == len(span) == sum(model.arch.vision.num_tokens(g) for _, g, _ in ours)
    is_patch = torch.tensor(span) == PATCH
    torch.testing.assert_close(got[is_patch], want, atol=1e-5, rtol=1e-5)
    assert not got[~is_patch].any()
    for grids, match in (
        ([(4, 4, 12), (1, 4, 4)], "not the 5 tiles"),  # an image short
        ([(4, 4, 12), (1, 4, 4), (4, 12, 5)], "not a canvas"),
        ([(4, 4, 12), (2, 4, 4), (3, 12, 4)], "not a canvas"),  # one tile has no whole-image tile
    ):
        with pytest.raises(ValueError, match=match):
            model.embed_images(pixels, grids)


SIZES = [(16, 16), (16, 12), (20, 20), (50, 20), (30, 70), (7, 3), (200, 90), (33, 65), (64, 16), (17, 300)]


def test_canvas_choice():
    """Hand-worked canvases (16-pixel tiles, at most 4): the least upscaling without distortion, else
    the least downscaling; the smaller area on a tie."""
    tiles = Llama4Tiles(size=16, max_patches=4)
    for (h, w), canvas in {
        (16, 16): (16, 16),  # fits one tile exactly
        (12, 16): (16, 16),  # upscaled by 4 / 3 at most: one tile
        (20, 20): (32, 32),  # 2 x 2 upscales by 1.6, the least above 1 (1 x 1 would shrink it)
        (20, 50): (16, 48),  # nothing upscales; 1 x 4 and 1 x 3 both scale by 0.8 (the height): 1 x 3 smaller
        (70, 30): (48, 16),  # 4 x 1 and 3 x 1 both scale by 16 / 30 (the width), 2 x 1 by 32 / 70 only
        (90, 200): (16, 48),  # 1 x 4 and 1 x 3 by 16 / 90; 2 x 2 by 32 / 200
    }.items():
        got = tuple(int(x) for x in tiles.canvas(h, w))
        assert got == canvas, (h, w)
    out = tiles(images=[image(50, 20, 0)])
    assert out["pixel_values"].shape == (4, 3, 16, 16) and out["aspect_ratios"] == [(1, 3)]
    assert tiles(images=[image(16, 16, 0)])["pixel_values"].shape == (1, 3, 16, 16)


def test_tiles_equal_transformers_image_processor(setup):
    """Our tiles equal transformers' Llama4ImageProcessor's (bfloat16 values) on images of many shapes
    and its canvas grids. Skipped without torchvision, the HF processor's backend."""
    pytest.importorskip("torchvision")
    folder, llm, _ = setup
    hf = hf_image_processor(folder)
    assert hf is not None
    ours = llm._images.hf  # type: ignore[union-attr]
    for i, (w, h) in enumerate(SIZES):
        img = image(w, h, 40 + i)
        want, got = hf(images=[img], return_tensors="pt"), ours(images=[img])
        assert [tuple(int(x) for x in r) for r in want["aspect_ratios"]] == got["aspect_ratios"], (w, h)
        assert torch.equal(want["pixel_values"].float(), got["pixel_values"]), (w, h)


def test_config_reading_and_refusals(setup):
    folder, llm, ref = setup
    with open(f"{folder}/config.json") as f:
        cfg = json.load(f)
    arch = arch_from_hf_config(cfg)
    v = arch.vision
    assert v is not None and v.kind == "llama4" and arch.architecture == "llama4"
    assert (v.image_size, v.patch_size, v.spatial_merge_size, v.projector_hidden_size) == (TILE, 4, 2, 48)
    assert (v.image_token_id, v.vision_start_token_id, v.vision_end_token_id) == (PATCH, START, END)
    assert arch_from_hf_config({**cfg, "vision_config": None}).vision is None  # the text model alone
    bad = {
        "pixel_shuffle_ratio": (0.3, "pixel_shuffle_ratio must be 1 / n"),
        "intermediate_size": (64, "must equal hidden_size x"),
        "projector_output_dim": (32, "adapter widths must be equal"),
        "image_size": (18, "must be whole patches"),
        "num_attention_heads": (16, "multiple of 4"),  # head_dim 2
    }
    for field, (value, match) in bad.items():
        with pytest.raises(ModelLoadError, match=match):
            arch_from_hf_config({**cfg, "vision_config": {**cfg["vision_config"], field: value}})


def test_checkpoint_layouts():
    """The published layout (vision_model.*, language_model.model.*) and a model.-prefixed one name the
    same modules; built text-only the tower's tensors are dropped."""
    from overnight.models.llama4 import llama4_names

    t = torch.zeros(1)
    names = [
        "vision_model.model.layers.0.mlp.fc1.weight",
        "model.vision_model.patch_embedding.linear.weight",
        "model.multi_modal_projector.linear_1.weight",
        "language_model.model.layers.0.feed_forward.router.weight",
        "model.language_model.layers.0.self_attn.q_proj.weight",
        "language_model.lm_head.weight",
    ]
    text = [
        "model.layers.0.mlp.router.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "lm_head.weight",
    ]
    tower = [
        "vision_model.model.layers.0.mlp.fc1.weight",
        "vision_model.patch_embedding.linear.weight",
        "multi_modal_projector.linear_1.weight",
    ]
    assert [n for n, _ in llama4_names([(n, t) for n in names], keep_tower=True)] == tower + text
    assert [n for n, _ in llama4_names([(n, t) for n in names])] == text


def test_parameter_count_and_start_up_encoder_run(setup):
    """ModelArch.num_parameters (the memory check's count) equals the built model's and transformers',
    tower, adapter and projector included; the start-up memory run encodes the image of most tiles."""
    folder, llm, ref = setup
    image_checks.check_parameter_count(folder, ref)
    # a 1 x 4 canvas and the whole image: 25 tokens
    assert image_checks.start_up_encoder_grids(llm, folder) == [[(MAX_TILES + 1, 4, 4 * MAX_TILES)]]


def test_tensor_parallel_replicates_the_tower(setup):
    """Each rank's share loaded as the checkpoint streams equals slicing the whole model; the tower and
    projector are whole on every rank (their q / k / v projections are not the decoder's)."""
    folder, llm, ref = setup
    image_checks.check_tower_replicated(folder, ("vision_model.", "multi_modal_projector."))


@pytest.mark.slow  # starts tensor-parallel processes
def test_tensor_parallel_generation_with_images(setup):
    folder, llm, ref = setup
    image_checks.check_tensor_parallel_cases(
        folder, ref, CASES[:3], PARAMS, NEW, max_num_batched_tokens=BUDGET
    )


def test_online_fp8_keeps_the_tower_float(setup):
    """--quantization fp8 quantizes the text model only: the tower's, adapter's and projector's linears
    stay float and hold the checkpoint's weights."""
    from overnight.quant.linear import Fp8Linear

    folder, llm, _ = setup
    engine = dict(device="cpu", dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=512)
    fp8 = LLM(folder, quantization="fp8", **engine).engine.runner.model  # type: ignore[attr-defined]
    assert isinstance(fp8.model.layers[0].self_attn.qkv_proj, Fp8Linear)
    whole = dict(cpu_model(folder).named_modules())
    tower = {
        n: m
        for n, m in fp8.named_modules()
        if n.startswith(("vision_model.", "multi_modal_projector.")) and isinstance(m, torch.nn.Linear)
    }
    assert len(tower) == 2 * 6 + 2 + 1 + 1  # 2 blocks of q, k, v, o, fc1, fc2; unfold; adapter x 2; projector
    assert all(
        type(m) is torch.nn.Linear and torch.equal(m.weight, whole[n].weight) for n, m in tower.items()
    )


@pytest.mark.slow
def test_run_batch_lines_and_the_server_with_images(setup, tmp_path):
    """run-batch lines (an engine of their own, built from the flags) and the server through the official
    client answer Llama 4 image chats as LLM.chat does; a bad image fails its line or its request only."""
    folder, llm, _ = setup
    check_run_batch_and_server(llm, folder, WORDS, tmp_path, max_model_len=512, new_tokens=NEW)
