"""Tier (c) for Gemma 3 with images: against transformers' Gemma3ForConditionalGeneration and its own
Gemma3Processor, token-exact greedy in fp32 (each token's logprob within 1e-4 too), on a tiny random
checkpoint (tests/tiny_gemma_vl.py): the expanded prompt ids equal the HF processor's; text only, one
image, two images of different sizes in one prompt, a prompt longer than the sliding window with an
image, all in one batch through LLM.generate with multi_modal_data; LLM.chat with image_url data: URIs;
chunked prefill whose boundary would fall inside an image; a prefix-cache hit on a prompt with an image;
an image repeated over prompts encoded once."""

from __future__ import annotations

import pytest
import torch

from overnight import LLM, SamplingParams
from overnight.errors import InvalidRequestError
from tests import image_checks
from tests.tiny_gemma_vl import IDS, TOKENS_PER_IMAGE, WINDOW, WORDS, hf_reference, make_gemma_vl_checkpoint
from tests.tiny_vl import check_greedy, check_run_batch_and_server, image, words

NEW = 8
BUDGET = 24  # max_num_batched_tokens: chunks of 24 tokens, images of 16


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = make_gemma_vl_checkpoint(tmp_path_factory.mktemp("gemma3_vl"))
    llm = image_checks.cpu_vl_llm(folder, max_num_batched_tokens=BUDGET, max_model_len=256)
    return folder, llm, hf_reference(folder)


CASES = [
    (f"<bos> {words(7, 0, WORDS)}", []),
    (f"<bos> {words(3, 1, WORDS)} <start_of_image> {words(4, 2, WORDS)}", [(30, 40, 1)]),
    (
        f"<bos> <start_of_image> {words(2, 3, WORDS)} <start_of_image> {words(5, 4, WORDS)}",
        [(20, 20, 2), (90, 50, 3)],
    ),
    # Longer than the window (24): the image's keys leave the sliding layers' window before the end.
    (f"<bos> {words(40, 5, WORDS)} <start_of_image> {words(30, 6, WORDS)}", [(60, 60, 4)]),
]


def test_generate_with_images_token_exact(setup):
    folder, llm, ref = setup
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, logprobs=0)
    outs = image_checks.check_generate_cases(llm, ref, CASES, params, NEW)
    assert len(outs[3].prompt_token_ids) > 3 * WINDOW
    assert outs[2].prompt_token_ids.count(IDS["<image_soft_token>"]) == 2 * TOKENS_PER_IMAGE


def test_bidirectional_image_attention_matters(setup):
    """The reference with a causal mask over the image (no token_type_ids) disagrees with ours: the
    test above would catch an engine that attended causally."""
    folder, llm, ref = setup
    text, imgs = CASES[1][0], [image(*CASES[1][1][0])]
    inputs = ref.processor(text=text, images=imgs, return_tensors="pt")
    with torch.inference_mode():
        both = ref.model(**inputs).logits[0, -1]
        inputs.pop("token_type_ids")
        causal = ref.model(**inputs).logits[0, -1]
    assert not torch.allclose(both, causal, atol=1e-3)


def test_chat_image_url_parts(setup):
    folder, llm, ref = setup
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, logprobs=0)
    image_checks.check_chat_image_parts(llm, ref, [image(70, 35, 7), words(4, 9, WORDS)], params, NEW)


def test_chunk_boundary_inside_an_image_moves_before_it(setup):
    """The image of this prompt covers 43 .. 59: the second 24-token chunk would end at 48, inside it."""
    folder, llm, ref = setup
    engine = image_checks.engine_of(llm)
    chunks: list[tuple[int, int]] = []
    schedule = engine.scheduler.schedule

    def recording():
        out = schedule()
        for n in out.new_reqs:
            chunks.append((n.num_computed_tokens, out.num_scheduled_tokens[n.req_id]))
        for c in out.cached_reqs:
            r = engine.scheduler.requests[c.req_id]
            chunks.append(
                (
                    r.num_computed_tokens - out.num_scheduled_tokens[c.req_id],
                    out.num_scheduled_tokens[c.req_id],
                )
            )
        return out

    text, imgs = (
        f"<bos> {words(40, 50, WORDS)} <start_of_image> {words(30, 51, WORDS)}",
        [image(50, 70, 52)],
    )  # not cached
    engine.scheduler.schedule = recording  # type: ignore[method-assign]
    try:
        params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, logprobs=0)
        out = llm.generate({"prompt": text, "multi_modal_data": {"image": imgs}}, params, use_tqdm=False)[0]
    finally:
        del engine.scheduler.schedule
    check_greedy(out, ref, text, imgs, NEW)
    offset = out.prompt_token_ids.index(IDS["<image_soft_token>"])
    assert (24, offset - 24) in chunks, chunks  # cut short at the image's start
    assert (offset, 24) in chunks, chunks  # the image whole in the next chunk


