"""The OpenAI protocol layer: request bodies (ranges, strict types, prompt forms, SamplingParams mapping)
and response bodies, which the official `openai` package's types must accept."""

from __future__ import annotations

import json

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from overnight.errors import InvalidRequestError
from overnight.openai_api import (
    ApiError,
    ChatCompletionRequest,
    ChatStream,
    CompletionRequest,
    CompletionStream,
    chat_completion,
    check_model,
    completion,
    parse_request,
    prepare,
    served_names,
)
from overnight.outputs import CompletionOutput, Logprob, RequestOutput
from tests.batch_helpers import make_batch_model

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def batch_model(tmp_path_factory) -> str:
    return make_batch_model(tmp_path_factory.mktemp("batch-model"))


def chat(**body) -> ChatCompletionRequest:
    req = parse_request(CHAT, {"messages": MSGS, **body})
    assert isinstance(req, ChatCompletionRequest)
    return req


def comp(**body) -> CompletionRequest:
    req = parse_request(COMP, {"prompt": "hi", **body})
    assert isinstance(req, CompletionRequest)
    return req


# ---- requests ----------------------------------------------------------------------------------


def test_chat_defaults_and_sampling_params():
    sp = chat().to_sampling_params()
    assert (sp.n, sp.temperature, sp.top_p, sp.top_k, sp.max_tokens, sp.logprobs) == (
        1,
        1.0,
        1.0,
        0,
        None,
        None,
    )
    sp = chat(
        max_tokens=5,
        max_completion_tokens=9,
        temperature=0,
        top_p=0.5,
        n=3,
        stop="x",
        seed=11,
        presence_penalty=0.5,
        frequency_penalty=-1,
        logprobs=True,
        top_logprobs=4,
        top_k=-1,
        min_p=0.1,
        repetition_penalty=1.2,
        ignore_eos=True,
        min_tokens=2,
        stop_token_ids=[7],
        user="u",
        unknown_field={"a": 1},
    ).to_sampling_params()
    assert sp.max_tokens == 9  # max_completion_tokens wins over the deprecated max_tokens
    assert (sp.temperature, sp.top_p, sp.n, sp.stop_strings, sp.seed) == (0.0, 0.5, 3, ["x"], 11)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.logprobs, sp.top_k) == (0.5, -1.0, 4, 0)
    assert (sp.min_p, sp.repetition_penalty, sp.ignore_eos, sp.min_tokens, sp.stop_token_ids) == (
        0.1,
        1.2,
        True,
        2,
        [7],
    )
    assert chat(logprobs=True).to_sampling_params().logprobs == 0
    assert chat(max_tokens=7).to_sampling_params().max_tokens == 7


def test_completion_defaults_and_prompt_forms():
    assert comp().to_sampling_params().max_tokens == 16  # the OpenAI default for /v1/completions
    assert comp(logprobs=3).to_sampling_params().logprobs == 3
    assert comp(prompt="a").prompt_list() == ["a"]
    assert comp(prompt=["a", "b"]).prompt_list() == ["a", "b"]
    assert comp(prompt=[1, 2]).prompt_list() == [[1, 2]]
    assert comp(prompt=[[1], [2, 3]]).prompt_list() == [[1], [2, 3]]
    assert comp(prompt=[[1], [2, 3]]).engine_prompts(None) == [(None, [1]), (None, [2, 3])]
    with pytest.raises(InvalidRequestError):
        comp(prompt="text").engine_prompts(None)  # text needs a tokenizer


def test_content_parts_are_joined():
    req = parse_request(
        CHAT,
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            ]
        },
    )
    assert req.conversation() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
    ]


