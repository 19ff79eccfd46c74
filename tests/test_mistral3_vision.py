"""Tier (c) for Mistral 3 with images: against transformers' Mistral3ForConditionalGeneration and its own
PixtralProcessor, token-exact greedy in fp32 (each token's logprob within 1e-4 too), on a tiny random
checkpoint (tests/tiny_mistral3_vl.py): the expanded prompt ids equal the HF processor's; one image,
two images of different sizes in one prompt and a text-only prompt in one batch through LLM.generate
with multi_modal_data, prefill chunks that end inside an image; LLM.chat with image_url data: URIs; a
prefix-cache hit on the same image and none past the start of a different one; the tower over images
of different sizes in one call against transformers' image features; another feature layer and a
projector with biases; the parameter count and the start-up encoder run; tensor-parallel shards
(the tower whole on each rank) and, slow, TP=2 generation; a W4A16 checkpoint and online FP8 with the
tower float; and, slow, run-batch lines and the server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from overnight import LLM, SamplingParams
from overnight.errors import ModelLoadError
from overnight.models.registry import arch_from_hf_config
from tests import image_checks
from tests.parity_helpers import cpu_model
from tests.tiny_mistral3_vl import IDS, MERGE, PATCH, WORDS, hf_reference, make_mistral3_vl_checkpoint
from tests.tiny_vl import check_greedy, check_run_batch_and_server, image, words

NEW = 8
BUDGET = 16  # max_num_batched_tokens: a 48 x 48 image's 6 rows of 7 tokens take three chunks


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = make_mistral3_vl_checkpoint(tmp_path_factory.mktemp("mistral3_vl"))
    llm = image_checks.cpu_vl_llm(folder, max_num_batched_tokens=BUDGET, max_model_len=256)
    return folder, llm, hf_reference(folder)


def prompt(*parts: str) -> str:
    return "<s> [INST] " + " ".join(parts) + " [/INST]"


CASES = [
    (prompt(words(3, 1, WORDS), "[IMG]", words(4, 2, WORDS)), [(30, 40, 1)]),
    # 90 x 50 is over the longest edge (48): resized, as are the grids of different sizes in one call
    (prompt("[IMG]", words(2, 3, WORDS), "[IMG]", words(5, 4, WORDS)), [(20, 20, 2), (90, 50, 3)]),
    (prompt(words(7, 0, WORDS)), []),
    (prompt(words(3, 1, WORDS), "[IMG]", words(4, 2, WORDS)), [(48, 48, 5)]),  # case 0, another image
]
PARAMS = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, logprobs=0)


def test_generate_with_images_token_exact(setup):
    folder, llm, ref = setup
    outs = image_checks.check_generate_cases(llm, ref, CASES, PARAMS, NEW)
    # 30 x 40 (w x h) -> 32 x 40 pixels: 5 rows of 4 merged patches, each row closed by a break, the last by
    # the end
    ids = outs[0].prompt_token_ids
    start = ids.index(IDS["[IMG]"])
    row = [IDS["[IMG]"]] * 4
    assert ids[start : start + 25] == (row + [IDS["[IMG_BREAK]"]]) * 4 + row + [IDS["[IMG_END]"]]
    assert outs[1].prompt_token_ids.count(IDS["[IMG_END]"]) == 2
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
    text = prompt(words(20, 20, WORDS), "[IMG]", words(20, 21, WORDS))
    image_checks.check_prefix_cache_tells_images_apart(
        llm, ref, text, (IDS["[IMG]"], IDS["[IMG_END]"]), PARAMS, NEW, opening_marker=False
    )


def test_bad_image_prompts_are_refused(setup):
    folder, llm, ref = setup
    from overnight.multimodal.pixtral_prompt import PixtralPrompt

    image_checks.check_bad_image_prompts_refused(
        llm, prompt("[IMG] w20"), "[IMG]", PixtralPrompt, r"no \[IMG_BREAK\] / \[IMG_END\] token"
    )


def test_parameter_count_and_start_up_encoder_run(setup):
    """ModelArch.num_parameters (the memory check's count) equals the built model's and transformers',
    tower and projector included; the start-up memory run encodes the largest images one step holds."""
    folder, llm, ref = setup
    arch = image_checks.check_parameter_count(folder, ref)
    assert arch.vision is not None and arch.vision.kind == "pixtral" and not arch.vision.bidirectional_images
    # 48 pixels a side: 12 patches, 6 x 7 = 42 tokens (budget 16: one)
    assert image_checks.start_up_encoder_grids(llm, folder) == [[(1, 12, 12)]]


def test_config_refusals(setup):
    folder, llm, ref = setup
    with open(f"{folder}/config.json") as f:
        cfg = json.load(f)
    with pytest.raises(ModelLoadError, match="vision_feature_layer"):
        arch_from_hf_config({**cfg, "vision_feature_layer": [-1, -2]})
    with pytest.raises(ModelLoadError, match="vision_feature_layer"):
        arch_from_hf_config({**cfg, "vision_feature_layer": 3})
    vision = {**cfg["vision_config"], "num_attention_heads": 4}  # head_dim 8 != the config's 16
    with pytest.raises(ModelLoadError, match="head_dim"):
        arch_from_hf_config({**cfg, "vision_config": vision})
    text_only = {k: v for k, v in cfg.items() if k != "vision_config"}
    assert arch_from_hf_config(text_only).vision is None  # the text model alone, as before


def test_other_feature_layer_and_projector_bias(tmp_path):
    """vision_feature_layer -2 (the tower's last block skipped) and a projector with biases."""
    folder = make_mistral3_vl_checkpoint(
        tmp_path, seed=1, vision_feature_layer=-2, multimodal_projector_bias=True
    )
    llm = LLM(folder, device="cpu", dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=256)
    ref = hf_reference(folder)
    text = prompt(words(3, 40, WORDS), "[IMG]", words(3, 41, WORDS))
    imgs = [image(44, 28, 42)]
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": imgs}}, PARAMS, use_tqdm=False)[0]
    check_greedy(out, ref, text, imgs, NEW)


def test_tower_on_several_images_matches_transformers(setup):
    """Images of different sizes encoded in one call (attention within each image only) give
    transformers' image features of the padded batch, each followed per row by a zero [IMG_BREAK] /
    [IMG_END] slot."""
    folder, llm, ref = setup
    imgs = [image(30, 40, 31), image(48, 16, 32), image(24, 24, 33)]
    ours = [llm._images.pixels(im) for im in imgs]  # type: ignore[union-attr]
    model = cpu_model(folder)  # transformers' reference runs on the CPU: ours does too
    with torch.inference_mode():
        got = model.embed_images(torch.cat([p for p, _, _ in ours]), [g for _, g, _ in ours]).embeds
        unit = {"height": PATCH * MERGE, "width": PATCH * MERGE}  # as PixtralProcessor passes it
        inputs = ref.processor.image_processor(images=imgs, return_tensors="pt", patch_size=unit)
        want = ref.model.get_image_features(inputs["pixel_values"], inputs["image_sizes"]).pooler_output
    spans = got.split([(h // 2) * (w // 2 + 1) for _, h, w in (g for _, g, _ in ours)])
    for span, feats, (_, grid, _) in zip(spans, want, ours):
        rows, cols = grid[1] // 2, grid[2] // 2
        span = span.view(rows, cols + 1, -1)
        torch.testing.assert_close(span[:, :cols].reshape(-1, span.shape[-1]), feats, atol=1e-5, rtol=1e-5)
        assert not span[:, cols].any()


def test_tensor_parallel_replicates_the_tower(setup):
    """Each rank's share loaded as the checkpoint streams equals slicing the whole model; the tower and
    projector are whole on every rank (their q / o / down projections are not the decoder's)."""
    folder, llm, ref = setup
    image_checks.check_tower_replicated(folder, ("vision_tower.", "multi_modal_projector."))


@pytest.mark.slow  # starts tensor-parallel processes
def test_tensor_parallel_generation_with_images(setup):
    folder, llm, ref = setup
    image_checks.check_tensor_parallel_cases(
        folder, ref, CASES[:3], PARAMS, NEW, max_num_batched_tokens=BUDGET
    )


def _tower_linears(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {
        n: m
        for n, m in model.named_modules()
        if n.startswith(("vision_tower.", "multi_modal_projector.")) and isinstance(m, torch.nn.Linear)
    }


def test_quantized_checkpoints_keep_the_tower_float(setup, tmp_path, monkeypatch):
    """A compressed-tensors W4A16 checkpoint (model.language_model.*, its tower and projector ignored)
    loads with the decoder packed and the tower's linears float, holding the checkpoint's tensors; a text
    prompt's and an image prompt's tokens are transformers' on the dequantized twin. Online FP8
    quantizes the decoder only."""
    from safetensors.torch import load_file

    from overnight.quant import apply
    from overnight.quant.int_linear import WeightOnlyIntLinear
    from overnight.quant.linear import Fp8Linear
    from tests.int_checkpoints import make_int_checkpoint

    pytest.importorskip("compressed_tensors")  # reads the W4A16 checkpoint's config and packing
    folder, llm, _ = setup
    monkeypatch.setattr(apply, "PACKED_INT_ON_CPU", True)
    quantized, twin = make_int_checkpoint(Path(folder), tmp_path / "w4a16", "ct-w4-g32-sym")
    engine = dict(device="cpu", dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=256)
    int_llm = LLM(str(quantized), **engine)
    model = int_llm.engine.runner.model  # type: ignore[attr-defined]
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, WeightOnlyIntLinear)
    stored = {k.removeprefix("model."): v for k, v in load_file(quantized / "model.safetensors").items()}
    tower = _tower_linears(model)
    assert tower and all(type(m) is torch.nn.Linear for m in tower.values())
    assert all(torch.equal(m.weight, stored[f"{n}.weight"].float()) for n, m in tower.items())
    cases = CASES[:1] + CASES[2:3]
    prompts = [
        {"prompt": t, "multi_modal_data": {"image": [image(*s) for s in i]}} if i else t for t, i in cases
    ]
    outs = int_llm.generate(prompts, PARAMS, use_tqdm=False)
    twin_ref = hf_reference(str(twin))
    for (text, imgs), out in zip(cases, outs):
        assert out.outputs[0].token_ids == twin_ref.greedy(text, [image(*s) for s in imgs], NEW)[1], text

    fp8 = LLM(folder, quantization="fp8", **engine).engine.runner.model  # type: ignore[attr-defined]
    assert isinstance(fp8.model.layers[0].self_attn.qkv_proj, Fp8Linear)
    assert all(type(m) is torch.nn.Linear for m in _tower_linears(fp8).values())


@pytest.mark.slow
def test_run_batch_lines_and_the_server_with_images(setup, tmp_path):
    """run-batch lines (an engine of their own, built from the flags) and the server through the official
    client answer Mistral 3 image chats as LLM.chat does; a bad image fails its line or its request only."""
    folder, llm, _ = setup
    check_run_batch_and_server(llm, folder, WORDS, tmp_path, max_model_len=256, new_tokens=NEW)
