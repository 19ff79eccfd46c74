"""Tier (a): scheduler, block pool and engine loop with a fake runner (no weights), in seconds."""

from __future__ import annotations

import random

import pytest

from overnight.engine.engine import Engine
from overnight.errors import ConfigError, InvalidRequestError
from overnight.sampling_params import SamplingParams
from tests.engine_helpers import EOS, VOCAB, make_engine, run_all
from tests.fake_runner import reference_output


def random_prompts(n: int, rng: random.Random, lo: int = 1, hi: int = 60) -> list[list[int]]:
    return [[rng.randrange(10, VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.mark.parametrize("async_mode", [False, True], ids=["sync", "one-step-ahead"])
def test_limits_respected_every_step_and_all_blocks_freed(async_mode):
    engine, runner = make_engine(max_num_seqs=8, max_num_batched_tokens=32, async_mode=async_mode)
    rng = random.Random(0)
    prompts = random_prompts(40, rng)
    max_tokens = [rng.randint(1, 30) for _ in prompts]
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(str(i), p, SamplingParams(max_tokens=m, ignore_eos=True))

    def check(e: Engine) -> None:
        assert len(e.scheduler.running) <= 8

    results = run_all(engine, check)
    assert all(tokens <= 32 for tokens, _ in runner.step_log)
    assert all(reqs <= 8 for _, reqs in runner.step_log)
    assert sorted(results, key=int) == [str(i) for i in range(40)], "a request starved"
    for i, m in enumerate(max_tokens):
        assert len(results[str(i)]) == m
    assert engine.kv.pool.num_free == engine.kv.num_blocks
    assert engine.kv.req_blocks == {}
    assert engine.parents == {} and engine.children == {}


@pytest.mark.parametrize("async_mode", [False, True], ids=["sync", "one-step-ahead"])
@pytest.mark.parametrize("num_blocks", [400, 20])
def test_batch_invariance_with_and_without_preemption(num_blocks, async_mode):
    rng = random.Random(1)
    prompts = random_prompts(64, rng)
    max_tokens = [rng.randint(5, 40) for _ in prompts]
    engine, _ = make_engine(
        num_blocks=num_blocks, block_size=4, max_num_seqs=64, max_model_len=80, async_mode=async_mode
    )
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(str(i), p, SamplingParams(max_tokens=m))
    results = run_all(engine)
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        assert results[str(i)] == reference_output(p, min(m, 80 - len(p)), VOCAB, EOS), i
    if num_blocks == 20:
        assert engine.scheduler.num_preemptions_total > 0, "the small pool should force preemption"
    else:
        assert engine.scheduler.num_preemptions_total == 0
    assert engine.kv.pool.num_free == num_blocks


@pytest.mark.parametrize("async_mode", [False, True], ids=["sync", "one-step-ahead"])
def test_prefix_cache_hits_and_same_outputs(async_mode):
    rng = random.Random(2)
    prefix = [rng.randrange(10, VOCAB) for _ in range(200)]
    prompts = [prefix + [rng.randrange(10, VOCAB) for _ in range(rng.randint(1, 20))] for _ in range(32)]

    def run(caching: bool):
        engine, _ = make_engine(
            num_blocks=2000,
            block_size=16,
            max_num_seqs=32,
            max_num_batched_tokens=512,
            max_model_len=512,
            caching=caching,
        )
        engine.add_request("warm", prompts[0], SamplingParams(max_tokens=4))
        run_all(engine)  # the first request computes the prefix
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(max_tokens=8))
        return run_all(engine), engine

    cached, eng_c = run(True)
    plain, eng_p = run(False)
    assert cached == plain
    # Every one of the 32 requests finds the 12 full blocks (192 tokens) of the shared prefix.
    assert eng_c.kv.prefix_hits >= 32 * 192
    assert eng_p.kv.prefix_hits == 0


def test_chunked_prefill_splits_a_long_prompt():
    engine, runner = make_engine(max_num_batched_tokens=16, max_model_len=256, num_blocks=128)
    prompt = list(range(10, 110))
    engine.add_request("long", prompt, SamplingParams(max_tokens=5, ignore_eos=True))
    results = run_all(engine)
    assert results["long"] == reference_output(prompt, 5, VOCAB, None)
    assert runner.chunks["long"][:7] == [16] * 6 + [4]


def test_no_chunked_prefill_rejects_prompt_over_budget():
    engine, _ = make_engine(max_num_batched_tokens=16, chunked=False)
    with pytest.raises(InvalidRequestError, match="max_num_batched_tokens"):
        engine.add_request("x", list(range(10, 40)), SamplingParams())
    engine.add_request("ok", list(range(10, 20)), SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(run_all(engine)["ok"]) == 3


@pytest.mark.parametrize("async_mode", [False, True], ids=["sync", "one-step-ahead"])
def test_abort_frees_blocks(async_mode):
    engine, _ = make_engine(async_mode=async_mode)
    engine.add_request("a", list(range(10, 50)), SamplingParams(max_tokens=100, ignore_eos=True))
    engine.add_request("b", list(range(10, 30)), SamplingParams(max_tokens=5, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.kv.pool.num_free < engine.kv.num_blocks
    final = engine.abort_request("a")
    assert final is not None and final.outputs[0].finish_reason == "abort"
    results = run_all(engine)
    assert list(results) == ["b"]
    assert engine.kv.pool.num_free == engine.kv.num_blocks


def test_bad_requests_are_refused_and_engine_keeps_serving():
    engine, _ = make_engine(max_model_len=64)
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("e", [], SamplingParams())
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        engine.add_request("long", list(range(10, 80)), SamplingParams())
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        engine.add_request("v", [VOCAB + 5], SamplingParams())
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(InvalidRequestError, match="temperature"):
        SamplingParams(temperature=-1)
    engine.add_request("good", [11, 12, 13], SamplingParams(max_tokens=4, ignore_eos=True))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("good", [11, 12, 13], SamplingParams())
    assert len(run_all(engine)["good"]) == 4


@pytest.mark.parametrize("async_mode", [False, True], ids=["sync", "one-step-ahead"])
def test_stop_token_ids_min_tokens_and_length_cap(async_mode):
    engine, _ = make_engine(max_model_len=40, async_mode=async_mode)
    prompt = [20, 21, 22]
    ref = reference_output(prompt, 30, VOCAB, None)
    stop_tok = ref[4]
    engine.add_request("stop", prompt, SamplingParams(max_tokens=30, stop_token_ids=[stop_tok]))
    engine.add_request("min", prompt, SamplingParams(max_tokens=30, stop_token_ids=[stop_tok], min_tokens=6))
    engine.add_request("cap", prompt, SamplingParams(max_tokens=None, ignore_eos=True))
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o.outputs[0]
    assert outs["stop"].token_ids == ref[:5] and outs["stop"].stop_reason == stop_tok
    assert outs["stop"].finish_reason == "stop"
    assert len(outs["min"].token_ids) > 6 or outs["min"].finish_reason == "length"
    assert outs["cap"].finish_reason == "length" and len(outs["cap"].token_ids) == 40 - 3


def test_n_completions_share_the_prompt():
    engine, _ = make_engine()
    engine.add_request("p", list(range(10, 60)), SamplingParams(n=3, max_tokens=5, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert len(outs) == 1 and outs[0].finished
    assert [c.index for c in outs[0].outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 5 for c in outs[0].outputs)
    assert engine.kv.pool.num_free == engine.kv.num_blocks


def test_pool_smaller_than_one_sequence_is_refused():
    with pytest.raises(ConfigError, match="max_model_len"):
        make_engine(num_blocks=10, block_size=4, max_model_len=64)


def test_the_engine_clamps_max_tokens_to_the_context():
    """The offline class's rule (documented on LLM): no refusal, the request ends by length."""
    engine, _ = make_engine(max_model_len=64)
    engine.add_request("r", list(range(10, 20)), SamplingParams(max_tokens=10**9, ignore_eos=True))
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    (out,) = done
    assert len(out.outputs[0].token_ids) == 54 and out.outputs[0].finish_reason == "length"
