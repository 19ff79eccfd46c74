"""Tier (c) for GLM-4.1V (Glm4vForConditionalGeneration) and GLM-4.5V (Glm4vMoeForConditionalGeneration) with images: against transformers' own model and
its Glm4vProcessor, token-exact greedy in fp32 (each token's logprob within 1e-4 too), on a tiny random
checkpoint (tests/tiny_glm4v.py): the expanded prompt ids equal the processor's (each image's <|image|>
count); one image, two images of different sizes in one prompt and a text-only prompt in one batch
through LLM.generate, with prefill chunks that end inside an image's tokens; LLM.chat with image_url
data: URIs; a repeated image encoded once; the tower on several images against transformers' image
features; the M-RoPE rotation (partial, interleaved pairs) against transformers' text rotary; the
parameter count and the start-up encoder run; the glm-4.1v-9b preset's shapes; config refusals; GLM-4.5V's
MoE decoder token-exact on the same cases with its parameter count; and, slow, run-batch lines and the
server. Text-only mode (limit_mm_per_prompt image 0) is in
tests/test_text_only_images.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from overnight import SamplingParams
from overnight.errors import ModelLoadError
from overnight.models.registry import arch_from_hf_config
from tests import image_checks
from tests.parity_helpers import cpu_model
from tests.tiny_glm4v import IDS, IMAGE, WORDS, hf_reference, make_glm4v_checkpoint
from tests.tiny_vl import check_run_batch_and_server, image, words

NEW = 6
BUDGET = 16  # max_num_batched_tokens: an image's tokens (up to 36) span several prefill chunks
IMG = IDS["<|image|>"]
PARAMS = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = make_glm4v_checkpoint(tmp_path_factory.mktemp("glm4v"))
    llm = image_checks.cpu_vl_llm(folder, max_num_batched_tokens=BUDGET, max_model_len=512)
    return folder, llm, hf_reference(folder)


def prompt(*parts: str) -> str:
    return "<|user|> " + " ".join(parts) + " <|assistant|>"


CASES = [
    (prompt(words(3, 1, WORDS), IMAGE, words(4, 2, WORDS)), [(40, 20, 1)]),
    # two sizes: 20 x 44 and 44 x 40 (the second's tokens cross a 16-token prefill chunk)
    (prompt(IMAGE, words(2, 3, WORDS), IMAGE, words(5, 4, WORDS)), [(20, 44, 2), (44, 40, 3)]),
    (prompt(words(7, 0, WORDS)), []),
    (prompt(words(3, 1, WORDS), IMAGE, words(4, 2, WORDS)), [(40, 20, 5)]),  # case 0, another image
]


def processor_tokens(ref, w: int, h: int) -> int:
    """The image tokens transformers' image processor gives a w x h image (its grid / merge^2)."""
    grid = ref.processor.image_processor(images=[image(w, h, 0)])["image_grid_thw"][0]
    return int(grid.prod()) // 4


def test_generate_with_images_token_exact(setup):
    folder, llm, ref = setup
    outs = image_checks.check_generate_cases(llm, ref, CASES, PARAMS, NEW)
    ids = outs[0].prompt_token_ids
    start = ids.index(IDS["<|begin_of_image|>"])
    n = processor_tokens(ref, 40, 20)
    assert ids[start : start + n + 2] == [IDS["<|begin_of_image|>"], *[IMG] * n, IDS["<|end_of_image|>"]]
    two = [processor_tokens(ref, 20, 44), processor_tokens(ref, 44, 40)]
    assert two[1] > BUDGET and outs[1].prompt_token_ids.count(IMG) == sum(two)
    assert outs[0].outputs[0].token_ids != outs[3].outputs[0].token_ids  # the image is read


def test_image_token_counts_are_the_processors(setup):
    """Each image's <|image|> count is the processor's (grid t x h x w / merge^2) for sizes that round
    differently, including the smallest (upscaled to the minimum) and one past the maximum."""
    folder, llm, ref = setup
    for w, h in ((9, 9), (61, 17), (17, 61), (200, 120), (48, 48)):
        text = prompt("w30", IMAGE, "w31")
        out = llm.generate(
            {"prompt": text, "multi_modal_data": {"image": [image(w, h, 0)]}},
            SamplingParams(max_tokens=1),
            use_tqdm=False,
        )[0]
        want = ref.processor(text=text, images=[image(w, h, 0)])["input_ids"][0]
        assert out.prompt_token_ids == list(want), (w, h)
        assert out.prompt_token_ids.count(IMG) == processor_tokens(ref, w, h), (w, h)


