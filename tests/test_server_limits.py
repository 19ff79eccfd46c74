"""The server's limits and the vLLM surface a new user sends, on a fake-runner engine: request
size (413), tokenizing off the event loop, the context arithmetic for max_tokens, fields we do not
implement refused by name, /tokenize and /detokenize, text that is not Unicode."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from overnight.openai_api.protocol import UNSUPPORTED_FIELDS
from overnight.server.background import BackgroundServer
from overnight.server.cli import ServerOptions, make_app
from tests.engine_helpers import slow_engine


class SlowTokenizer:
    """Words are token ids ("w7" -> 7); encoding sleeps as a tokenizer does on megabytes of text (the
    sleep releases the GIL, as the Rust tokenizer's work does)."""

    eos_token_ids = (3,)

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        time.sleep(self.delay)
        return [int(w[1:]) for w in text.split()]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(f"w{i}" for i in ids)

    def render_chat(self, conversation, add_generation_prompt=True, chat_template=None, **kwargs) -> str:
        return " ".join(m["content"] for m in conversation)


def served(delay: float = 0.0, **opts):
    engine = slow_engine()
    engine.tokenizer = SlowTokenizer(delay)
    return BackgroundServer(make_app(engine, ServerOptions(**opts)))


def test_bodies_over_the_limit_are_413_and_the_server_keeps_serving():
    with served(max_request_bytes=2000) as server:
        url = server.url + "/v1/completions"
        big = {"prompt": [5] * 1000, "max_tokens": 1}
        r = httpx.post(url, json=big)
        assert r.status_code == 413, r.text
        assert (
            r.json()["error"]["code"] == "request_too_large" and "2000 bytes" in r.json()["error"]["message"]
        )

        def chunks():  # no Content-Length: counted as it arrives
            for _ in range(10):
                yield b" " * 500
            yield b'{"prompt": [5], "max_tokens": 1}'

        r = httpx.post(url, content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text
        r = httpx.post(url, json={"prompt": [5, 6], "max_tokens": 2})
        assert r.status_code == 200, r.text


def test_health_answers_while_a_long_prompt_is_tokenized():
    with served(delay=2.0) as server:
        result: dict[str, int] = {}

        def send() -> None:
            body = {"prompt": "w5 w6 w7", "max_tokens": 2}
            result["status"] = httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code

        t = threading.Thread(target=send)
        t.start()
        time.sleep(0.3)  # the request is being tokenized now
        waits = []
        while t.is_alive() and len(waits) < 10:
            t0 = time.perf_counter()
            assert httpx.get(server.url + "/health", timeout=10).status_code == 200
            waits.append(time.perf_counter() - t0)
            time.sleep(0.1)
        t.join()
        assert result["status"] == 200
        assert waits and max(waits) < 0.5, waits  # tokenizing on the loop would hold /health ~2 s


def test_max_tokens_past_the_context_is_400_with_the_arithmetic():
    with served() as server:  # max_model_len 256
        url = server.url + "/v1/completions"
        r = httpx.post(url, json={"prompt": [5] * 10, "max_tokens": 1_000_000_000})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
        assert "maximum context length is 256 tokens" in err["message"]
        assert "10 in the prompt + 1000000000 of max_tokens" in err["message"]
        assert "at most 246" in err["message"]
        assert httpx.post(url, json={"prompt": [5] * 10, "max_tokens": 246}).status_code == 200
        # The API's default (16) is not the client's choice: a long prompt is clamped, not refused.
        assert httpx.post(url, json={"prompt": [5] * 250}).status_code == 200
        chat = server.url + "/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": "w5"}], "max_completion_tokens": 9000}
        r = httpx.post(chat, json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == "max_completion_tokens"
        assert "1 in the messages + 9000 of max_completion_tokens" in err["message"]
        body = {"messages": [{"role": "user", "content": "w5"}], "max_tokens": 255}
        assert httpx.post(chat, json=body).status_code == 200


@pytest.mark.parametrize(
    "field,value",
    [
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("tool_choice", "required"),
        ("functions", [{"name": "f"}]),
        ("parallel_tool_calls", "yes"),
        ("suffix", "end"),
        ("guided_decoding_backend", "xgrammar"),
        ("use_beam_search", True),
        ("logits_processors", ["x"]),
        ("return_tokens_as_token_ids", True),
        ("priority", 3),
        ("best_of", 2),  # chat has none
    ],
)
def test_fields_we_do_not_implement_are_refused_by_name(field, value):
    assert field in UNSUPPORTED_FIELDS
    with served() as server:
        for url, body in (
            ("/v1/completions", {"prompt": [5], "max_tokens": 1}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w5"}]}),
        ):
            if field == "best_of" and url == "/v1/completions":
                continue  # completions implement best_of
            if field in ("tools", "tool_choice", "parallel_tool_calls") and url == "/v1/chat/completions":
                continue  # chat implements tools (tests/test_tool_calls_e2e.py)
            r = httpx.post(server.url + url, json={**body, field: value})
            assert r.status_code == 400, (url, r.text)
            err = r.json()["error"]
            assert err["param"] == field and err["message"] == f"{field}: not supported by this server"


def test_neutral_values_and_unknown_fields_pass():
    with served() as server:
        body = {
            "prompt": [5, 6],
            "max_tokens": 2,
            "tools": [],
            "tool_choice": "none",
            "parallel_tool_calls": True,
            "use_beam_search": False,
            "priority": 0,
            "some_field_nobody_knows": {"x": 1},
            "store": True,
        }
        r = httpx.post(server.url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text


def test_text_that_is_not_unicode_is_a_400_naming_the_field():
    with served() as server:
        raw = b'{"prompt": "w5 \\ud800 w6", "max_tokens": 1}'
        r = httpx.post(
            server.url + "/v1/completions", content=raw, headers={"content-type": "application/json"}
        )
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "prompt" and "lone surrogate" in err["message"]
        assert "Error" not in err["message"]  # no exception class names in what users read


def test_tokenize_and_detokenize_as_vllm_spells_them():
    from overnight.build import resolve_model
    from overnight.options import EngineOptions

    tokenizer = resolve_model(EngineOptions()).tokenizer
    assert tokenizer is not None
    engine = slow_engine()
    engine.tokenizer = tokenizer
    with BackgroundServer(make_app(engine, ServerOptions())) as server:
        text = "The capital of France is"
        r = httpx.post(server.url + "/tokenize", json={"prompt": text, "return_token_strs": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["tokens"] == tokenizer.encode(text) and body["count"] == len(body["tokens"])
        assert body["max_model_len"] == 256 and "".join(body["token_strs"]) == tokenizer.decode(
            body["tokens"], False
        )
        msgs = [{"role": "user", "content": "Hello"}]
        body = httpx.post(server.url + "/tokenize", json={"messages": msgs}).json()
        rendered = tokenizer.render_chat(msgs, add_generation_prompt=True)
        assert body["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
        assert body["token_strs"] is None
        r = httpx.post(server.url + "/detokenize", json={"tokens": tokenizer.encode(text)})
        assert r.status_code == 200 and r.json() == {"prompt": text}
        r = httpx.post(server.url + "/detokenize", json={"tokens": [10**9]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
        r = httpx.post(server.url + "/tokenize", json={"prompt": "x", "model": "other-model"})
        assert r.status_code == 404
        r = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "robot", "content": "x"}]})
        assert r.status_code == 400 and "role" in r.json()["error"]["message"]


def test_the_length_warning_of_transformers_is_gone(capfd):
    import transformers

    from overnight.build import resolve_model
    from overnight.options import EngineOptions

    tokenizer = resolve_model(EngineOptions()).tokenizer
    assert tokenizer is not None
    before = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_warning()
    try:
        capfd.readouterr()
        tokenizer.encode("word " * 10_000)
    finally:
        transformers.logging.set_verbosity(before)
    assert "indexing errors" not in capfd.readouterr().err
