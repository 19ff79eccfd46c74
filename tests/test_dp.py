"""Data parallel on the CPU: 2 engine processes on the default model give one engine's outputs.

One 2-process engine serves every end-to-end case (starting processes dominates the time); the case that
kills a process runs last.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from overnight.entrypoints.llm import LLM
from overnight.errors import EngineDeadError, InvalidRequestError
from overnight.parallel.dp import DataParallelEngine, LoadBook, request_cost
from overnight.sampling_params import SamplingParams
from tests.batch_helpers import run_batch_lines

pytestmark = pytest.mark.slow  # starts engine processes

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "1 2 3 4",
    "Write a haiku about the sea.",
    "Once upon a time",
    "The best way to learn Python is",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
# Unseeded: the driver draws each seed as one engine would, so even these match.
SAMPLED = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=8)
PARAMS = [GREEDY, SAMPLED] * (len(PROMPTS) // 2)


@pytest.fixture(scope="module")
def one_engine():
    return LLM(device="cpu")


@pytest.fixture(scope="module")
def reference(one_engine):
    return one_engine.generate(PROMPTS, PARAMS, use_tqdm=False)


@pytest.fixture(scope="module")
def dp():
    llm = LLM(device="cpu", data_parallel_size=2)
    yield llm
    llm.engine.shutdown()


def test_load_book_deals_to_least_outstanding_work():
    book = LoadBook(2)
    assert book.assign("a", 100) == 0
    assert book.assign("b", 10) == 1
    assert book.assign("c", 10) == 1  # 10 < 100 outstanding tokens
    assert book.assign("d", 80) == 1  # 20 < 100
    assert book.assign("e", 5) == 0  # 100 tokens each: fewer requests wins
    assert book.release("a") == 0 and book.release("a") is None
    assert book.tokens == [5, 100] and book.requests == [1, 3]
    assert request_cost(10, SamplingParams(max_tokens=None, n=2), max_model_len=50) == 2 * 50


def test_outputs_match_one_engine(dp, reference):
    assert isinstance(dp.engine, DataParallelEngine)
    got = dp.generate(PROMPTS, PARAMS, use_tqdm=False)
    for a, b in zip(reference, got, strict=True):
        assert a.prompt == b.prompt
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].text == b.outputs[0].text
    # Both engines did work, and nothing is left outstanding.
    assert all(s is not None and s.prefix_cache_queries > 0 for s in dp.engine._stats)
    assert not dp.engine.has_unfinished_requests() and dp.engine.book.tokens == [0, 0]


def test_generate_stream_and_stats_observer(dp, reference):
    seen = []

    class Observer:
        def on_step(self, scheduler, iteration):
            seen.append(iteration.num_generation_tokens)

    dp.engine.observers.append(Observer())
    try:
        got = dict(dp.generate_stream(PROMPTS, iter(PARAMS), use_tqdm=False))
    finally:
        dp.engine.observers.clear()
    assert sorted(got) == list(range(len(PROMPTS)))
    # A fresh run draws fresh seeds for unseeded requests, so only greedy rows repeat.
    for i in range(0, len(PROMPTS), 2):
        assert got[i].outputs[0].token_ids == reference[i].outputs[0].token_ids
    assert sum(seen) == sum(len(o.outputs[0].token_ids) for o in got.values())


def test_abort_and_invalid_prompt(dp):
    engine = dp.engine
    ids = dp.get_tokenizer().encode("A long story about")
    engine.add_request("gone", ids, SamplingParams(max_tokens=64, ignore_eos=True))
    engine.add_request("kept", ids, GREEDY)
    finished = [o.request_id for o in engine.step() if o.finished]  # sends both, waits for news
    engine.abort_request("gone")
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["kept"]
    with pytest.raises(InvalidRequestError, match="prompt 1"):
        dp.generate(["fine", "x " * 10_000], GREEDY, use_tqdm=False)
    assert not engine.has_unfinished_requests()


def test_structured_outputs_over_dp(dp, one_engine):
    """Requests carry only their params to the engine processes, each compiles the grammar itself; a bad
    spec is refused by the front before anything is sent."""
    from overnight.sampling_params import StructuredOutputsParams

    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "sunny": {"type": "boolean"}},
        "required": ["city", "sunny"],
    }
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema)
        ),
        SamplingParams(
            temperature=0.7,
            seed=5,  # the two LLMs have drawn different numbers of unseeded seeds before this test
            max_tokens=12,
            structured_outputs=StructuredOutputsParams(regex="[0-9]{3}"),
        ),
    ] * (len(PROMPTS) // 2)
    got = dp.generate(PROMPTS, params, use_tqdm=False)
    want = one_engine.generate(PROMPTS, params, use_tqdm=False)
    for a, b, p in zip(got, want, params, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        if p.structured_outputs.kind == "json":
            assert set(json.loads(a.outputs[0].text)) == {"city", "sunny"}
        else:
            assert len(a.outputs[0].text) == 3 and a.outputs[0].text.isdigit()
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(x"))
    with pytest.raises(InvalidRequestError, match="prompt 1: the regex cannot be compiled"):
        dp.generate(["fine", "also fine"], [GREEDY, bad], use_tqdm=False)
    assert not dp.engine.has_unfinished_requests()


def test_run_batch_over_dp_keeps_order_and_errors(dp, one_engine):
    lines = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": p, "max_tokens": 6, "temperature": 0},
        }
        for i, p in enumerate(PROMPTS)
    ]
    lines.insert(3, {"custom_id": "bad", "method": "POST", "url": "/v1/completions", "body": {"prompt": ""}})
    got, want = run_batch_lines(dp.engine, lines), run_batch_lines(one_engine.engine, lines)
    assert [r["custom_id"] for r in got] == [line["custom_id"] for line in lines]
    assert got[3]["error"] is not None and got[3]["error"]["code"] == want[3]["error"]["code"]
    for a, b in zip(got, want, strict=True):
        if a["error"] is None:
            assert a["response"]["body"]["choices"] == b["response"]["body"]["choices"]


def test_async_engine_over_dp_stops_with_requests_in_flight(dp):
    """The server's engine thread over a data-parallel front: stopping aborts what is in flight (it once
    asked the front for a field only the single engine has, and failed)."""
    import asyncio
    from contextlib import aclosing

    from overnight.server.async_engine import AsyncEngine

    ids = dp.get_tokenizer().encode("A long story about")

    async def main() -> list[str]:
        ae = AsyncEngine(dp.engine)
        ae.start()
        seen: list[str] = []

        async def consume() -> None:
            params = SamplingParams(max_tokens=10_000, ignore_eos=True)
            try:
                async with aclosing(ae.generate("long", ids, params, stream=True)) as outs:
                    async for out in outs:
                        seen.append(out.outputs[0].finish_reason or "")
            except EngineDeadError:
                seen.append("stopped")

        task = asyncio.create_task(consume())
        while not seen:  # the request is running in an engine process
            await asyncio.sleep(0.05)
        await ae.stop()
        await task
        assert ae.error is None
        return seen

    seen = asyncio.run(main())
    assert seen[-1] in ("abort", "stopped")
    assert not dp.engine.has_unfinished_requests()


def test_dead_engine_raises(dp):
    dp.engine.links._procs[1].kill()
    with pytest.raises(EngineDeadError, match="engine 1"):
        dp.generate(PROMPTS, GREEDY, use_tqdm=False)


def test_dummy_preset_over_dp_matches_one_engine():
    """Dummy weights ship no tokenizer: the data-parallel front resolves the model exactly as one engine
    does (it once insisted on a tokenizer and failed), and its engines draw the same random weights."""
    opts = dict(load_format="dummy", device="cpu", max_model_len=64, max_num_seqs=4)
    prompts = [[101 + i, 202, 303 + 7 * i] for i in range(4)]
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    want = LLM("smollm2-135m", **opts).generate(prompts, greedy, use_tqdm=False)
    dp = LLM("smollm2-135m", data_parallel_size=2, **opts)
    try:
        assert dp.get_tokenizer() is None
        got = dp.generate(prompts, greedy, use_tqdm=False)
    finally:
        dp.engine.shutdown()
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_an_engine_process_logs_like_its_parent():
    """The engine in its own process (as `overnight serve` runs it) logs with the parent's setup: its
    start-up lines reach stderr. A spawned process starts with no logging, which lost them before."""
    script = (
        "import logging\n"
        "from overnight import LLM, SamplingParams, logs\n"
        "logs.configure(logging.INFO)\n"
        "llm = LLM(device='cpu', engine_process=True, max_model_len=256)\n"
        "print(llm.generate('Hi', SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids)\n"
        "llm.engine.shutdown()\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "start-up: model" in done.stderr and "KV pool:" in done.stderr, done.stderr[-2000:]