def test_prefix_cache_hit_and_repeated_image(setup):
    """The same image over several prompts runs the tower once; a repeated prompt hits the prefix cache
    (never inside its image) and still matches transformers."""
    folder, llm, ref = setup
    runner = image_checks.engine_of(llm).runner
    img = image(40, 40, 11)
    before = runner.vision.images_encoded  # type: ignore[attr-defined]
    texts = [f"<bos> {words(i + 30, 20, WORDS)} <start_of_image> {words(3, i, WORDS)}" for i in range(4)]
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, logprobs=0)
    outs = llm.generate(
        [{"prompt": t, "multi_modal_data": {"image": img}} for t in texts], params, use_tqdm=False
    )
    assert runner.vision.images_encoded - before == 1  # type: ignore[attr-defined]
    again = llm.generate({"prompt": texts[0], "multi_modal_data": {"image": img}}, params, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0
    offset = again.prompt_token_ids.index(IDS["<image_soft_token>"])
    assert not offset < again.num_cached_tokens < offset + TOKENS_PER_IMAGE
    for text, out in [(texts[0], outs[0]), (texts[3], outs[3]), (texts[0], again)]:
        check_greedy(out, ref, text, [img], NEW)


def test_bad_image_prompts_are_refused(setup):
    folder, llm, ref = setup
    params = SamplingParams(max_tokens=2)
    with pytest.raises(InvalidRequestError, match="placeholders"):
        llm.generate(
            {"prompt": "<bos> w20", "multi_modal_data": {"image": image(9, 9, 0)}}, params, use_tqdm=False
        )


def test_start_up_encoder_run_takes_gemma_images(setup):
    """The start-up memory check runs the tower on as many images as one step's budget holds."""
    folder, llm, ref = setup
    # 24 tokens of budget: one image of 16 tokens, 8 x 8 patches
    assert image_checks.start_up_encoder_grids(llm, folder) == [[(1, 8, 8)]]


def test_parameter_count_includes_the_tower(setup):
    """ModelArch.num_parameters (the memory check's count) equals the built model's, tower included."""
    import json

    from overnight.models.registry import arch_from_hf_config, model_class_for

    folder, llm, ref = setup
    with open(f"{folder}/config.json") as f:
        arch = arch_from_hf_config(json.load(f))
    assert (
        arch.vision is not None and arch.vision.bidirectional_images and arch.vision.spatial_merge_size == 2
    )
    with torch.device("meta"):
        model = model_class_for(arch)(arch)
    assert arch.num_parameters() == sum(p.numel() for p in model.parameters())


def test_config_refusals(setup):
    """mm_tokens_per_image must pool the patch grid evenly (an image longer than the window is fine:
    the window counts back from each token's own position, as transformers masks it)."""
    import json

    from overnight.errors import ModelLoadError
    from overnight.models.registry import arch_from_hf_config

    folder, llm, ref = setup
    with open(f"{folder}/config.json") as f:
        cfg = json.load(f)
    for tokens in (9, 15):
        with pytest.raises(ModelLoadError, match="square whose side divides"):
            arch_from_hf_config({**cfg, "mm_tokens_per_image": tokens})
    assert arch_from_hf_config({**cfg, "mm_tokens_per_image": 64}).vision.mm_tokens_per_image == 64


def test_image_longer_than_the_window(tmp_path):
    """64 tokens per image (no pooling) against a window of 24: on sliding layers an image token sees
    its window back from its own position plus its image's later tokens, as transformers masks it."""
    folder = make_gemma_vl_checkpoint(tmp_path, seed=1, tokens_per_image=64)
    llm = LLM(
        folder,
        device="cpu",
        dtype="float32",
        kv_cache_memory_bytes=8 << 20,
        max_num_batched_tokens=80,
        max_model_len=256,
    )
    ref = hf_reference(folder, tokens_per_image=64)
    cases = [(f"<bos> {words(30, 30, WORDS)} <start_of_image> {words(20, 31, WORDS)}", [image(45, 60, 32)])]
    cases.append((f"<bos> {words(5, 33, WORDS)} <start_of_image> {words(3, 34, WORDS)}", [image(80, 20, 35)]))
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, logprobs=0)
    outs = llm.generate(
        [{"prompt": t, "multi_modal_data": {"image": i}} for t, i in cases], params, use_tqdm=False
    )
    for (text, imgs), out in zip(cases, outs):
        check_greedy(out, ref, text, imgs, NEW)


@pytest.mark.slow
def test_run_batch_lines_and_the_server_with_images(setup, tmp_path):
    """run-batch lines (an engine of their own, built from the flags) and the server through the official
    client answer Gemma 3 image chats as LLM.chat does (token-exact with transformers above); a bad image
    fails its line or its request only."""
    folder, llm, _ = setup
    check_run_batch_and_server(llm, folder, WORDS, tmp_path, max_model_len=256, new_tokens=NEW)


@pytest.mark.slow
def test_tensor_parallel_keeps_the_tower_whole(setup):
    """TP=2: the decoder sharded, the SigLIP tower and projector whole on each rank (their q_proj /
    k_proj / v_proj / fc names must not take the decoder's split rules)."""
    folder, _, ref = setup
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, logprobs=0)
    image_checks.check_tensor_parallel_cases(
        folder, ref, CASES[:3], params, NEW, max_num_batched_tokens=BUDGET, max_model_len=256
    )
