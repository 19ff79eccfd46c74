"""Tier (c) for InternVL with images: against transformers' InternVLForConditionalGeneration and its own
InternVLProcessor, token-exact greedy in fp32 (each token's logprob within 1e-4 too), on a tiny random
checkpoint (tests/tiny_internvl.py): the expanded prompt ids equal the HF processor's; one image, two
images of different tile counts in one prompt and a text-only prompt in one batch through LLM.generate
with multi_modal_data, prefill chunks that end inside an image; LLM.chat with image_url data: URIs; a
prefix-cache hit on the same image and none past the start of a different one; the tower over several
images' tiles in one call against transformers' image features; variants: the InternViT-6B options
(RMSNorm blocks, q / k norms, no q / k / v biases, a final LayerNorm) before a Qwen2 decoder, another
feature layer before a Llama decoder, a Qwen3-MoE decoder (and its TP=2 expert shards), tiles of
another size than the tower's (position embeddings resized); the parameter count and the start-up encoder run; the internvl3.5-8b preset's shapes;
tensor-parallel shards (the tower whole on each rank) and, slow, TP=2 generation; a W4A16 checkpoint
and online FP8 with the tower float; and, slow, run-batch lines and the server."""

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
from tests.tiny_internvl import IDS, MAX_TILES, PER_TILE, WORDS, hf_reference, make_internvl_checkpoint
from tests.tiny_vl import check_greedy, check_run_batch_and_server, image, words

NEW = 8
BUDGET = 16  # max_num_batched_tokens: an image of 3 tiles (27 context tokens) takes several chunks
CTX, START, END = IDS["<IMG_CONTEXT>"], IDS["<img>"], IDS["</img>"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = make_internvl_checkpoint(tmp_path_factory.mktemp("internvl"))
    llm = image_checks.cpu_vl_llm(folder, max_num_batched_tokens=BUDGET, max_model_len=512)
    return folder, llm, hf_reference(folder)


def prompt(*parts: str) -> str:
    return "<|im_start|> " + " ".join(parts) + " <|im_end|> <|im_start|>"


CASES = [
    (prompt(words(3, 1, WORDS), "<IMG_CONTEXT>", words(4, 2, WORDS)), [(20, 20, 1)]),  # one tile
    # 50 x 20: 3 x 1 tiles (2.5 ties 2 x 1 and 3 x 1: the larger wins) and the thumbnail; 30 x 70: 1 x 2
    # tiles and the thumbnail
    (
        prompt("<IMG_CONTEXT>", words(2, 3, WORDS), "<IMG_CONTEXT>", words(5, 4, WORDS)),
        [(50, 20, 2), (30, 70, 3)],
    ),
    (prompt(words(7, 0, WORDS)), []),
    (prompt(words(3, 1, WORDS), "<IMG_CONTEXT>", words(4, 2, WORDS)), [(20, 20, 5)]),  # case 0, another image
]
PARAMS = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, logprobs=0)


def test_generate_with_images_token_exact(setup):
    folder, llm, ref = setup
    outs = image_checks.check_generate_cases(llm, ref, CASES, PARAMS, NEW)
    ids = outs[0].prompt_token_ids  # one tile, no thumbnail
    start = ids.index(START)
    assert ids[start : start + PER_TILE + 2] == [START] + [CTX] * PER_TILE + [END]
    assert outs[1].prompt_token_ids.count(CTX) == (4 + 3) * PER_TILE
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
    text = prompt(words(20, 20, WORDS), "<IMG_CONTEXT>", words(20, 21, WORDS))
    image_checks.check_prefix_cache_tells_images_apart(
        llm, ref, text, (START, END), PARAMS, NEW, opening_marker=True
    )


def test_bad_image_prompts_are_refused(setup):
    folder, llm, ref = setup
    from overnight.multimodal.internvl_prompt import InternVLPrompt

    image_checks.check_bad_image_prompts_refused(
        llm, prompt("<IMG_CONTEXT> w20"), "<IMG_CONTEXT>", InternVLPrompt, r"no <img> / </img> token"
    )


def test_tower_on_several_images_matches_transformers(setup):
    """Images of different tile counts encoded in one call give transformers' image features."""
    folder, llm, ref = setup
    imgs = [image(50, 20, 31), image(24, 24, 32), image(90, 30, 33)]
    ours = [llm._images.pixels(im) for im in imgs]  # type: ignore[union-attr]
    assert [g for _, g, _ in ours] == [(4, 6, 6), (1, 6, 6), (4, 6, 6)]
    model = cpu_model(folder)  # transformers' reference runs on the CPU: ours does too
    with torch.inference_mode():
        got = model.embed_images(torch.cat([p for p, _, _ in ours]), [g for _, g, _ in ours]).embeds
        inputs = ref.processor.image_processor(images=imgs, return_tensors="pt", crop_to_patches=True)
        want = ref.model.get_image_features(inputs["pixel_values"]).pooler_output
    torch.testing.assert_close(got, want.flatten(0, 1), atol=1e-5, rtol=1e-5)
    pixels = torch.cat([p for p, _, _ in ours])
    for grids, match in (
        ([(4, 6, 6), (1, 6, 6)], "not the 5 tiles"),  # a tile short
        ([(4, 6, 6), (1, 6, 6), (4, 6, 4)], "one tile size"),
        ([(4, 8, 8), (1, 8, 8), (4, 8, 8)], "not 8x8-patch tiles"),
    ):
        with pytest.raises(ValueError, match=match):
            model.embed_images(pixels, grids)


