"""`serve` with LoRA adapters (--lora-modules): /v1/models lists them with the base model as parent, a
request picks one by its `model` (streamed or not) and gets what LLM.generate gives with it, an unknown
name is a 404 while the others keep being served. Also the data-parallel front (the engine in a process
of its own, as `serve` runs it) carrying each request's adapter."""

from __future__ import annotations

import json

import httpx
import pytest

from overnight import LLM, LoRARequest, SamplingParams
from overnight.server.background import BackgroundServer
from overnight.server.cli import ServerOptions, make_app
from tests.batch_helpers import make_batch_model
from tests.lora_adapters import make_adapter
from tests.test_run_batch import SERVED

pytestmark = pytest.mark.slow  # the real (tiny) model

PROMPT = [17, 99, 250, 31, 7, 64, 120]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-serve")
    model = make_batch_model(root)
    adapters = {
        "sql": LoRARequest(
            "sql", 1, str(make_adapter(model, root / "sql", r=8, targets=("q_proj", "down_proj")))
        ),
        "chat": LoRARequest(
            "chat", 2, str(make_adapter(model, root / "chat", r=4, targets=("v_proj",), seed=5))
        ),
    }
    kwargs = dict(
        max_model_len=96,
        kv_cache_memory_bytes=8 << 20,
        device="cpu",
        dtype="float32",
        served_model_name=SERVED,
    )
    llm = LLM(model, enable_lora=True, max_loras=1, max_lora_rank=8, **kwargs)
    greedy = SamplingParams(temperature=0, max_tokens=6)
    want = {name: llm.generate([PROMPT], greedy, use_tqdm=False, lora_request=lora)[0].outputs[0].text
            for name, lora in [*adapters.items(), (SERVED, None)]}  # fmt: skip
    return model, llm, adapters, want, kwargs


def test_models_and_requests_per_adapter(setup) -> None:
    _, llm, adapters, want, _ = setup
    assert len(set(want.values())) == 3, "each adapter answers differently"
    with BackgroundServer(make_app(llm.engine, ServerOptions(), adapters=adapters)) as server:
        models = httpx.get(server.url + "/v1/models").json()["data"]
        by_id = {m["id"]: m for m in models}
        assert set(by_id) == {SERVED, "sql", "chat"}
        assert by_id["sql"]["parent"] == SERVED and by_id["sql"]["root"] == adapters["sql"].lora_path
        assert httpx.get(server.url + "/v1/models/chat").json()["parent"] == SERVED

        def complete(model: str, stream: bool = False) -> httpx.Response:
            body = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stream": stream}
            return httpx.post(server.url + "/v1/completions", json=body, timeout=60)

        for name in ("sql", "chat", SERVED):
            r = complete(name)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want[name]
            assert r.json()["model"] == name
        missing = complete("nope")
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "model_not_found"
        chunks = [
            json.loads(line[6:])
            for line in complete("sql", stream=True).text.splitlines()
            if line.startswith("data: {")
        ]
        # (this word-level tokenizer's incremental decoding puts a space before the first word)
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]).strip() == want["sql"]
        assert all(c["model"] == "sql" for c in chunks)


def test_engine_process_carries_the_adapter(setup) -> None:
    model, _, adapters, want, kwargs = setup
    llm = LLM(model, enable_lora=True, max_lora_rank=8, engine_process=True, **kwargs)
    try:
        greedy = SamplingParams(temperature=0, max_tokens=6)
        outs = llm.generate(
            [PROMPT] * 3, greedy, use_tqdm=False, lora_request=[adapters["sql"], None, adapters["chat"]]
        )
        assert [o.outputs[0].text for o in outs] == [want["sql"], want[SERVED], want["chat"]]
    finally:
        llm.engine.shutdown()