def test_chat_image_url_parts(setup):
    folder, llm, ref = setup
    image_checks.check_chat_image_parts(
        llm, ref, [image(36, 20, 7), words(4, 9, WORDS), image(16, 40, 8)], PARAMS, NEW
    )


def test_repeated_image_is_encoded_once(setup):
    folder, llm, ref = setup
    text = prompt(words(16, 5, WORDS), IMAGE, words(20, 6, WORDS))  # a full block before the image
    image_checks.check_prefix_cache_tells_images_apart(
        llm, ref, text, (IDS["<|begin_of_image|>"], IDS["<|end_of_image|>"]), PARAMS, NEW, True
    )


def test_tower_on_several_images_matches_transformers(setup):
    """Images of different grids encoded in one call give transformers' image features (the position
    table resampled per grid, attention kept within each image)."""
    folder, llm, ref = setup
    imgs = [image(40, 20, 31), image(9, 9, 32), image(48, 33, 33)]
    ours = [llm._images.pixels(im) for im in imgs]  # type: ignore[union-attr]
    pixels = torch.cat([p for p, _, _ in ours])
    grids = [g for _, g, _ in ours]
    assert len(set(grids)) == 3
    model = cpu_model(folder)
    with torch.inference_mode():
        got = model.embed_images(pixels, grids).embeds
        inputs = ref.processor.image_processor(images=imgs, return_tensors="pt")
        want = ref.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
    assert inputs["image_grid_thw"].tolist() == [list(g) for g in grids]
    torch.testing.assert_close(got, torch.cat(list(want)), atol=1e-5, rtol=1e-5)