VARIANTS = {
    # InternViT-6B's layout (RMSNorm blocks, q / k RMSNorm, no q / k / v biases) with a final LayerNorm
    # (use_mean_pooling false, read at layer -1), before a Qwen2 decoder (InternVL 3's)
    "6b-qwen2": dict(
        vision=dict(norm_type="rms_norm", use_qk_norm=True, attention_bias=False, use_mean_pooling=False),
        text=dict(model_type="qwen2"),
    ),
    # the tower's last block skipped (the final LayerNorm too), before a Llama decoder
    "layer-2-llama": dict(
        vision=dict(use_mean_pooling=False),
        text=dict(model_type="llama", head_dim=16),
        vision_feature_layer=-2,
    ),
    # InternVL 3.5's MoE layout (InternVL3_5-30B-A3B-HF): a Qwen3-MoE decoder
    "qwen3-moe": dict(
        text=dict(
            model_type="qwen3_moe",
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=1,
        )
    ),
    # 32-pixel tiles on a tower trained at 24: its position table resized bicubically to 8 x 8 patches
    "interpolated": dict(tile=32),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variants(variant, tmp_path):
    changes: dict = dict(VARIANTS[variant])
    folder = make_internvl_checkpoint(tmp_path, seed=7, **changes)
    llm = LLM(folder, device="cpu", dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=512)
    tile = changes.get("tile", 24)
    ref = hf_reference(folder, per_tile=(tile // 8) ** 2)
    text = prompt(words(3, 40, WORDS), "<IMG_CONTEXT>", words(3, 41, WORDS), "<IMG_CONTEXT>")
    imgs = [image(44, 28, 42), image(20, 20, 43)]
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": imgs}}, PARAMS, use_tqdm=False)[0]
    check_greedy(out, ref, text, imgs, NEW)
    model = image_checks.engine_of(llm).runner.model
    moe = type(model).__name__ == "InternVLMoeForConditionalGeneration"
    assert moe == hasattr(model.model.layers[0].mlp, "experts") == (variant == "qwen3-moe")


def test_parameter_count_and_start_up_encoder_run(setup):
    """ModelArch.num_parameters (the memory check's count) equals the built model's and transformers',
    tower and projector included; the start-up memory run encodes the most tiles one step holds."""
    folder, llm, ref = setup
    arch = image_checks.check_parameter_count(folder, ref)
    assert arch.vision is not None and arch.vision.kind == "internvl" and arch.vision.spatial_merge_size == 2
    assert not arch.tie_word_embeddings and arch.qk_norm  # the Qwen3 decoder's flags
    # 4 tiles and the thumbnail: 45 tokens (budget 16: one)
    assert image_checks.start_up_encoder_grids(llm, folder) == [[(MAX_TILES + 1, 6, 6)]]


def test_dummy_preset_has_the_published_shapes():
    """internvl3.5-8b: InternViT-300M (24 layers of 1024, 448-pixel tiles of 14-pixel patches) and
    Qwen3-8B; ours, transformers' and ModelArch.num_parameters count the same 8.53B (the tower and
    projector 0.34B)."""
    from transformers import AutoModelForImageTextToText, InternVLConfig

    from overnight.loader.model_loader import build_model
    from overnight.loader.resolve import resolve_source

    source = resolve_source("internvl3.5-8b", load_format="dummy")
    arch, vision = source.arch, source.arch.vision
    assert vision is not None and (vision.depth, vision.hidden_size, vision.image_size) == (24, 1024, 448)
    assert vision.num_tokens((1, 32, 32)) == 256 and vision.image_token_id == 151671
    assert (arch.num_hidden_layers, arch.hidden_size, arch.qk_norm, arch.tie_word_embeddings) == (
        36,
        4096,
        True,
        False,
    )
    with open(Path(__file__).parents[1] / "overnight/loader/presets/internvl3.5-8b.json") as f:
        cfg = {k: v for k, v in json.load(f).items() if k not in ("architectures", "model_type")}
    with torch.device("meta"):
        theirs = AutoModelForImageTextToText.from_config(InternVLConfig(**cfg))
    ours = build_model(source, torch.bfloat16, "meta")
    count = sum(p.numel() for p in ours.parameters())
    assert count == arch.num_parameters() == sum(p.numel() for p in theirs.parameters()) == 8_528_318_464
    assert vision.num_parameters() == 337_583_104


def test_config_reading_and_refusals(setup):
    folder, llm, ref = setup
    with open(f"{folder}/config.json") as f:
        cfg = json.load(f)
    with pytest.raises(ModelLoadError, match="vision_feature_layer"):
        arch_from_hf_config({**cfg, "vision_feature_layer": [-1, -2]})
    with pytest.raises(ModelLoadError, match="downsample_ratio"):
        arch_from_hf_config({**cfg, "downsample_ratio": 0.4})
    with pytest.raises(ModelLoadError, match="vision_feature_select_strategy"):
        arch_from_hf_config({**cfg, "vision_feature_select_strategy": "full"})
    with pytest.raises(ModelLoadError, match="unsupported text model 'gemma3'"):
        arch_from_hf_config({**cfg, "text_config": {**cfg["text_config"], "model_type": "gemma3"}})
    # The LM head: tied as the top level says, else as the text model says (InternVL 3.5's configs leave
    # the top level unset and ship an lm_head of their own)
    unset = {k: v for k, v in cfg.items() if k != "tie_word_embeddings"}
    for text_tie in (False, True):
        text = {**cfg["text_config"], "tie_word_embeddings": text_tie}
        assert arch_from_hf_config({**unset, "text_config": text}).tie_word_embeddings is text_tie
        assert arch_from_hf_config({**cfg, "text_config": text}).tie_word_embeddings is False


def test_tensor_parallel_replicates_the_tower(setup):
    """Each rank's share loaded as the checkpoint streams equals slicing the whole model; the tower and
    projector are whole on every rank (their q / k / v projections are not the decoder's)."""
    folder, llm, ref = setup
    image_checks.check_tower_replicated(folder, ("vision_tower.", "multi_modal_projector."))


def test_tensor_parallel_splits_the_moe_experts_only(tmp_path):
    """The MoE layout under TP=2: each rank holds half of every expert's intermediate rows, the tower
    whole."""
    from overnight.loader.resolve import resolve_source
    from tests.tp_helpers import streamed_equals_sliced

    folder = make_internvl_checkpoint(tmp_path, seed=8, **VARIANTS["qwen3-moe"])
    whole = dict(cpu_model(folder).named_parameters())  # the shards are loaded on the CPU
    shard = dict(streamed_equals_sliced(resolve_source(folder), 1).named_parameters())
    experts = [k for k in shard if ".mlp.experts." in k]
    assert experts and all(shard[k].numel() * 2 == whole[k].numel() for k in experts)
    tower = [k for k in shard if k.startswith(("vision_tower.", "multi_modal_projector."))]
    assert tower and all(torch.equal(shard[k], whole[k]) for k in tower)


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
    loads with the decoder packed and the tower's linears float, holding the checkpoint's tensors; an
    image prompt's tokens are transformers' on the dequantized twin. Online FP8 quantizes the decoder
    only."""
    from safetensors.torch import load_file

    from overnight.quant import apply
    from overnight.quant.int_linear import WeightOnlyIntLinear
    from overnight.quant.linear import Fp8Linear
    from tests.int_checkpoints import make_int_checkpoint

    pytest.importorskip("compressed_tensors")  # reads the W4A16 checkpoint's config and packing
    folder, llm, _ = setup
    monkeypatch.setattr(apply, "PACKED_INT_ON_CPU", True)
    quantized, twin = make_int_checkpoint(Path(folder), tmp_path / "w4a16", "ct-w4-g32-sym")
    engine = dict(device="cpu", dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=512)
    int_llm = LLM(str(quantized), **engine)
    model = int_llm.engine.runner.model  # type: ignore[attr-defined]
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, WeightOnlyIntLinear)
    stored = {k.removeprefix("model."): v for k, v in load_file(quantized / "model.safetensors").items()}
    tower = _tower_linears(model)
    assert tower and all(type(m) is torch.nn.Linear for m in tower.values())
    assert all(torch.equal(m.weight, stored[f"{n}.weight"].float()) for n, m in tower.items())
    text, imgs = CASES[0]
    out = int_llm.generate(
        {"prompt": text, "multi_modal_data": {"image": [image(*s) for s in imgs]}}, PARAMS, use_tqdm=False
    )[0]
    assert out.outputs[0].token_ids == hf_reference(str(twin)).greedy(text, [image(*s) for s in imgs], NEW)[1]

    fp8 = LLM(folder, quantization="fp8", **engine).engine.runner.model  # type: ignore[attr-defined]
    assert isinstance(fp8.model.layers[0].self_attn.qkv_proj, Fp8Linear)
    assert all(type(m) is torch.nn.Linear for m in _tower_linears(fp8).values())


@pytest.mark.slow
def test_run_batch_lines_and_the_server_with_images(setup, tmp_path):
    """run-batch lines (an engine of their own, built from the flags) and the server through the official
    client answer InternVL image chats as LLM.chat does; a bad image fails its line or its request only."""
    folder, llm, _ = setup
    check_run_batch_and_server(llm, folder, WORDS, tmp_path, max_model_len=512, new_tokens=NEW)
