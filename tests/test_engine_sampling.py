"""Sampling through the whole engine on the embedded SmolLM2: seeds, stop strings, n > 1."""

from __future__ import annotations

import pytest

from overnight import LLM, SamplingParams

pytestmark = pytest.mark.slow  # runs the real model

CONV = [{"role": "user", "content": "Write a short poem about the sea."}]


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", kv_cache_memory_bytes=128 << 20, max_model_len=1024)


def test_same_seed_same_text_whatever_the_batch(llm):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16)
    alone = llm.chat(CONV, seeded, use_tqdm=False)[0].outputs[0]
    others = [[{"role": "user", "content": f"Count to {i}."}] for i in range(2, 7)]
    convs = others[:2] + [CONV] + others[2:]
    params = (
        [SamplingParams(temperature=0.7, max_tokens=8 + i) for i in range(2)]
        + [seeded]
        + [SamplingParams(temperature=0.5, seed=i, max_tokens=12) for i in range(3)]
    )
    together = llm.chat(convs, params, use_tqdm=False)[2].outputs[0]
    assert together.token_ids == alone.token_ids and together.text == alone.text


def test_different_seeds_differ(llm):
    texts = {
        llm.chat(CONV, SamplingParams(temperature=1.0, seed=s, max_tokens=12), use_tqdm=False)[0]
        .outputs[0]
        .text
        for s in range(5)
    }
    assert len(texts) >= 3


def test_stop_string_spanning_a_token_boundary(llm):
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = llm.chat(CONV, greedy, use_tqdm=False)[0].outputs[0]
    tok = llm.get_tokenizer()
    pieces = [tok.decode(ref.token_ids[: i + 1]) for i in range(len(ref.token_ids))]
    # Pick a boundary between two tokens whose joined text straddles it and appears nowhere earlier.
    for i in range(5, len(ref.token_ids) - 1):
        left, right = pieces[i - 1], pieces[i]
        if len(left) < 2 or len(right) - len(left) < 2:
            continue
        stop = left[-2:] + right[len(left) : len(left) + 2]
        at = ref.text.find(stop)
        if at == len(left) - 2:
            break
    else:
        pytest.fail("no token boundary to test")
    out = llm.chat(
        CONV, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]), use_tqdm=False
    )[0].outputs[0]
    assert out.text == ref.text[:at]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.chat(
        CONV,
        SamplingParams(
            temperature=0, max_tokens=40, ignore_eos=True, stop=stop, include_stop_str_in_output=True
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == ref.text[: at + len(stop)]


def test_n_completions(llm):
    out = llm.chat(CONV, SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=10), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) >= 2
    greedy = llm.chat(CONV, SamplingParams(n=3, temperature=0, max_tokens=10), use_tqdm=False)[0]
    assert len({tuple(c.token_ids) for c in greedy.outputs}) == 1


def test_generate_stream_yields_as_requests_finish(llm):
    prompts = ["Hi", "Tell me a long story about a dragon.", "Hello"]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (2, 30, 4)]
    order = [i for i, _ in llm.generate_stream(prompts, params, use_tqdm=False)]
    assert sorted(order) == [0, 1, 2] and order[-1] == 1