@pytest.mark.parametrize(
    "url,body,param",
    [
        (CHAT, {"messages": []}, "messages"),
        (CHAT, {}, "messages"),
        (CHAT, {"messages": "hi"}, "messages"),
        (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, "messages"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages",
        ),
        (CHAT, {"messages": MSGS, "temperature": 2.01}, "temperature"),
        (CHAT, {"messages": MSGS, "temperature": -0.1}, "temperature"),
        (CHAT, {"messages": MSGS, "temperature": "0.5"}, "temperature"),  # strict: no strings for numbers
        (CHAT, {"messages": MSGS, "top_p": 0}, "top_p"),
        (CHAT, {"messages": MSGS, "top_p": 1.5}, "top_p"),
        (CHAT, {"messages": MSGS, "n": 0}, "n"),
        (CHAT, {"messages": MSGS, "n": True}, "n"),
        (CHAT, {"messages": MSGS, "max_tokens": 0}, "max_tokens"),
        (CHAT, {"messages": MSGS, "max_completion_tokens": 0}, "max_completion_tokens"),
        (CHAT, {"messages": MSGS, "max_tokens": 2.5}, "max_tokens"),
        (CHAT, {"messages": MSGS, "presence_penalty": 2.5}, "presence_penalty"),
        (CHAT, {"messages": MSGS, "frequency_penalty": -3}, "frequency_penalty"),
        (CHAT, {"messages": MSGS, "top_logprobs": 2}, "top_logprobs"),  # needs logprobs: true
        (CHAT, {"messages": MSGS, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (CHAT, {"messages": MSGS, "stream_options": {"include_usage": True}}, "stream_options"),
        (CHAT, {"messages": MSGS, "stop": [""]}, "stop"),
        (CHAT, {"messages": MSGS, "stop": 3}, "stop"),
        (CHAT, {"messages": MSGS, "seed": "1"}, "seed"),
        (CHAT, {"messages": MSGS, "top_k": -2}, "top_k"),
        (CHAT, {"messages": MSGS, "min_p": 1.5}, "min_p"),
        (CHAT, {"messages": MSGS, "repetition_penalty": 0}, "repetition_penalty"),
        (CHAT, {"messages": MSGS, "min_tokens": -1}, "min_tokens"),
        (CHAT, {"messages": MSGS, "tools": [{"type": "function"}]}, "tools"),
        (CHAT, {"messages": MSGS, "response_format": {"type": "grammar"}}, "response_format"),
        (CHAT, {"messages": MSGS, "response_format": {"type": "json_schema"}}, "response_format"),
        (COMP, {"prompt": "x", "guided_choice": "yes"}, "guided_choice"),
        (COMP, {"prompt": "x", "guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),
        (CHAT, {"messages": MSGS, "logit_bias": {"x": 5}}, "logit_bias"),
        (CHAT, {"messages": MSGS, "logit_bias": {"1": 101}}, "logit_bias"),
        (CHAT, {"messages": MSGS, "allowed_token_ids": []}, "allowed_token_ids"),
        (CHAT, {"messages": MSGS, "allowed_token_ids": [-1]}, "allowed_token_ids"),
        (CHAT, {"messages": MSGS, "bad_words": "x"}, "bad_words"),
        (CHAT, {"messages": MSGS, "prompt_logprobs": 21}, "prompt_logprobs"),
        (CHAT, {"messages": MSGS, "stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
        (CHAT, {"messages": MSGS, "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        (CHAT, {"messages": MSGS, "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        (CHAT, {"messages": [{"role": "user", "content": None}]}, "messages"),
        (CHAT, {"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages"),
        (COMP, {}, "prompt"),
        (COMP, {"prompt": []}, "prompt"),
        (COMP, {"prompt": [[]]}, "prompt"),
        (COMP, {"prompt": [1, "a"]}, "prompt"),
        (COMP, {"prompt": [-1]}, "prompt"),
        (COMP, {"prompt": "x", "logprobs": True}, "logprobs"),
        (COMP, {"prompt": "x", "logprobs": 21}, "logprobs"),
        (COMP, {"prompt": "x", "echo": True, "stream": True}, "echo"),
        (COMP, {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        (COMP, {"prompt": "x", "suffix": "y"}, "suffix"),
        (COMP, {"prompt": "x", "best_of": 0}, "best_of"),
        (COMP, {"prompt": "x", "n": 3, "best_of": 2}, "best_of"),
        (COMP, {"prompt": "x", "best_of": 3, "stream": True}, "best_of"),
        (COMP, {"prompt": "x", "stop": ["\udc00"]}, "stop"),
    ],
)
def test_invalid_bodies_name_the_field(url, body, param):
    with pytest.raises(ApiError) as info:
        parse_request(url, body)
    err = info.value
    assert (err.code, err.status_code, err.param) == ("invalid_request", 400, param)
    assert err.message.startswith(param)


def test_unknown_url_and_non_object_body():
    with pytest.raises(ApiError) as info:
        parse_request("/v1/audio/speech", {"input": "x"})
    assert info.value.code == "unsupported_url"
    with pytest.raises(ApiError) as info:
        parse_request(CHAT, ["x"])
    assert info.value.code == "invalid_request"


def test_min_tokens_above_max_tokens_is_refused():
    with pytest.raises(InvalidRequestError):
        comp(max_tokens=2, min_tokens=3).to_sampling_params()


def test_model_names():
    names = served_names("my-model", "/models/org/my-model")
    assert {"my-model", "/models/org/my-model"} <= names
    check_model(None, names)
    check_model("my-model", names)
    check_model("org/my-model", names)  # by its last path component
    with pytest.raises(ApiError) as info:
        check_model("gpt-4o", names)
    assert info.value.code == "model_not_found" and info.value.status_code == 404
    assert info.value.body()["error"]["type"] == "not_found_error"


def test_error_bodies():
    err = ApiError("invalid_request", "temperature: too hot", "temperature")
    assert err.body() == {
        "error": {
            "message": "temperature: too hot",
            "type": "invalid_request_error",
            "param": "temperature",
            "code": "invalid_request",
        }
    }
    internal = ApiError.from_exception(RuntimeError("boom"))
    assert internal.status_code == 500 and internal.body()["error"]["type"] == "server_error"
    assert ApiError.from_exception(InvalidRequestError("bad")).status_code == 400


# ---- responses ---------------------------------------------------------------------------------


def lps(ids: list[int], k: int) -> list[dict[int, Logprob]]:
    """Per token: the sampled id at rank 3 (outside the top-k when k < 3) plus the top-k."""
    steps = []
    for t in ids:
        step = {100 + r: Logprob(-0.1 * r, r, f"top{r}") for r in range(1, k + 1)}
        step[t] = Logprob(float("-inf") if t == 9 else -1.5, 3, f"t{t}")
        steps.append(step)
    return steps


def output(
    rid: str,
    prompt_ids: list[int],
    comps: list[tuple[list[int], str, str]],
    k: int | None = None,
    delta: bool = False,
) -> RequestOutput:
    return RequestOutput(
        request_id=rid,
        prompt=None,
        prompt_token_ids=prompt_ids,
        finished=True,
        delta=delta,
        outputs=[
            CompletionOutput(i, text, ids, None, lps(ids, k) if k is not None else None, reason)
            for i, (ids, text, reason) in enumerate(comps)
        ],
    )


def test_chat_completion_body_validates():
    out = output("a", [1, 2, 3], [([5, 9], "t5t9", "stop"), ([6], "t6", "length")], k=2)
    body = chat_completion(out, "m", num_logprobs=2)
    json.dumps(body, allow_nan=False)  # -inf logprobs are clamped
    parsed = ChatCompletion.model_validate(body)
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert [c.index for c in parsed.choices] == [0, 1]
    assert [c.message.content for c in parsed.choices] == ["t5t9", "t6"]
    assert [c.finish_reason for c in parsed.choices] == ["stop", "length"]
    assert parsed.usage.model_dump(exclude_none=True) == {
        "prompt_tokens": 3,
        "completion_tokens": 3,
        "total_tokens": 6,
    }
    first = parsed.choices[0].logprobs.content
    assert [t.token for t in first] == ["t5", "t9"] and first[0].logprob == -1.5
    assert first[1].logprob == -9999.0
    assert [x.token for x in first[0].top_logprobs] == ["top1", "top2"]  # exactly top_logprobs, by rank
    assert first[0].bytes == list(b"t5")
    assert (
        chat_completion(output("b", [1], [([5], "x", "abort")]), "m")["choices"][0]["finish_reason"] == "stop"
    )
    assert chat_completion(output("b", [1], [([5], "x", "stop")]), "m")["choices"][0]["logprobs"] is None


def test_completion_body_numbers_choices_prompt_major():
    outs = [
        output("p0", [1, 2], [([5], "a0", "stop"), ([6], "a1", "length")], k=1),
        output("p1", [3], [([7, 8], "b0x", "stop"), ([9], "b1", "stop")], k=1),
    ]
    body = completion(outs, "m")
    parsed = Completion.model_validate(body)
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert [(c.index, c.text) for c in parsed.choices] == [(0, "a0"), (1, "a1"), (2, "b0x"), (3, "b1")]
    assert parsed.usage.prompt_tokens == 3 and parsed.usage.completion_tokens == 5  # each prompt once
    lp = parsed.choices[2].logprobs
    assert lp.tokens == ["t7", "t8"] and lp.token_logprobs == [-1.5, -1.5] and lp.text_offset == [0, 2]
    assert lp.top_logprobs[0] == {"top1": -0.1, "t7": -1.5}  # the top-k plus the sampled token


def test_streaming_chunks_validate_and_add_up():
    stream = ChatStream("m", include_usage=True, num_logprobs=1)
    deltas = [
        output("a", [1, 2], [([5], "He", None), ([6], "Hi", None)], k=1, delta=True),
        output("a", [1, 2], [([7], "llo", "stop")], k=1, delta=True),
        output("a", [1, 2], [([8], "!", "length")], k=1, delta=True),
    ]
    deltas[2].outputs[0].index = 1
    chunks = [c for d in deltas for c in stream.chunks(d)] + stream.final_chunks()
    for c in chunks:
        json.dumps(c, allow_nan=False)
        ChatCompletionChunk.model_validate(c)
    assert all(c["id"] == stream.id and c["object"] == "chat.completion.chunk" for c in chunks)
    text = {0: "", 1: ""}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        text[choice["index"]] += choice["delta"].get("content", "")
        assert ("role" in choice["delta"]) == (c is chunks[choice["index"]])  # role only in a choice's first
    assert text == {0: "Hello", 1: "Hi!"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 4,
        "total_tokens": 6,
    }
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, None, "stop", "length"]
    assert ChatStream("m").final_chunks() == []
    assert "usage" not in ChatStream("m").chunks(deltas[0])[0]

    cstream = CompletionStream("m", include_usage=True, n=2)
    cchunks = cstream.chunks(1, deltas[0]) + cstream.chunks(1, deltas[1]) + cstream.final_chunks()
    assert [c["choices"][0]["index"] for c in cchunks[:-1]] == [2, 3, 2]
    assert cchunks[1]["choices"][0]["logprobs"]["text_offset"] == [0]
    assert cchunks[2]["choices"][0]["logprobs"]["text_offset"] == [2]  # continues after "t5"
    Completion.model_validate(cchunks[2])  # the finishing chunk is a valid Completion
    assert cchunks[-1]["usage"]["prompt_tokens"] == 2 and cchunks[-1]["object"] == "text_completion"


def test_real_engine_stream_equals_whole_response(batch_model):
    """Through a real engine: the chunks of a streamed chat request add up to the non-streamed text."""
    from overnight import LLM

    llm = LLM(
        batch_model,
        max_model_len=96,
        max_num_seqs=4,
        kv_cache_memory_bytes=8 << 20,
        device="cpu",
        dtype="float32",
        attention_backend="torch",
    )
    engine = llm.engine
    req = parse_request(
        CHAT,
        {
            "messages": [{"role": "user", "content": "w10 w20 w30"}],
            "n": 2,
            "temperature": 0.7,
            "seed": 3,
            "max_tokens": 6,
            "logprobs": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    inputs = prepare(req, engine.tokenizer, engine.max_model_len, {"tiny-batch"}, engine.validate)
    ((text, ids),) = inputs.prompts
    stream = ChatStream("tiny-batch", include_usage=True, num_logprobs=req.num_logprobs)
    engine.add_request("s", ids, inputs.params, prompt=text, stream=True)
    chunks = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            chunks += stream.chunks(out)
    chunks += stream.final_chunks()
    engine.add_request("w", ids, inputs.params, prompt=text)
    whole = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            whole = chat_completion(out, "tiny-batch", num_logprobs=req.num_logprobs)
    streamed = {0: "", 1: ""}
    for c in chunks:
        ChatCompletionChunk.model_validate(c)
        for ch in c["choices"]:
            streamed[ch["index"]] += ch["delta"].get("content", "")
    # The incremental detokenizer decodes the first output token with prompt context, so with this
    # word-level tokenizer (words joined by spaces) streamed text starts with the joining space, which a
    # decode of the output alone does not have: an engine choice, not the chunking's.
    assert [streamed[0].lstrip(), streamed[1].lstrip()] == [c["message"]["content"] for c in whole["choices"]]
    assert chunks[-1]["usage"] == whole["usage"]
