"""Images over data parallel on the CPU: a tiny random Qwen2.5-VL behind 2 engine processes gives one
engine's tokens for a batch mixing text-only and image prompts (LLM.generate with multi_modal_data,
LLM.chat with data URIs); the front preprocesses each image once and its content hash travels with the
pixels, so a repeated image hits the prefix cache of the engine that saw it; a bad image fails its own
request or run-batch line only."""

from __future__ import annotations

import pytest

from overnight import LLM, SamplingParams
from overnight.errors import InvalidRequestError
from overnight.parallel.dp import DataParallelEngine
from tests.batch_helpers import run_batch_lines
from tests.tiny_vl import data_uri, image, make_vl_checkpoint, words

pytestmark = pytest.mark.slow  # starts engine processes

PLACEHOLDER = "<|vision_start|> <|image_pad|> <|vision_end|>"
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)  # unseeded: drawn by the front


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return make_vl_checkpoint(tmp_path_factory.mktemp("vl"), "qwen2_5_vl")


def _llm(folder: str, dp: int) -> LLM:
    return LLM(
        folder,
        device="cpu",
        dtype="float32",
        kv_cache_memory_bytes=8 << 20,
        max_model_len=256,
        max_num_batched_tokens=16,  # images prefilled over several chunks
        data_parallel_size=dp,
    )


@pytest.fixture(scope="module")
def pair(folder):
    one, two = _llm(folder, 1), _llm(folder, 2)
    yield one, two
    two.engine.shutdown()


def _prompts() -> list:
    out: list = []
    for i in range(8):
        if i % 3 == 2:
            out.append(words(4 + i, 100 + i))  # text only
        elif i % 3 == 1:  # two images of different sizes
            imgs = [image(32 + 16 * (i % 2), 48, 200 + i), image(64, 32, 300 + i)]
            text = f"{words(2, i)} {PLACEHOLDER} {words(3, 50 + i)} {PLACEHOLDER}"
            out.append({"prompt": text, "multi_modal_data": {"image": imgs}})
        else:
            text = f"{words(3, i)} {PLACEHOLDER} {words(i + 1, 60 + i)}"
            out.append({"prompt": text, "multi_modal_data": {"image": image(48, 48 + 8 * i, 400 + i)}})
    return out


def test_generate_and_chat_match_one_engine(pair):
    one, two = pair
    assert isinstance(two.engine, DataParallelEngine)
    prompts = _prompts()
    params = [GREEDY, SAMPLED] * (len(prompts) // 2)
    want = one.generate(prompts, params, use_tqdm=False)
    got = two.generate(prompts, params, use_tqdm=False)
    for a, b in zip(want, got, strict=True):
        assert a.prompt_token_ids == b.prompt_token_ids
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    # Both engines took work (image prompts among it), and nothing is left outstanding.
    assert all(s is not None and s.prefix_cache_queries > 0 for s in two.engine._stats)
    assert not two.engine.has_unfinished_requests()

    convs = [
        [{"role": "user", "content": [{"type": "text", "text": words(5, 7)}]}],
        [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": data_uri(image(40, 56, 9))}},
                    {"type": "text", "text": words(3, 8)},
                ],
            }
        ],
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": words(2, 10)},
                    {"type": "image_url", "image_url": {"url": data_uri(image(64, 64, 11))}},
                    {"type": "image_url", "image_url": {"url": data_uri(image(32, 32, 12))}},
                ],
            }
        ],
    ]
    want_chat = one.chat(convs, GREEDY, use_tqdm=False)
    got_chat = two.chat(convs, GREEDY, use_tqdm=False)
    for a, b in zip(want_chat, got_chat, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and a.outputs[0].text == b.outputs[0].text


def test_image_hash_keys_the_prefix_cache_across_the_process_boundary(pair):
    _, two = pair
    text = f"{words(3, 0)} {PLACEHOLDER} {words(30, 1)}"
    a, b = image(96, 96, 21), image(96, 96, 22)  # same size: the same token ids
    # One at a time: with nothing outstanding each goes to engine 0, which saw the earlier ones.
    first = two.generate({"prompt": text, "multi_modal_data": {"image": a}}, GREEDY, use_tqdm=False)[0]
    again = two.generate({"prompt": text, "multi_modal_data": {"image": a}}, GREEDY, use_tqdm=False)[0]
    other = two.generate({"prompt": text, "multi_modal_data": {"image": b}}, GREEDY, use_tqdm=False)[0]
    assert first.prompt_token_ids == other.prompt_token_ids
    assert again.num_cached_tokens >= 16 and again.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.num_cached_tokens == 0  # different pixels under equal tokens: nothing shared


def test_a_bad_image_fails_its_own_request(pair):
    one, two = pair
    good = {"prompt": f"{words(2, 3)} {PLACEHOLDER}", "multi_modal_data": {"image": image(32, 32, 1)}}
    miscounted = {"prompt": "w20", "multi_modal_data": {"image": image(32, 32, 2)}}
    with pytest.raises(InvalidRequestError, match="prompt 1: the prompt has 0 image placeholders"):
        two.generate([good, miscounted], GREEDY, use_tqdm=False)
    truncated = SamplingParams(max_tokens=4, truncate_prompt_tokens=3)
    with pytest.raises(InvalidRequestError, match="prompt 0: a prompt with images cannot be truncated"):
        two.generate([good, "w30 w31"], [truncated, GREEDY], use_tqdm=False)
    assert not two.engine.has_unfinished_requests()
    # The engines are still up; in run-batch the undecodable image fails its line, the others answer.
    lines = [
        {
            "custom_id": cid,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "messages": [{"role": "user", "content": content}],
                "max_tokens": 5,
                "temperature": 0,
            },
        }
        for cid, content in [
            ("text", words(6, 1)),
            ("img", [{"type": "image_url", "image_url": {"url": data_uri(image(48, 32, 3))}}]),
            ("bad", [{"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}]),
            ("img2", [{"type": "image_url", "image_url": {"url": data_uri(image(32, 64, 4))}}]),
        ]
    ]
    got, want = (
        run_batch_lines(two.engine, lines, two._images),
        run_batch_lines(one.engine, lines, one._images),
    )
    assert [r["custom_id"] for r in got] == ["text", "img", "bad", "img2"]
    assert got[2]["error"] is not None and "cannot decode image" in got[2]["error"]["message"]
    for a, b in zip(got, want, strict=True):
        if a["custom_id"] != "bad":
            assert a["error"] is None, a
            assert a["response"]["body"]["choices"] == b["response"]["body"]["choices"]