def test_mrope_rotation_matches_transformers():
    """M-RoPE over the first half of each head in GLM-4's interleaved pairs (sections [2, 3, 3] of its 8
    frequencies) rotates q as transformers' Glm4v text rotary and apply_rotary_pos_emb do, for image
    positions (three different rows) and text positions (one row, the plain-RoPE path)."""
    from transformers import Glm4vTextConfig
    from transformers.models.glm4v.modeling_glm4v import Glm4vTextRotaryEmbedding, apply_rotary_pos_emb

    from overnight.layers.mrope import MRotaryEmbedding
    from tests.tiny_glm4v import TEXT

    cfg = Glm4vTextConfig(**TEXT)
    theirs = Glm4vTextRotaryEmbedding(cfg)
    ours = MRotaryEmbedding(32, 1024, 10000.0, (2, 3, 3), rotary_dim=16, pair_interleaved=True)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(7, 2, 32, generator=gen)
    pos3 = torch.stack([torch.full((7,), 5), 5 + torch.arange(7) // 3, 5 + torch.arange(7) % 3])
    for positions in (pos3, torch.arange(3, 10)):
        rows = positions if positions.dim() == 2 else positions.expand(3, -1)
        cos, sin = theirs(q, rows[:, None, :])
        want, _ = apply_rotary_pos_emb(q.transpose(0, 1)[None], q.transpose(0, 1)[None], cos, sin)
        got, _ = ours(positions, q, q)
        torch.testing.assert_close(got, want[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_parameter_count_and_start_up_encoder_run(setup):
    folder, llm, ref = setup
    arch = image_checks.check_parameter_count(folder, ref)
    assert arch.vision is not None and arch.vision.kind == "glm4v"
    # the processor's longest_edge bounds 2 frames x 48 x 48 pixels: 12 x 12 patches of 4
    assert image_checks.start_up_encoder_grids(llm, folder) == [[(1, 12, 12)]]


def test_dummy_preset_has_the_published_shapes():
    """glm-4.1v-9b (zai-org/GLM-4.1V-9B-Thinking): GLM-4-9B's decoder (40 layers of 4096, 2 KV heads, half
    of each head rotated, M-RoPE [8, 12, 12]) and the 24-block tower of 1536; ours, transformers' and
    ModelArch.num_parameters count the same."""
    from transformers import AutoModelForImageTextToText, Glm4vConfig

    from overnight.loader.model_loader import build_model
    from overnight.loader.resolve import resolve_source

    source = resolve_source("glm-4.1v-9b", load_format="dummy")
    arch, vision = source.arch, source.arch.vision
    assert vision is not None and (vision.depth, vision.hidden_size, vision.image_size) == (24, 1536, 336)
    assert (arch.num_hidden_layers, arch.hidden_size, arch.num_key_value_heads) == (40, 4096, 2)
    assert (arch.rotary_dim, arch.mrope_section, arch.rope_interleaved) == (64, (8, 12, 12), True)
    with open(Path(__file__).parents[1] / "overnight/loader/presets/glm-4.1v-9b.json") as f:
        cfg = {k: v for k, v in json.load(f).items() if k not in ("architectures", "model_type")}
    with torch.device("meta"):
        theirs = AutoModelForImageTextToText.from_config(Glm4vConfig(**cfg))
        ours = build_model(source, torch.bfloat16, "meta")
    count = sum(p.numel() for p in ours.parameters())
    assert count == arch.num_parameters() == sum(p.numel() for p in theirs.parameters())
    assert vision.num_parameters() == sum(p.numel() for p in theirs.model.visual.parameters())


def test_published_preprocessing_without_a_preprocessor_config(setup):
    """A GLM-4.1V model without preprocessor_config.json (the dummy preset) preprocesses with transformers'
    Glm4vImageProcessorPil at the published settings (112 x 112 to 9633792 pixels over 2 frames, CLIP's
    mean / std), as the checkpoint's own file would: the same grid as that file's processor."""
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

    from overnight.loader.resolve import resolve_source
    from overnight.multimodal.qwen_pixels import published_preprocessor_config, qwen_image_processor

    vision = resolve_source("glm-4.1v-9b", load_format="dummy").arch.vision
    assert vision is not None
    proc = qwen_image_processor(vision, None)
    published = published_preprocessor_config(vision)
    assert isinstance(proc, Glm4vImageProcessorPil)
    assert published["image_processor_type"] == "Glm4vImageProcessor"
    assert published["size"] == {"shortest_edge": 12544, "longest_edge": 9633792}
    keep = ("size", "patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std")
    reference = Glm4vImageProcessorPil(**{k: published[k] for k in keep})
    for w, h in ((640, 480), (50, 3000), (3000, 2000)):
        ours = proc(images=[image(w, h, 0)], return_tensors="pt")["image_grid_thw"]
        assert (
            ours.tolist()
            == reference(images=[image(w, h, 0)], return_tensors="pt")["image_grid_thw"].tolist()
        )
        t, gh, gw = ours[0].tolist()
        assert t == 1 and 2 * gh * gw * 14 * 14 <= 9633792


def test_config_reading_and_refusals(setup):
    folder, llm, ref = setup
    with open(Path(folder) / "config.json") as f:
        cfg = json.load(f)
    text, vision = cfg["text_config"], cfg["vision_config"]
    rope = text["rope_parameters"]
    for change, match in (
        ({"text_config": {**text, "rope_parameters": {**rope, "mrope_section": [4, 6, 6]}}}, "mrope_section"),
        ({"text_config": {**text, "rope_parameters": {**rope, "rope_type": "yarn"}}}, "only default"),
        ({"vision_config": {**vision, "image_size": 18}}, "whole patches"),
        ({"vision_config": {**vision, "out_hidden_size": 32}}, "out_hidden_size \\(32\\)"),
        ({"vision_config": {**vision, "hidden_act": "relu"}}, "hidden_act 'relu'"),
    ):
        with pytest.raises(ModelLoadError, match=match):
            arch_from_hf_config({**cfg, **change})
    # transformers' GLM-4.1V reads an unset partial_rotary_factor as 1: the sections must fill the head
    whole = {**rope}
    whole.pop("partial_rotary_factor")
    with pytest.raises(ModelLoadError, match=r"rotated dims / 2 \(16"):
        arch_from_hf_config({**cfg, "text_config": {**text, "rope_parameters": whole}})


def test_bad_image_prompts_are_refused(setup):
    from overnight.errors import InvalidRequestError

    folder, llm, ref = setup
    with pytest.raises(InvalidRequestError, match=r"1 image placeholders \(<\|image\|>\) but 2 images"):
        llm.generate(
            {"prompt": prompt(IMAGE), "multi_modal_data": {"image": [image(9, 9, 0)] * 2}},
            SamplingParams(max_tokens=2),
            use_tqdm=False,
        )


def test_tensor_parallel_replicates_the_tower(setup):
    folder, llm, ref = setup
    image_checks.check_tower_replicated(folder, ("visual.",))


def test_online_fp8_keeps_the_tower_float(setup):
    """Online FP8 quantizes the decoder only: the tower's and merger's linears stay float (and still run
    an image prompt)."""
    from overnight import LLM
    from overnight.quant.linear import Fp8Linear

    folder, llm, ref = setup
    engine = dict(device="cpu", dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=512)
    fp8_llm = LLM(folder, quantization="fp8", **engine)
    model = fp8_llm.engine.runner.model  # type: ignore[attr-defined]
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, Fp8Linear)
    tower = [
        m for n, m in model.named_modules() if n.startswith("visual.") and isinstance(m, torch.nn.Linear)
    ]
    assert tower and all(type(m) is torch.nn.Linear for m in tower)
    text, imgs = CASES[0]
    out = fp8_llm.generate(
        {"prompt": text, "multi_modal_data": {"image": [image(*s) for s in imgs]}}, PARAMS, use_tqdm=False
    )[0]
    assert out.prompt_token_ids.count(IMG) == processor_tokens(ref, *imgs[0][:2])
    assert len(out.outputs[0].token_ids) == NEW


@pytest.mark.slow  # starts tensor-parallel processes
def test_tensor_parallel_generation_with_images(setup):
    folder, llm, ref = setup
    image_checks.check_tensor_parallel_cases(
        folder, ref, CASES[:3], PARAMS, NEW, max_num_batched_tokens=BUDGET
    )


@pytest.fixture(scope="module")
def moe_setup(tmp_path_factory):
    folder = make_glm4v_checkpoint(tmp_path_factory.mktemp("glm4v_moe"), moe=True)
    llm = image_checks.cpu_vl_llm(folder, max_num_batched_tokens=BUDGET, max_model_len=512)
    return folder, llm, hf_reference(folder)


def test_glm45v_moe_generate_token_exact(moe_setup):
    """GLM-4.5V (Glm4vMoeForConditionalGeneration): the same tower before GLM-4.5's decoder (a dense first
    layer, routed and shared experts, rotate-half partial M-RoPE), token-exact on the same cases, chunks
    ending inside images; the image is read."""
    folder, llm, ref = moe_setup
    arch = image_checks.engine_of(llm).runner.model.arch  # type: ignore[attr-defined]
    assert (arch.architecture, arch.num_experts, arch.rope_interleaved) == ("glm4v_moe", 4, False)
    outs = image_checks.check_generate_cases(llm, ref, CASES, PARAMS, NEW)
    other = llm.generate(
        {"prompt": CASES[0][0], "multi_modal_data": {"image": [image(40, 20, 9)]}}, PARAMS, use_tqdm=False
    )[0]
    # the image is read: of three images behind the same text, some answer differently
    assert len({tuple(o.outputs[0].token_ids) for o in (outs[0], outs[3], other)}) > 1


def test_glm45v_moe_parameter_count(moe_setup):
    """Ours, built from config.json, and ModelArch.num_parameters count transformers' parameters plus the
    router's e_score_correction_bias, a buffer there (4 experts x 1 sparse layer)."""
    from transformers import AutoModelForImageTextToText

    from overnight.models.registry import model_class_for

    folder, llm, ref = moe_setup
    with open(Path(folder) / "config.json") as f:
        arch = arch_from_hf_config(json.load(f))
    with torch.device("meta"):
        ours = model_class_for(arch)(arch)
        theirs = AutoModelForImageTextToText.from_config(ref.model.config)
    bias = sum(b.numel() for n, b in theirs.named_buffers() if n.endswith("e_score_correction_bias"))
    assert bias == 4
    count = sum(p.numel() for p in ours.parameters())
    assert count == arch.num_parameters() == sum(p.numel() for p in theirs.parameters()) + bias


@pytest.mark.slow
def test_run_batch_lines_and_the_server_with_images(setup, tmp_path):
    folder, llm, ref = setup
    check_run_batch_and_server(llm, folder, WORDS, tmp_path, 512, NEW)
