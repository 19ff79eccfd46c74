"""Tier (c) for Idefics3 / SmolVLM with images: against transformers' Idefics3ForConditionalGeneration and its
own Idefics3Processor, token-exact greedy in fp32 (each token's logprob within 1e-4 too), on a tiny random
checkpoint (tests/tiny_smolvlm.py): the expanded prompt ids equal the HF processor's (so each image's
<image> count and its <fake_token_around_image> / <row_r_col_c> / <global-img> / newline markers);
one image, two images of different tile grids in one prompt and a text-only prompt in one batch through
LLM.generate with multi_modal_data, prefill chunks that end inside a frame; LLM.chat with image_url
data: URIs; a repeated image encoded once; the tower over several frames against transformers' image
features; SmolVLMForConditionalGeneration (SmolVLM2's name) token-exact too; the parameter count and the
start-up encoder run; the smolvlm-256m preset's shapes; config refusals; and, slow, run-batch lines and
the server. Text-only mode (limit_mm_per_prompt image 0) is in tests/test_text_only_images.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from overnight import SamplingParams
from overnight.errors import ModelLoadError
from overnight.models.registry import arch_from_hf_config
from tests import image_checks
from tests.parity_helpers import cpu_model
from tests.tiny_smolvlm import IDS, PER_FRAME, WORDS, hf_reference, make_smolvlm_checkpoint
from tests.tiny_vl import check_greedy, check_run_batch_and_server, image, words

NEW = 6
BUDGET = 16  # max_num_batched_tokens: a frame's 16 <image> tokens and its markers span several chunks
IMG, FAKE, GLOBAL = IDS["<image>"], IDS["<fake_token_around_image>"], IDS["<global-img>"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = make_smolvlm_checkpoint(tmp_path_factory.mktemp("smolvlm"))
    llm = image_checks.cpu_vl_llm(folder, max_num_batched_tokens=BUDGET, max_model_len=512)
    return folder, llm, hf_reference(folder)


def prompt(*parts: str) -> str:
    return "<|im_start|> " + " ".join(parts) + " <end_of_utterance> <|im_start|>"


CASES = [
    # 60 x 25: resized to 64 x 27, then 64 x 32: one row of 2 tiles and the global image (3 frames)
    (prompt(words(3, 1, WORDS), "<image>", words(4, 2, WORDS)), [(60, 25, 1)]),
    # 30 x 70: 2 rows of 1 tile (3 frames); 50 x 50: 2 x 2 tiles (5 frames)
    (prompt("<image>", words(2, 3, WORDS), "<image>", words(5, 4, WORDS)), [(30, 70, 2), (50, 50, 3)]),
    (prompt(words(7, 0, WORDS)), []),
    (prompt(words(3, 1, WORDS), "<image>", words(4, 2, WORDS)), [(60, 25, 5)]),  # case 0, another image
]
PARAMS = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, logprobs=0)


def test_generate_with_images_token_exact(setup):
    folder, llm, ref = setup
    outs = image_checks.check_generate_cases(llm, ref, CASES, PARAMS, NEW)
    ids = outs[0].prompt_token_ids  # 1 x 2 tiles, then the global image
    start = ids.index(FAKE)
    row = [IDS["<row_1_col_1>"], IDS["<row_1_col_2>"]]
    want = [FAKE, row[0], *[IMG] * PER_FRAME, FAKE, row[1], *[IMG] * PER_FRAME, IDS["\n\n"], FAKE, GLOBAL]
    assert ids[start : start + len(want)] == want
    assert outs[1].prompt_token_ids.count(IMG) == (3 + 5) * PER_FRAME
    assert outs[1].prompt_token_ids.count(IDS["\n"]) == 1 + 1  # after the 2 x 1 grid's first row; 2 x 2's
    assert outs[0].outputs[0].token_ids != outs[3].outputs[0].token_ids  # the image is read


def test_chat_image_url_parts(setup):
    folder, llm, ref = setup
    image_checks.check_chat_image_parts(
        llm, ref, [image(70, 35, 7), words(4, 9, WORDS), image(16, 40, 8)], PARAMS, NEW
    )


def test_repeated_image_is_encoded_once(setup):
    """The same image again reuses its frames' encodings (a frame is the cache's unit) and the prefix
    cache past it; another image hits only the blocks before its first frame; both match transformers."""
    folder, llm, ref = setup
    runner = image_checks.engine_of(llm).runner
    text = prompt(words(20, 20, WORDS), "<image>", words(20, 21, WORDS))
    first, other = image(40, 40, 11), image(40, 40, 12)
    before = runner.vision.images_encoded  # type: ignore[attr-defined]
    a = llm.generate({"prompt": text, "multi_modal_data": {"image": first}}, PARAMS, use_tqdm=False)[0]
    again = llm.generate({"prompt": text, "multi_modal_data": {"image": first}}, PARAMS, use_tqdm=False)[0]
    assert runner.vision.images_encoded - before == 5  # type: ignore[attr-defined]  # 2 x 2 tiles + global
    assert again.num_cached_tokens > len(a.prompt_token_ids) - 30
    b = llm.generate({"prompt": text, "multi_modal_data": {"image": other}}, PARAMS, use_tqdm=False)[0]
    assert 0 < b.num_cached_tokens <= a.prompt_token_ids.index(IMG)
    assert b.outputs[0].token_ids != a.outputs[0].token_ids
    check_greedy(again, ref, text, [first], NEW)
    check_greedy(b, ref, text, [other], NEW)


def test_bad_image_prompts_are_refused(setup):
    folder, llm, ref = setup
    from overnight.multimodal.idefics3_prompt import Idefics3Prompt

    image_checks.check_bad_image_prompts_refused(
        llm, prompt("<image> w40"), "<image>", Idefics3Prompt, r"no <fake_token_around_image> / <global-img>"
    )


def test_tower_on_several_frames_matches_transformers(setup):
    """The frames of images of different grids encoded in one call give transformers' image features."""
    folder, llm, ref = setup
    imgs = [image(60, 25, 31), image(24, 24, 32), image(50, 50, 33)]
    ours = [llm._images.pixels(im) for im in imgs]  # type: ignore[union-attr]
    assert [g for _, g, _ in ours] == [(3, 1, 2), (5, 2, 2), (5, 2, 2)]
    pixels = torch.cat([p for p, _, _ in ours])
    model = cpu_model(folder)  # transformers' reference runs on the CPU: ours does too
    with torch.inference_mode():
        got = model.embed_images(pixels, [(1, 8, 8)] * len(pixels)).embeds
        inputs = ref.processor.image_processor(images=[[im] for im in imgs], return_tensors="pt")
        want = ref.model.get_image_features(
            inputs["pixel_values"], inputs["pixel_attention_mask"]
        ).pooler_output
    torch.testing.assert_close(got, want.flatten(0, 1), atol=1e-5, rtol=1e-5)
    for grids, match in (([(1, 8, 8)] * 12, "one \\(1, 8, 8\\) grid each"), ([(1, 4, 4)] * 13, "grid each")):
        with pytest.raises(ValueError, match=match):
            model.embed_images(pixels, grids)


