"""Streaming at saturation, on fake engines (seconds): deltas that queued up go out merged as one chunk,
chunks carry the usage so far when asked (continuous_usage_stats), and outputs cross from an engine
process as plain tuples and come back equal."""

from __future__ import annotations

import asyncio
import pickle
import threading
from contextlib import aclosing

import pytest
from openai.types import Completion

from overnight.openai_api import CompletionStream, parse_request
from overnight.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from overnight.parallel.output_codec import pack, unpack
from overnight.sampling_params import SamplingParams
from overnight.server.async_engine import AsyncEngine
from overnight.server.cli import ServerOptions
from overnight.server.deltas import Pacer, coalesce, merge
from tests.engine_helpers import EOS, VOCAB, slow_engine
from tests.fake_runner import reference_output


def delta(
    rid: str, index: int, ids: list[int], text: str, reason: str | None = None, lps=None
) -> RequestOutput:
    comp = CompletionOutput(index, text, ids, -1.5 if lps else None, lps, reason, None)
    return RequestOutput(rid, None, [1, 2, 3], [comp], finished=reason is not None, delta=True)


def test_merge_concatenates_per_choice_and_keeps_the_newest_finish():
    lp = [{5: Logprob(-0.1, 1, "a")}]
    a = delta("r", 0, [5], "a", lps=lp)
    b = delta("r", 0, [6, 7], "bc", reason="length", lps=[{6: Logprob(-0.2, 1)}, {7: Logprob(-0.3, 2)}])
    b.outputs.append(CompletionOutput(1, "x", [9], None, None, None, None))  # n=2: the other choice
    m = merge(a, b)
    assert [c.index for c in m.outputs] == [0, 1]
    assert m.outputs[0].token_ids == [5, 6, 7] and m.outputs[0].text == "abc"
    assert m.outputs[0].finish_reason == "length" and m.finished and len(m.outputs[0].logprobs) == 3
    assert m.outputs[1].token_ids == [9]
    assert a.outputs[0].token_ids == [5]  # the inputs are left as they were


def test_coalesce_merges_per_prompt_index_in_first_arrival_order():
    items = [(1, delta("r1", 0, [1], "a")), (0, delta("r0", 0, [2], "b")), (1, delta("r1", 0, [3], "c"))]
    out = coalesce(items)
    assert [i for i, _ in out] == [1, 0]
    assert out[0][1].outputs[0].token_ids == [1, 3] and out[1][1].outputs[0].token_ids == [2]
    whole = RequestOutput("w", None, [1], [CompletionOutput(0, "t", [4], None, None, "stop")], finished=True)
    assert coalesce([(0, whole)]) == [(0, whole)]


