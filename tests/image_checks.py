"""The test bodies every image family's tier (c) file runs on its own tiny checkpoint (InternVL, Mistral 3,
Gemma 3, Llama 4): the engine they share, a batch of image prompts token-exact with transformers, a chat
with image_url parts, the prefix cache telling two images apart, the parameter count, the start-up
encoder run and the refusals of bad image prompts. Each family passes its prompts and its image span's tokens; the per-output check itself is
tests/tiny_vl.py's check_greedy."""

from __future__ import annotations

import json
import os
import re
from typing import Any

import pytest
import torch

from overnight import LLM, SamplingParams
from overnight.arch import ModelArch
from overnight.engine.engine import Engine
from overnight.errors import InvalidRequestError
from overnight.models.registry import arch_from_hf_config, model_class_for
from overnight.outputs import RequestOutput
from tests.tiny_vl import ProcessorReference, check_greedy, data_uri, image


def cpu_vl_llm(folder: str, max_num_batched_tokens: int, max_model_len: int) -> LLM:
    """The image tests' engine: float32 on the CPU (transformers' reference runs there: ours does too,
    whatever the host has), an 8 MiB KV pool, prefill chunks of max_num_batched_tokens."""
    return LLM(
        folder,
        device="cpu",
        dtype="float32",
        kv_cache_memory_bytes=8 << 20,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
    )


def engine_of(llm: LLM) -> Engine:
    """The single in-process engine behind llm (its runner and scheduler are what the tests look at)."""
    engine = llm.engine
    assert isinstance(engine, Engine)
    return engine


def check_generate_cases(
    llm: LLM,
    ref: ProcessorReference,
    cases: list[tuple[str, list[tuple[int, int, int]]]],
    params: SamplingParams,
    new_tokens: int,
) -> list[RequestOutput]:
    """The cases (a prompt and its images' (width, height, seed)) in one LLM.generate batch, a text-only
    case as a plain string, each output token-exact with transformers'; the outputs, for the family's
    own checks of its prompt ids."""
    outs = llm.generate(image_prompts(cases), params, use_tqdm=False)
    for (text, imgs), out in zip(cases, outs):
        check_greedy(out, ref, text, [image(*s) for s in imgs], new_tokens)
    return outs


def image_prompts(cases: list[tuple[str, list[tuple[int, int, int]]]]) -> list[Any]:
    """The cases as LLM.generate prompts: a text with its images' multi_modal_data, a plain string
    when it has none."""
    return [
        {"prompt": text, "multi_modal_data": {"image": [image(*s) for s in imgs]}} if imgs else text
        for text, imgs in cases
    ]


def check_tensor_parallel_cases(
    folder: str,
    ref: ProcessorReference,
    cases: list[tuple[str, list[tuple[int, int, int]]]],
    params: SamplingParams,
    new_tokens: int,
    **engine: Any,
) -> None:
    """The cases through a TP=2 engine (two ranks over gloo on the CPU whatever the host has, as
    cpu_vl_llm's settings and `engine`) token-exact with transformers' CPU run."""
    from tests.tp_helpers import generate_split

    outs = generate_split(
        folder,
        image_prompts(cases),
        params,
        device="cpu",
        dtype="float32",
        kv_cache_memory_bytes=8 << 20,
        **engine,
    )
    for (text, imgs), out in zip(cases, outs):
        check_greedy(out, ref, text, [image(*s) for s in imgs], new_tokens)


def check_tower_replicated(folder: str, tower: tuple[str, ...]) -> None:
    """Each TP=2 rank's share loaded as the checkpoint streams equals slicing the whole model; the
    parameters named under `tower` (the tower and projector) are whole on every rank, the decoder's
    qkv_proj halved."""
    from overnight.loader.resolve import resolve_source
    from tests.parity_helpers import cpu_model
    from tests.tp_helpers import streamed_equals_sliced

    whole = dict(cpu_model(folder).named_parameters())  # the shards are loaded on the CPU
    for rank in range(2):
        shard = dict(streamed_equals_sliced(resolve_source(folder), rank).named_parameters())
        names = [k for k in shard if k.startswith(tower)]
        assert names and all(torch.equal(shard[k], whole[k]) for k in names)
        qkv = "model.layers.0.self_attn.qkv_proj.weight"
        assert shard[qkv].shape[0] == whole[qkv].shape[0] // 2


