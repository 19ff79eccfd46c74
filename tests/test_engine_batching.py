"""The real runner (tiny random Qwen3, fp32, CPU): batch invariance, preemption, prefix caching and
chunked prefill give the same greedy tokens as each request alone."""

from __future__ import annotations

import random

import pytest

from overnight import LLM, SamplingParams
from tests.engine_helpers import KV_BYTES_PER_TOKEN
from tests.tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.slow  # runs the real model


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("batching"), "qwen3"))


def make_llm(folder: str, pool_tokens: int = 8192, **kwargs) -> LLM:
    return LLM(
        folder,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=256,
        kv_cache_memory_bytes=pool_tokens * KV_BYTES_PER_TOKEN,
        **kwargs,
    )


def mixed_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 384) for _ in range(rng.randint(1, 120))] for _ in range(n)]


def greedy(llm: LLM, prompts: list[list[int]], max_tokens) -> list[list[int]]:
    if isinstance(max_tokens, int):
        max_tokens = [max_tokens] * len(prompts)
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_batch_of_64_equals_each_alone_and_survives_preemption(folder, monkeypatch):
    prompts = mixed_prompts(64)
    rng = random.Random(1)
    max_tokens = [rng.randint(4, 24) for _ in prompts]
    alone_llm = make_llm(folder)
    alone = [greedy(alone_llm, [p], [m])[0] for p, m in zip(prompts, max_tokens)]
    together = greedy(alone_llm, prompts, max_tokens)
    assert together == alone
    # A pool of 512 tokens holds ~5 of these requests at once: admitting whatever fits now, the
    # scheduler must preempt; planned admission (the default) starts only what can run to the end, or
    # to a pool larger by the model's tail share where that saves a wave (engine/admission.py).
    small = make_llm(folder, pool_tokens=512, admission="greedy")
    squeezed = greedy(small, prompts, max_tokens)
    greedy_preemptions = small.engine.scheduler.num_preemptions_total
    assert greedy_preemptions > 0
    assert squeezed == alone
    assert small.engine.kv.pool.num_free == small.engine.kv.num_blocks
    planned = make_llm(folder, pool_tokens=512)
    assert greedy(planned, prompts, max_tokens) == alone
    assert planned.engine.scheduler.num_preemptions_total < greedy_preemptions / 4
    # Held to the real pool, the plan (exact: every request ends by length) preempts nothing.
    monkeypatch.setattr("overnight.build.tail_share", lambda arch: 0.0)
    held = make_llm(folder, pool_tokens=512)
    assert held.engine.config.scheduler.admission_tail_share == 0.0
    assert greedy(held, prompts, max_tokens) == alone
    assert held.engine.scheduler.num_preemptions_total == 0


def test_prefix_cache_hits_and_matches_no_cache(folder):
    rng = random.Random(2)
    prefix = [rng.randrange(3, 384) for _ in range(200)]
    prompts = [prefix + [rng.randrange(3, 384) for _ in range(rng.randint(1, 30))] for _ in range(32)]
    cached = make_llm(folder)
    greedy(cached, [prompts[0]], 2)  # computes the prefix once
    hits_before = cached.engine.kv.prefix_hits
    with_cache = greedy(cached, prompts, 6)
    # 12 full blocks (192 tokens) of the shared prefix are found for each of the 32 requests
    assert cached.engine.kv.prefix_hits - hits_before >= 32 * 192
    outs = cached.generate([{"prompt_token_ids": prompts[3]}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert outs[0].num_cached_tokens >= 192
    plain = make_llm(folder, enable_prefix_caching=False)
    assert greedy(plain, prompts, 6) == with_cache
    assert plain.engine.kv.prefix_hits == 0


def test_chunked_prefill_matches_unchunked(folder):
    prompts = mixed_prompts(4, seed=3) + [[7 + (i * 13) % 370 for i in range(230)]]
    whole = greedy(make_llm(folder, max_num_batched_tokens=256), prompts, 10)
    chunked_llm = make_llm(folder, max_num_batched_tokens=48)
    chunked = greedy(chunked_llm, prompts, 10)
    assert chunked == whole
    assert len(prompts[-1]) > chunked_llm.engine.config.scheduler.max_num_batched_tokens
