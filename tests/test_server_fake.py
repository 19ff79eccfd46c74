"""The server's plumbing on a fake-runner engine (no weights, so in seconds): the engine thread, aborts,
load shedding (503), a dead engine, the API key. The real model's behaviour is in test_server.py."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from contextlib import aclosing

import httpx
import pytest

from overnight.errors import EngineDeadError
from overnight.sampling_params import SamplingParams
from overnight.server.async_engine import AsyncEngine
from overnight.server.background import BackgroundServer
from overnight.server.cli import ServerOptions, make_app
from tests.engine_helpers import EOS, VOCAB, slow_engine
from tests.fake_runner import reference_output

ASYNC_MODES = pytest.mark.parametrize("async_mode", [False, True], ids=["sync", "one-step-ahead"])


# -- the async engine alone ------------------------------------------------------------------------


@ASYNC_MODES
def test_concurrent_streams_get_their_own_tokens(async_mode):
    engine = slow_engine(max_num_seqs=8, async_mode=async_mode)
    rng = random.Random(0)
    prompts = [[rng.randrange(4, VOCAB) for _ in range(rng.randint(3, 30))] for _ in range(40)]

    async def main():
        ae = AsyncEngine(engine)
        ae.start()

        async def one(i: int, p: list[int]) -> list[int]:
            tokens: list[int] = []
            params = SamplingParams(max_tokens=12)
            async with aclosing(ae.generate(f"r{i}", p, params, stream=i % 2 == 0)) as outs:
                async for out in outs:
                    if i % 2 == 0:
                        tokens += out.outputs[0].token_ids  # deltas
                    else:
                        assert out.finished
                        tokens = out.outputs[0].token_ids
            return tokens

        got = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        await ae.stop()
        return got

    got = asyncio.run(main())
    assert got == [reference_output(p, 12, VOCAB, EOS) for p in prompts]
    assert engine.stats().kv_cache_usage == 0 and not engine.parents


@ASYNC_MODES
def test_closing_a_stream_aborts_and_frees_blocks(async_mode):
    engine = slow_engine(delay=0.01, async_mode=async_mode)

    async def main():
        ae = AsyncEngine(engine)
        ae.start()
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        async with aclosing(ae.generate("a", [5, 6, 7, 8, 9], params)) as outs:
            async for _ in outs:
                assert engine.stats().kv_cache_usage > 0
                break  # the consumer leaves after its first delta
        for _ in range(200):
            if ae.stats.num_running == 0:
                break
            await asyncio.sleep(0.01)
        stats = ae.stats
        await ae.stop()
        return stats

    stats = asyncio.run(main())
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_cache_usage == 0
    assert not engine.parents


@ASYNC_MODES
def test_stop_aborts_in_flight_requests(async_mode):
    engine = slow_engine(delay=0.01, async_mode=async_mode)

    async def main():
        ae = AsyncEngine(engine)
        ae.start()
        outs = ae.generate("a", [5, 6, 7], SamplingParams(max_tokens=10_000, ignore_eos=True))
        first = await outs.__anext__()
        stopper = asyncio.ensure_future(ae.stop())
        last = first
        async for out in outs:
            last = out
        await stopper
        return last

    last = asyncio.run(main())
    assert last.finished and last.outputs[0].finish_reason == "abort"
    assert engine.stats().kv_cache_usage == 0


@ASYNC_MODES
def test_a_failing_step_reaches_every_waiting_request(async_mode):
    engine = slow_engine(fail_at_step=3, async_mode=async_mode)

    async def main():
        ae = AsyncEngine(engine)
        ae.start()

        async def one(i: int) -> BaseException | None:
            try:
                async for _ in ae.generate(f"r{i}", [5, 6, i + 7], SamplingParams(max_tokens=50)):
                    pass
            except EngineDeadError as e:
                return e
            return None

        errors = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(4))), 30)
        return errors, ae.is_running

    errors, running = asyncio.run(main())
    assert all(isinstance(e, EngineDeadError) for e in errors)
    assert not running


# -- over HTTP -------------------------------------------------------------------------------------


def test_completions_with_token_ids_and_routes():
    engine = slow_engine()
    with BackgroundServer(make_app(engine, ServerOptions())) as server:
        r = httpx.post(
            server.url + "/v1/completions",
            json={"prompt": [[5, 6, 7], [8, 9]], "max_tokens": 4, "n": 2, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
        assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 16, "total_tokens": 21}
        assert body["model"] == "fake"
        models = httpx.get(server.url + "/v1/models").json()
        assert models["data"][0]["id"] == "fake" and models["data"][0]["max_model_len"] == 256
        assert httpx.get(server.url + "/v1/models/fake").status_code == 200
        assert httpx.get(server.url + "/v1/models/other").status_code == 404
        # chat needs a tokenizer, which this engine lacks: a 400 naming why, not a 500
        r = httpx.post(
            server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
        )
        assert r.status_code == 400 and "tokenizer" in r.json()["error"]["message"]
        schema = httpx.get(server.url + "/openapi.json").json()
        assert "ChatCompletionRequest" in schema["components"]["schemas"]


def test_overloaded_server_answers_503_and_recovers():
    engine = slow_engine(delay=0.02, max_num_seqs=2)
    with BackgroundServer(make_app(engine, ServerOptions(max_waiting=3))) as server:
        statuses: list[int] = []
        body = {"prompt": [5, 6, 7], "max_tokens": 20, "ignore_eos": True}

        def send() -> None:
            statuses.append(httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code)

        threads = [threading.Thread(target=send) for _ in range(12)]
        for t in threads:
            t.start()
            time.sleep(0.01)
        for t in threads:
            t.join()
        assert statuses.count(200) >= 5  # 2 running + 3 waiting at least
        assert statuses.count(503) >= 1
        assert set(statuses) == {200, 503}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200  # the queue drained: served again


def test_overload_error_shape():
    engine = slow_engine(delay=0.05, max_num_seqs=1)
    with BackgroundServer(make_app(engine, ServerOptions(max_waiting=0))) as server:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": [5], "max_tokens": 1})
        assert r.status_code == 503
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "server_overloaded"
        assert r.json()["error"]["type"] == "server_error"


def test_dead_engine_is_503_not_500():
    engine = slow_engine(fail_at_step=1)
    with BackgroundServer(make_app(engine, ServerOptions())) as server:
        assert httpx.get(server.url + "/health").status_code == 200
        r = httpx.post(server.url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 3}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        assert httpx.get(server.url + "/health").status_code == 503
        r = httpx.post(
            server.url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 3, "stream": True}
        )
        assert r.status_code == 503


def test_api_key_guards_every_route_but_health_and_metrics():
    engine = slow_engine()
    with BackgroundServer(make_app(engine, ServerOptions(api_key="sesame"))) as server:
        for path in ["/v1/models", "/v1/completions", "/tokenize", "/nope", "/openapi.json"]:
            method = "POST" if path in ("/v1/completions", "/tokenize") else "GET"
            kw = {"json": {"prompt": [5], "max_tokens": 1}} if method == "POST" else {}
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
                r = httpx.request(method, server.url + path, headers=headers, **kw)
                assert r.status_code == 401, (path, headers)
                assert r.json()["error"]["code"] == "invalid_api_key"
            r = httpx.request(method, server.url + path, headers={"Authorization": "Bearer sesame"}, **kw)
            assert r.status_code != 401, path
        assert httpx.get(server.url + "/health").status_code == 200
        # Prometheus scrapes /metrics without a key, as it does against vLLM.
        r = httpx.get(server.url + "/metrics")
        assert r.status_code == 200 and "num_requests_running" in r.text


def test_protect_metrics_puts_metrics_behind_the_key():
    engine = slow_engine()
    opts = ServerOptions(api_key="sesame", protect_metrics=True)
    with BackgroundServer(make_app(engine, opts)) as server:
        for path in ["/v1/models", "/metrics", "/v1/completions", "/nope", "/openapi.json"]:
            method = "POST" if path == "/v1/completions" else "GET"
            kw = {"json": {"prompt": [5], "max_tokens": 1}} if method == "POST" else {}
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
                r = httpx.request(method, server.url + path, headers=headers, **kw)
                assert r.status_code == 401, (path, headers)
                assert r.json()["error"]["code"] == "invalid_api_key"
            r = httpx.request(method, server.url + path, headers={"Authorization": "Bearer sesame"}, **kw)
            assert r.status_code == (404 if path == "/nope" else 200), path
        assert httpx.get(server.url + "/health").status_code == 200