def test_continuous_usage_puts_the_usage_so_far_in_every_chunk():
    req = parse_request(
        "/v1/completions",
        {
            "prompt": "hi",
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    )
    assert req.continuous_usage
    # without include_usage the extension does nothing (vLLM reads the pair the same way)
    alone = parse_request(
        "/v1/completions",
        {"prompt": "hi", "stream": True, "stream_options": {"continuous_usage_stats": True}},
    )
    assert not alone.continuous_usage
    stream = CompletionStream("m", include_usage=True, continuous_usage=True)
    chunks = stream.chunks(0, delta("r", 0, [5, 6, 7], "abc")) + stream.chunks(
        0, delta("r", 0, [8], "d", "length")
    )
    assert [c["usage"]["completion_tokens"] for c in chunks] == [3, 4]
    assert all(c["usage"]["prompt_tokens"] == 3 for c in chunks)
    Completion.model_validate(chunks[-1])  # the finishing chunk, usage included, is a valid Completion
    assert stream.final_chunks()[0]["usage"]["completion_tokens"] == 4
    plain = CompletionStream("m", include_usage=True)
    assert plain.chunks(0, delta("r", 0, [5], "a"))[0]["usage"] is None


def test_outputs_cross_the_pipe_as_tuples_and_come_back_equal():
    metrics = RequestMetrics(1.0, 1.5, 2.0, 2.5, None)
    lps = [{5: Logprob(-0.1, 1, "a"), 9: Logprob(-2.0, 2, None)}]
    outs = [
        RequestOutput(
            "a",
            "hi",
            [1, 2, 3],
            [CompletionOutput(0, "a", [5], -0.1, lps, None, None)],
            False,
            metrics,
            0,
            True,
        ),
        RequestOutput(
            "b", None, [4], [CompletionOutput(0, "xy", [6, 7], None, None, "stop", "</s>")], True, None, 16
        ),
    ]
    wire = pickle.loads(pickle.dumps(pack(outs)))
    prompts = {"a": ("hi", [1, 2, 3]), "b": (None, [4])}
    assert unpack(wire, prompts.get) == outs
    assert unpack(wire, {"b": (None, [4])}.get) == outs[1:]  # a request the front forgot is dropped
    assert all(isinstance(x, (tuple, list)) for x in wire)  # no dataclass crosses


def test_a_consumer_that_falls_behind_gets_merged_deltas_with_every_token():
    engine = slow_engine(async_mode=True)

    async def main():
        ae = AsyncEngine(engine)
        ae.start()
        batches: list[list[int]] = []
        gate = threading.Event()
        async with aclosing(
            ae.generate_batches([("r", None, [5, 6, 7])], SamplingParams(max_tokens=30))
        ) as outs:
            async for batch in outs:
                ((index, out),) = batch  # one entry per prompt, however many deltas waited
                batches.append(out.outputs[0].token_ids)
                if len(batches) == 1:  # fall behind: the engine runs on while we sleep
                    await asyncio.to_thread(gate.wait, 0.3)
        await ae.stop()
        return batches

    batches = asyncio.run(main())
    assert sum(batches, []) == reference_output([5, 6, 7], 30, VOCAB, EOS)
    assert len(batches) < 30 and max(len(b) for b in batches) > 1  # some chunk carried several steps


def test_the_pacer_holds_deltas_until_they_carry_the_interval():
    pacer = Pacer(3)
    assert pacer.due([(0, delta("a", 0, [1], "x")), (1, delta("b", 0, [2, 3, 4], "yzw"))]) == [
        (1, delta("b", 0, [2, 3, 4], "yzw"))
    ]
    assert pacer.due([(0, delta("a", 0, [5], "x"))]) == []  # 2 of 3 held
    ((index, out),) = pacer.due([(0, delta("a", 0, [6], "x"))])
    assert index == 0 and out.outputs[0].token_ids == [1, 5, 6] and out.outputs[0].text == "xxx"
    pacer.due([(0, delta("a", 0, [7], "x"))])
    ((_, last),) = pacer.due([(0, delta("a", 0, [8], "y", reason="length"))])  # an end goes out at once
    assert last.finished and last.outputs[0].token_ids == [7, 8]
    pacer.due([(2, delta("c", 0, [9], "q"))])
    assert [i for i, _ in pacer.flush()] == [2] and pacer.flush() == []
    with pytest.raises(ValueError, match="at least 1"):
        ServerOptions(stream_interval=0)


def test_a_stream_interval_sends_fewer_chunks_with_every_token():
    engine = slow_engine(async_mode=True)

    async def main(interval: int) -> list[list[int]]:
        ae = AsyncEngine(engine)
        ae.start()
        batches: list[list[int]] = []
        params = SamplingParams(max_tokens=30)
        async with aclosing(ae.generate_batches([("r", None, [5, 6, 7])], params, True, interval)) as outs:
            async for batch in outs:
                ((_, out),) = batch
                batches.append(out.outputs[0].token_ids)
        await ae.stop()
        return batches

    batches = asyncio.run(main(4))
    assert sum(batches, []) == reference_output([5, 6, 7], 30, VOCAB, EOS)
    assert all(len(b) >= 4 for b in batches[:-1]) and len(batches) <= 8


class _NoFinalFront:
    """An engine front like the engine-process one: abort_request stops the request but returns nothing."""

    def __init__(self, engine) -> None:
        self._engine = engine

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def abort_request(self, request_id: str) -> None:
        self._engine.abort_request(request_id)


def test_aborts_are_counted_when_the_front_returns_no_final_output():
    from overnight.metrics.prometheus import PrometheusObserver

    metrics = PrometheusObserver("m")

    async def main():
        ae = AsyncEngine(_NoFinalFront(slow_engine(delay=0.01)), metrics)
        ae.start()
        params = SamplingParams(max_tokens=500, ignore_eos=True, n=2)
        async with aclosing(ae.generate("a", [5, 6, 7], params)) as outs:
            async for _ in outs:
                break  # the client leaves
        for _ in range(200):
            if ae.stats.num_running == 0:
                break
            await asyncio.sleep(0.01)
        await ae.stop()

    asyncio.run(main())
    assert b'request_success_total{finished_reason="abort",model_name="m"} 2.0' in metrics.render()
