"""`overnight serve` with the real default model (SmolLM2-135M GGUF) on 127.0.0.1, through the official
`openai` client (sync and async) and raw HTTP: answers equal the offline class's, /metrics tells the
truth under load, a client that leaves frees its blocks, and bad requests get OpenAI-shaped errors."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from overnight import LLM, SamplingParams
from overnight.server.background import BackgroundServer
from overnight.server.cli import ServerOptions, make_app

pytestmark = pytest.mark.slow  # serves the real model

MAX_NUM_SEQS = 16
MAX_MODEL_LEN = 512
# SmolLM2-135M keeps 30 layers x 2 x 3 heads x 64 x 4 bytes = 46080 bytes of fp32 KV per token: a pool
# of 160 blocks of 16, small enough that KV usage moves visibly, large enough for MAX_NUM_SEQS requests.
KV_BYTES = 160 * 16 * 46080
PARITY_PROMPTS = [f"Question {i}: name a colour. Answer:" for i in range(32)]
GREEDY = SamplingParams(temperature=0, max_tokens=6)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(
        mode="server", max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS, kv_cache_memory_bytes=KV_BYTES
    )


@pytest.fixture(scope="module")
def offline(llm: LLM) -> dict[str, list[str]]:
    """What the offline class answers, computed before the server takes the engine over."""
    texts = [o.outputs[0].text for o in llm.generate(PARITY_PROMPTS, GREEDY, use_tqdm=False)]
    chat = llm.chat(
        [{"role": "user", "content": "Say hello."}],
        SamplingParams(temperature=0, max_tokens=8),
        use_tqdm=False,
    )
    counting = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    return {
        "completions": texts,
        "chat": [chat[0].outputs[0].text],
        "counting": [counting[0].outputs[0].text],
    }


@pytest.fixture(scope="module")
def server(llm: LLM, offline):
    with BackgroundServer(make_app(llm.engine, ServerOptions())) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def scrape(server) -> dict[str, float]:
    """Metric samples by name, summed over labels other than model_name (request_success by reason)."""
    text = httpx.get(server.url + "/metrics").text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert s.labels.get("model_name") == "SmolLM2-135M-Instruct"
            if "le" in s.labels:
                continue
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def wait_idle(server, timeout: float = 20.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(server)
        if m["overnight:num_requests_running"] == 0 and m["overnight:num_requests_waiting"] == 0:
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.05)


# -- the official client ---------------------------------------------------------------------------


def test_chat_sync_equals_offline(client, model, offline):
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0
    )
    assert r.object == "chat.completion" and r.model == model
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == offline["chat"][0]
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 8 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_with_usage_and_n2(client, model, offline):
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8,
        temperature=0,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts = {0: "", 1: ""}
    finish = {}
    chunks = list(stream)
    for chunk in chunks[:-1]:
        assert chunk.usage is None
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    assert texts[0] == texts[1] == offline["chat"][0]  # greedy: both samples agree with the offline class
    assert set(finish) == {0, 1}
    n_tokens = usage_chunk.usage.completion_tokens
    assert 2 <= n_tokens <= 16 and usage_chunk.usage.prompt_tokens > 0  # the prompt counts once


def test_completions_stop_string(client, model, offline):
    full = offline["counting"][0]  # e.g. " 5, 6, 7, 8, 9"
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    r = client.completions.create(
        model=model, prompt="1, 2, 3, 4,", max_tokens=10, temperature=0, stop=[stop]
    )
    assert r.choices[0].text == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=model, prompt="1, 2, 3, 4,", max_tokens=10, temperature=0, stop=stop, stream=True
        )
        if c.choices
    )
    assert streamed == r.choices[0].text  # the held-back tail never leaks a partial stop string


def test_seed_reproduces_and_n_samples_differ(client, model):
    def ask():
        return client.completions.create(
            model=model, prompt="A random word:", max_tokens=6, temperature=1.5, seed=1234, n=2
        )

    a, b = ask(), ask()
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert [c.index for c in a.choices] == [0, 1]
    assert a.choices[0].text != a.choices[1].text


def test_logprobs(client, model):
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for step in content:
        assert len(step.top_logprobs) == 3
        assert step.logprob <= 0
        assert step.top_logprobs[0].logprob == pytest.approx(step.logprob, abs=1e-4)  # greedy takes the top
        assert step.top_logprobs[0].logprob >= step.top_logprobs[1].logprob >= step.top_logprobs[2].logprob
    # the tokens spell the answer; a final end-of-turn token has text of its own that the answer skips
    assert "".join(s.token for s in content).startswith(r.choices[0].message.content)

    r = client.completions.create(model=model, prompt="The sky is", max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(len(top) >= 2 for top in lp.top_logprobs)


def test_echo_scores_the_prompt_and_tokenize_counts_it(client, model, server):
    """A scoring job as vLLM users write it: echo + logprobs + max_tokens 0 gives the prompt's own
    logprobs; /tokenize gives the same token count the usage reports."""
    r = client.completions.create(model=model, prompt="The sky is blue", max_tokens=0, echo=True, logprobs=1)
    choice = r.choices[0]
    assert choice.text == "The sky is blue" and r.usage.completion_tokens == 0
    lp = choice.logprobs
    assert "".join(lp.tokens) == "The sky is blue" and len(lp.tokens) == r.usage.prompt_tokens
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    counted = httpx.post(server.url + "/tokenize", json={"prompt": "The sky is blue"}).json()
    assert counted["count"] == r.usage.prompt_tokens
    chat = client.chat.completions.create(
        model=model, messages=HELLO, max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    plp = chat.model_extra["prompt_logprobs"]
    tokens = httpx.post(server.url + "/tokenize", json={"messages": HELLO}).json()
    assert plp[0] is None and len(plp) == tokens["count"] == chat.usage.prompt_tokens


def test_32_concurrent_async_streams_equal_offline(server, model, offline):
    async def main() -> list[str]:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)

        async def one(prompt: str) -> str:
            text = ""
            stream = await client.completions.create(
                model=model, prompt=prompt, max_tokens=6, temperature=0, stream=True
            )
            async for chunk in stream:
                text += "".join(c.text for c in chunk.choices)
            return text

        try:
            return await asyncio.gather(*(one(p) for p in PARITY_PROMPTS))
        finally:
            await client.close()

    assert asyncio.run(main()) == offline["completions"]


def test_async_chat(server, model, offline):
    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
            return await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0
            )

    assert asyncio.run(main()).choices[0].message.content == offline["chat"][0]


# -- metrics ---------------------------------------------------------------------------------------


def test_metrics_under_64_concurrent_requests(server, model):
    before = wait_idle(server)
    seen: dict[str, list[float]] = {"running": [], "waiting": [], "kv": []}

    async def main():
        async with (
            openai.AsyncOpenAI(
                base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300
            ) as client,
            httpx.AsyncClient() as http,
        ):
            done = False

            async def watch():
                while not done:
                    page = (await http.get(server.url + "/metrics")).text
                    for family in text_string_to_metric_families(page):
                        for s in family.samples:
                            key = {
                                "overnight:num_requests_running": "running",
                                "overnight:num_requests_waiting": "waiting",
                                "overnight:kv_cache_usage_perc": "kv",
                            }.get(s.name)
                            if key:
                                seen[key].append(s.value)
                    await asyncio.sleep(0.02)

            watcher = asyncio.ensure_future(watch())
            rs = await asyncio.gather(
                *(
                    client.completions.create(
                        model=model,
                        prompt=f"Fact {i} about cats:",
                        max_tokens=4,
                        temperature=0,
                        extra_body={"ignore_eos": True},
                    )
                    for i in range(64)
                )
            )
            done = True
            await watcher
            return rs

    responses = asyncio.run(main())
    after = wait_idle(server)
    assert max(seen["running"]) == MAX_NUM_SEQS  # the batch fills up to max_num_seqs, never past it
    assert max(seen["waiting"]) >= 64 - 2 * MAX_NUM_SEQS  # the rest queue
    assert 0 < max(seen["kv"]) <= 1
    assert after["overnight:kv_cache_usage_perc"] == 0

    def delta(name: str) -> float:
        return after[name] - before[name]

    assert delta("overnight:prompt_tokens_total") == sum(r.usage.prompt_tokens for r in responses)
    assert (
        delta("overnight:generation_tokens_total") == sum(r.usage.completion_tokens for r in responses) == 256
    )
    assert delta("overnight:request_success_total") == 64
    assert delta("overnight:e2e_request_latency_seconds_count") == 64
    assert delta("overnight:time_to_first_token_seconds_count") == 64
    assert delta("overnight:inter_token_latency_seconds_count") == 64 * 3
    assert delta("overnight:request_generation_tokens_sum") == 256
    assert delta("overnight:iteration_tokens_total_sum") == (
        sum(r.usage.prompt_tokens for r in responses) + 64 * 3 - delta("overnight:prefix_cache_hits_total")
    )


# -- clients that leave ----------------------------------------------------------------------------


def test_disconnect_mid_stream_frees_blocks(server, model, llm):
    before = wait_idle(server)
    body = {
        "model": model,
        "prompt": "Tell me a long story.",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            data_lines = 0
            for line in r.iter_lines():
                data_lines += line.startswith("data: ")
                if data_lines == 3:
                    assert scrape(server)["overnight:kv_cache_usage_perc"] > 0
                    break  # leaving the block closes the connection mid-stream
    after = wait_idle(server, timeout=15)
    assert after["overnight:kv_cache_usage_perc"] == 0
    assert after["overnight:generation_tokens_total"] - before["overnight:generation_tokens_total"] < 400
    assert after["overnight:request_success_total"] - before["overnight:request_success_total"] == 1  # abort
    assert not llm.engine.parents


def test_client_gone_before_its_body_arrived_is_no_error(server, model, caplog):
    """A client that closes the connection halfway through sending a request body is not a server
    error (no traceback in the log), and the server goes on serving."""
    with caplog.at_level(logging.DEBUG, logger="overnight.server"):
        with socket.create_connection((server.host, server.port), timeout=10) as s:
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000\r\n\r\n" + b'{"model": "' + model.encode() + b'", "prompt": "he'
            )
            time.sleep(0.3)  # the body's first bytes are read, the rest never comes
        deadline = time.monotonic() + 10
        while not any(
            "before its request body" in r.getMessage() or r.levelno >= logging.ERROR for r in caplog.records
        ):
            assert time.monotonic() < deadline, "the server never noticed the client leave"
            time.sleep(0.05)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    body = {"model": model, "prompt": "Hi", "max_tokens": 2}
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200


def test_disconnect_while_waiting_for_a_whole_response(server, model):
    before = wait_idle(server)
    body = {"model": model, "prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.5))
    after = wait_idle(server, timeout=15)
    assert after["overnight:kv_cache_usage_perc"] == 0
    assert after["overnight:generation_tokens_total"] - before["overnight:generation_tokens_total"] < 400
    assert after["overnight:request_success_total"] - before["overnight:request_success_total"] == 1


# -- bad requests ----------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = [{"role": "user", "content": "hi"}]

# (name, method, path, body: dict or raw bytes, status, error code or None)
BAD_REQUESTS = [
    ("bad json", "POST", CHAT, b'{"messages": [', 400, "invalid_json"),
    ("not utf-8", "POST", COMPLETIONS, b'{"prompt": "\xff\xfe"}', 400, "invalid_json"),
    ("NaN", "POST", COMPLETIONS, b'{"prompt": "hi", "temperature": NaN}', 400, "invalid_json"),
    ("body is a list", "POST", CHAT, [1, 2], 400, "invalid_request"),
    ("messages missing", "POST", CHAT, {"max_tokens": 2}, 400, "invalid_request"),
    ("messages empty", "POST", CHAT, {"messages": []}, 400, "invalid_request"),
    (
        "unknown role",
        "POST",
        CHAT,
        {"messages": [{"role": "wizard", "content": "x"}]},
        400,
        "invalid_request",
    ),
    (
        "temperature as string",
        "POST",
        CHAT,
        {"messages": HELLO, "temperature": "0.5"},
        400,
        "invalid_request",
    ),
    ("temperature too high", "POST", CHAT, {"messages": HELLO, "temperature": 7}, 400, "invalid_request"),
    ("top_p zero", "POST", COMPLETIONS, {"prompt": "hi", "top_p": 0}, 400, "invalid_request"),
    ("max_tokens zero", "POST", COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, 400, "invalid_request"),
    ("max_tokens float", "POST", COMPLETIONS, {"prompt": "hi", "max_tokens": 2.5}, 400, "invalid_request"),
    ("n zero", "POST", CHAT, {"messages": HELLO, "n": 0}, 400, "invalid_request"),
    (
        "too many top_logprobs",
        "POST",
        CHAT,
        {"messages": HELLO, "logprobs": True, "top_logprobs": 99},
        400,
        "invalid_request",
    ),
    (
        "min_tokens over max_tokens",
        "POST",
        COMPLETIONS,
        {"prompt": "hi", "max_tokens": 2, "min_tokens": 5},
        400,
        "invalid_request",
    ),
    ("empty stop", "POST", COMPLETIONS, {"prompt": "hi", "stop": ""}, 400, "invalid_request"),
    ("token id outside the vocabulary", "POST", COMPLETIONS, {"prompt": [10**9]}, 400, "invalid_request"),
    (
        "stop token outside the vocabulary",
        "POST",
        COMPLETIONS,
        {"prompt": "hi", "min_tokens": 1, "stop_token_ids": [10**12]},
        400,
        "invalid_request",
    ),
    ("prompt too long", "POST", COMPLETIONS, {"prompt": [1] * MAX_MODEL_LEN}, 400, "context_length_exceeded"),
    (
        "chat too long",
        "POST",
        CHAT,
        {"messages": [{"role": "user", "content": "word " * 600}]},
        400,
        "context_length_exceeded",
    ),
    (
        "stream_options without stream",
        "POST",
        CHAT,
        {"messages": HELLO, "stream_options": {"include_usage": True}},
        400,
        "invalid_request",
    ),
    ("lone surrogate", "POST", COMPLETIONS, b'{"prompt": "a\\ud800b"}', 400, "invalid_request"),
    (
        "template that fails",
        "POST",
        CHAT,
        {"messages": HELLO, "chat_template_kwargs": {"chat_template": "{{ 1 / 0 }}"}},
        400,
        "invalid_request",
    ),
    (
        "template kwargs that clash",
        "POST",
        CHAT,
        {"messages": HELLO, "chat_template_kwargs": {"conversation": 1}},
        400,
        "invalid_request",
    ),
    (
        "max_tokens past the context",
        "POST",
        COMPLETIONS,
        {"prompt": "hi", "max_tokens": 10**9},
        400,
        "context_length_exceeded",
    ),
    ("tools", "POST", CHAT, {"messages": HELLO, "tools": [{"type": "function"}]}, 400, "invalid_request"),
    (
        "null user content",
        "POST",
        CHAT,
        {"messages": [{"role": "user", "content": None}]},
        400,
        "invalid_request",
    ),
    ("unknown model", "POST", CHAT, {"model": "gpt-17", "messages": HELLO}, 404, "model_not_found"),
    ("unknown route", "POST", "/v1/audio/speech", {"input": "hi"}, 404, "not_found"),
    ("embeddings of a generation model", "POST", "/v1/embeddings", {"input": "hi"}, 400, "unsupported_model"),
    ("wrong method", "GET", CHAT, None, 405, "method_not_allowed"),
]


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, model):
    assert len(BAD_REQUESTS) >= 20
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for name, method, path, body, status, code in BAD_REQUESTS:
            if isinstance(body, bytes):
                r = http.request(method, path, content=body, headers={"Content-Type": "application/json"})
            elif body is None:
                r = http.request(method, path)
            else:
                r = http.request(
                    method, path, content=json.dumps(body), headers={"Content-Type": "application/json"}
                )
            assert r.status_code == status, (name, r.status_code, r.text)
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, name
            assert isinstance(error["message"], str) and error["message"], name
            assert error["code"] == code, (name, error)
            assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error"), name
        assert http.get("/health").status_code == 200
        r = http.post(COMPLETIONS, json={"model": model, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_openai_client_raises_typed_errors(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=HELLO, temperature=9)
    assert "temperature" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=HELLO)