def test_smolvlm2_architecture_token_exact(tmp_path):
    """SmolVLMForConditionalGeneration (SmolVLM2's checkpoints): the same model, token-exact too."""
    folder = make_smolvlm_checkpoint(tmp_path, seed=1, architecture="SmolVLMForConditionalGeneration")
    with open(Path(folder) / "config.json") as f:
        assert arch_from_hf_config(json.load(f)).architecture == "smolvlm"
    llm = image_checks.cpu_vl_llm(folder, max_num_batched_tokens=64, max_model_len=512)
    image_checks.check_generate_cases(llm, hf_reference(folder), CASES[:2], PARAMS, NEW)


def test_parameter_count_and_start_up_encoder_run(setup):
    folder, llm, ref = setup
    arch = image_checks.check_parameter_count(folder, ref)
    assert arch.vision is not None and arch.vision.mm_tokens_per_image == PER_FRAME
    # a step's 16 tokens touch at most 2 frames (one cut at each end): 3 frames of the tower's grid
    assert image_checks.start_up_encoder_grids(llm, folder) == [[(1, 8, 8)] * 3]


def test_dummy_preset_has_the_published_shapes():
    """smolvlm-256m (HuggingFaceTB/SmolVLM-256M-Instruct): SigLIP-base (12 layers of 768, 512-pixel frames
    of 16-pixel patches, 4 x 4 pixel shuffle: 64 tokens a frame) and SmolLM2-135M's decoder; ours,
    transformers' and ModelArch.num_parameters count the same 256.5M (the tower and connector 93.5M)."""
    from transformers import AutoModelForImageTextToText, Idefics3Config

    from overnight.loader.model_loader import build_model
    from overnight.loader.resolve import resolve_source

    source = resolve_source("smolvlm-256m", load_format="dummy")
    arch, vision = source.arch, source.arch.vision
    assert vision is not None and (vision.depth, vision.hidden_size, vision.image_size) == (12, 768, 512)
    assert vision.num_tokens((1, 32, 32)) == vision.mm_tokens_per_image == 64
    assert (arch.num_hidden_layers, arch.hidden_size, arch.num_key_value_heads) == (30, 576, 3)
    with open(Path(__file__).parents[1] / "overnight/loader/presets/smolvlm-256m.json") as f:
        cfg = {k: v for k, v in json.load(f).items() if k not in ("architectures", "model_type")}
    with torch.device("meta"):
        theirs = AutoModelForImageTextToText.from_config(Idefics3Config(**cfg))
    ours = build_model(source, torch.bfloat16, "meta")
    count = sum(p.numel() for p in ours.parameters())
    assert count == arch.num_parameters() == sum(p.numel() for p in theirs.parameters()) == 256_484_928
    assert vision.num_parameters() == 93_510_912