def check_chat_image_parts(
    llm: LLM, ref: ProcessorReference, parts: list[Any], params: SamplingParams, new_tokens: int
) -> None:
    """LLM.chat on one user message of `parts` (a str is a text part, anything else a PIL image sent as
    an image_url data: URI) token-exact with transformers' on the chat template's rendering of it."""
    content = [
        {"type": "text", "text": p}
        if isinstance(p, str)
        else {"type": "image_url", "image_url": {"url": data_uri(p)}}
        for p in parts
    ]
    out = llm.chat([{"role": "user", "content": content}], params, use_tqdm=False)[0]
    rendered = llm.get_tokenizer().render_chat(
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": p} if isinstance(p, str) else {"type": "image"} for p in parts
                ],
            }
        ]
    )
    check_greedy(out, ref, rendered, [p for p in parts if not isinstance(p, str)], new_tokens)


def check_prefix_cache_tells_images_apart(
    llm: LLM,
    ref: ProcessorReference,
    text: str,
    span: tuple[int, int],
    params: SamplingParams,
    new_tokens: int,
    opening_marker: bool,
) -> None:
    """A repeated prompt (text with one image placeholder) hits the prefix cache past its image (the tower
    runs once for it); the same text with another image hits only the blocks before the image starts.
    Both still match transformers. span: the token ids at the image span's first and last prompt
    positions; opening_marker: the first one is a marker the image's rows start after (<img>), not an
    image token of its own ([IMG])."""
    runner = engine_of(llm).runner
    first, other = image(40, 40, 11), image(40, 40, 12)
    before = runner.vision.images_encoded  # type: ignore[attr-defined]
    a = llm.generate({"prompt": text, "multi_modal_data": {"image": first}}, params, use_tqdm=False)[0]
    again = llm.generate({"prompt": text, "multi_modal_data": {"image": first}}, params, use_tqdm=False)[0]
    assert runner.vision.images_encoded - before == 1  # type: ignore[attr-defined]
    start, end = a.prompt_token_ids.index(span[0]), a.prompt_token_ids.index(span[1])
    assert again.num_cached_tokens > end
    b = llm.generate({"prompt": text, "multi_modal_data": {"image": other}}, params, use_tqdm=False)[0]
    assert 0 < b.num_cached_tokens <= start + int(opening_marker)
    assert b.prompt_token_ids == a.prompt_token_ids and b.outputs[0].token_ids != a.outputs[0].token_ids
    check_greedy(again, ref, text, [first], new_tokens)
    check_greedy(b, ref, text, [other], new_tokens)


def check_parameter_count(folder: str, ref: ProcessorReference) -> ModelArch:
    """ModelArch.num_parameters (the memory check's count) of the folder's config.json equals the model
    built from it and transformers' (both on the meta device), tower and projector included; the arch,
    for the family's own checks of it."""
    from transformers import AutoModelForImageTextToText

    with open(os.path.join(folder, "config.json")) as f:
        arch = arch_from_hf_config(json.load(f))
    with torch.device("meta"):
        ours = model_class_for(arch)(arch)
        theirs = AutoModelForImageTextToText.from_config(ref.model.config)
    count = arch.num_parameters()
    assert count == sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters())
    return arch


def start_up_encoder_grids(llm: LLM, folder: str) -> list[list[tuple[int, int, int]]]:
    """The grids of each embed_images call the start-up memory run (run_largest_image) makes."""
    vision = engine_of(llm).runner.vision  # type: ignore[attr-defined]
    calls: list[list[tuple[int, int, int]]] = []
    embed = vision.model.embed_images

    def recording(pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> Any:
        calls.append(grids)
        return embed(pixels, grids)

    vision.model.embed_images = recording
    try:
        vision.run_largest_image(folder)
    finally:
        del vision.model.embed_images
    return calls


def check_bad_image_prompts_refused(
    llm: LLM, text: str, placeholder: str, prompt_class: Any, missing: str
) -> None:
    """A prompt (text with one `placeholder`) sent two images is refused, naming the counts; the family's
    prompt class (multimodal/*_prompt.py) built without a tokenizer refuses to run, its message matching
    `missing` (the tokens it could not find)."""
    with pytest.raises(
        InvalidRequestError, match=rf"1 image placeholders \({re.escape(placeholder)}\) but 2 images"
    ):
        llm.generate(
            {"prompt": text, "multi_modal_data": {"image": [image(9, 9, 0)] * 2}},
            SamplingParams(max_tokens=2),
            use_tqdm=False,
        )
    vision = engine_of(llm).runner.model.arch.vision  # type: ignore[attr-defined]
    with pytest.raises(InvalidRequestError, match=missing):
        prompt_class(vision, None).check_tokens()  # a checkpoint without a tokenizer that has them