def test_config_reading_and_refusals(setup, tmp_path):
    folder, llm, ref = setup
    with open(Path(folder) / "config.json") as f:
        cfg = json.load(f)
    for change, match in (
        ({"scale_factor": 3}, "divides by scale_factor"),
        ({"text_config": {**cfg["text_config"], "model_type": "qwen2"}}, "unsupported text model 'qwen2'"),
        ({"vision_config": {**cfg["vision_config"], "hidden_act": "relu"}}, "unsupported SigLIP hidden_act"),
    ):
        with pytest.raises(ModelLoadError, match=match):
            arch_from_hf_config({**cfg, **change})
    from overnight.multimodal.idefics3_prompt import idefics3_image_processor

    vision = arch_from_hf_config(cfg).vision
    assert vision is not None
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    pre = json.loads((bad / "preprocessor_config.json").read_text())
    (bad / "preprocessor_config.json").write_text(json.dumps({**pre, "max_image_size": {"longest_edge": 48}}))
    with pytest.raises(ModelLoadError, match="frames of max_image_size"):
        idefics3_image_processor(vision, str(bad))
    (bad / "preprocessor_config.json").write_text(json.dumps(pre))
    (bad / "processor_config.json").write_text(json.dumps({"image_seq_len": 64}))
    with pytest.raises(ModelLoadError, match=r"image_seq_len \(64\)"):
        idefics3_image_processor(vision, str(bad))


def test_global_image_only_without_splitting(setup, tmp_path):
    """A processor with do_image_splitting off makes one frame an image (rows = cols = 0): <image> becomes
    <fake_token_around_image> <global-img>, its tokens and <fake_token_around_image>, as transformers'
    processor writes it."""
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    from overnight.multimodal.media import MediaPolicy
    from overnight.multimodal.processor import ImageProcessor

    folder, llm, ref = setup
    whole = tmp_path / "whole"
    shutil.copytree(folder, whole)
    pre = json.loads((whole / "preprocessor_config.json").read_text())
    (whole / "preprocessor_config.json").write_text(json.dumps({**pre, "do_image_splitting": False}))
    vision = image_checks.engine_of(llm).runner.model.arch.vision  # type: ignore[attr-defined]
    images = ImageProcessor(vision, str(whole), MediaPolicy(), tokenizer_path=str(whole))
    try:
        text = prompt("w30 <image> w31")
        ids = llm.get_tokenizer().encode(text)
        got, mm = images.process(ids, [image(60, 25, 4)])
    finally:
        images.close()
    ref.processor.image_processor = Idefics3ImageProcessorPil.from_pretrained(str(whole))
    try:
        want = ref.processor(text=text, images=[image(60, 25, 4)])["input_ids"][0]
    finally:
        ref.processor.image_processor = Idefics3ImageProcessorPil.from_pretrained(folder)
    assert got == list(want)
    start = got.index(FAKE)
    assert got[start : start + PER_FRAME + 3] == [FAKE, GLOBAL, *[IMG] * PER_FRAME, FAKE]
    assert [(im.offset, im.num_tokens, im.grid_thw) for im in mm.images] == [
        (start + 2, PER_FRAME, (1, 8, 8))
    ]


def test_tensor_parallel_replicates_the_tower(setup):
    """Each rank's share loaded as the checkpoint streams equals slicing the whole model; the tower and
    connector are whole on every rank (their q / k / v projections are not the decoder's)."""
    folder, llm, ref = setup
    image_checks.check_tower_replicated(folder, ("vision_model.", "connector."))


def test_online_fp8_keeps_the_tower_float(setup):
    """Online FP8 quantizes the decoder only: the tower's and connector's linears stay float (and still run
    an image prompt)."""
    from overnight import LLM
    from overnight.quant.linear import Fp8Linear

    folder, llm, ref = setup
    engine = dict(device="cpu", dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=512)
    fp8_llm = LLM(folder, quantization="fp8", **engine)
    model = fp8_llm.engine.runner.model  # type: ignore[attr-defined]
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, Fp8Linear)
    leaves = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2", "proj")
    tower = [
        m
        for n, m in model.named_modules()
        if n.startswith(("vision_model.", "connector.")) and n.rsplit(".", 1)[-1] in leaves
    ]
    assert tower and all(type(m) is torch.nn.Linear for m in tower)
    text, imgs = CASES[0]
    out = fp8_llm.generate(
        {"prompt": text, "multi_modal_data": {"image": [image(*s) for s in imgs]}}, PARAMS, use_tqdm=False
    )[0]
    assert out.prompt_token_ids.count(IMG) == 3 * PER_FRAME and len(out.outputs[0].token_ids) == NEW


@pytest.mark.slow  # starts tensor-parallel processes
def test_tensor_parallel_generation_with_images(setup):
    folder, llm, ref = setup
    image_checks.check_tensor_parallel_cases(
        folder, ref, CASES[:3], PARAMS, NEW, max_num_batched_tokens=BUDGET
    )


@pytest.mark.slow
def test_run_batch_lines_and_the_server_with_images(setup, tmp_path):
    folder, llm, ref = setup
    check_run_batch_and_server(llm, folder, WORDS, tmp_path, 512, NEW)
