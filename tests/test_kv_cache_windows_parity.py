"""Tier (c): sliding-window layers against HF transformers, fp32 greedy, token-exact, while the engine
gives windowed blocks back (engine/kv_groups.py).

The model is a tiny Qwen3 with Gemma-3's shape: 5 windowed layers, then 1 full one (layer_types). A
check first proves transformers applies the window for that config (its tokens differ from the same
weights without it), so agreement means the engine's windows are right, not merely unused."""

from __future__ import annotations

import random

import pytest

from overnight import LLM, SamplingParams
from overnight.engine.kv_groups import KVCacheLayout
from tests.engine_helpers import peak_long_running
from tests.test_engine_parity import hf_greedy
from tests.tiny_models import load_reference, make_tiny_checkpoint

pytestmark = pytest.mark.slow  # real models beside transformers

W = 12
SHAPE = ["sliding_attention"] * 5 + ["full_attention"]
WINDOWED = dict(num_hidden_layers=6, use_sliding_window=True, sliding_window=W, layer_types=SHAPE)
ENGINE = dict(skip_tokenizer_init=True, dtype="float32", device="cpu", block_size=4)


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("windows")
    folder = make_tiny_checkpoint(tmp, "qwen3", name="windowed", **WINDOWED)
    full = make_tiny_checkpoint(tmp, "qwen3", name="full", num_hidden_layers=6)  # the same weights
    return folder, load_reference(folder), full, load_reference(full)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def test_transformers_applies_the_window(windowed):
    _, ref, _, ref_full = windowed
    assert ref.config.layer_types == SHAPE and ref.config.sliding_window == W
    prompt = [random.Random(0).randrange(3, 384) for _ in range(40)]
    assert hf_greedy(ref, prompt, 8)[0] != hf_greedy(ref_full, prompt, 8)[0]


def test_token_exact_with_shared_prefix_chunks_across_the_window_and_preemption(windowed):
    folder, ref, _, _ = windowed
    rng = random.Random(1)
    prefix = [rng.randrange(3, 384) for _ in range(30)]  # longer than the window
    prompts = [prefix + [rng.randrange(3, 384) for _ in range(k)] for k in (3, 7, 11)]
    prompts += [[rng.randrange(3, 384) for _ in range(k)] for k in (5, 13, 40, 57)]
    # Blocks of 4 tokens, chunks of 16 (prompts cross the window in pieces), and a pool of 120 blocks:
    # the seven sequences cannot all keep growing at once, so some are preempted and recomputed.
    llm = LLM(
        str(folder),
        kv_cache_memory_bytes=120 * 4 * 2 * 2 * 16 * 4,
        max_num_batched_tokens=16,
        max_model_len=128,
        # input order: which requests the look-ahead order runs together depends on timing, and with
        # it how many prefix blocks survive the preemptions (24 hit tokens in one run of the suite)
        schedule="fifo",
        admission="greedy",  # start whatever fits now, so that running requests outgrow the pool
        **ENGINE,
    )
    assert llm.engine.pool_plan.num_blocks == 120
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(24), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(ref, prompt, 24)[0], f"prompt of {len(prompt)} tokens"
    stats = llm.engine.stats()
    assert stats.num_preemptions_total > 0
    assert stats.prefix_cache_hits >= 2 * 28  # the later shared-prefix prompts start past 7 blocks
    assert llm.engine.kv.pool.num_free == 120  # type: ignore[attr-defined]


def test_gemma3_shape_holds_three_times_the_sequences_and_the_same_tokens(windowed):
    """The same pool bytes, at a context of 20 + 124 tokens: count the sequences that are long at once."""
    folder, ref, full, _ = windowed
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 384) for _ in range(20)] for _ in range(20)]
    pool_bytes = 1 << 20
    long_at_once = {}
    outputs = {}
    for name, path in (("windowed", folder), ("full", full)):
        llm = LLM(
            str(path),
            kv_cache_memory_bytes=pool_bytes,
            max_model_len=160,
            max_num_seqs=32,
            enable_prefix_caching=False,
            **ENGINE,
        )
        long_at_once[name], outputs[name] = peak_long_running(llm.engine, prompts, greedy(124), 128)
    layout = KVCacheLayout.from_arch(load_arch(folder), 160)
    assert layout.num_groups == 6
    assert long_at_once["full"] >= 1
    assert long_at_once["windowed"] >= 3 * long_at_once["full"], long_at_once
    for i in range(0, 20, 4):  # transformers is slow at this length: a fourth of them
        assert outputs["windowed"][str(i)] == hf_greedy(ref, prompts[i], 124)[0], i


def load_arch(folder):
    from overnight.loader.resolve import resolve_source

    return resolve_source(str(folder), "auto").arch


def test_two_full_groups_on_one_tensor_match_transformers(tmp_path, monkeypatch):
    """The groups' plumbing without windows: each layer of a 2-layer model in its own group, both on
    one tensor (so every step has two block tables and two slot mappings, and blocks of one group must
    never be written by the other), against transformers with a shared prefix and preemption."""
    from overnight.engine.kv_groups import KVGroup

    folder = make_tiny_checkpoint(tmp_path, "qwen3")
    two = KVCacheLayout(
        (KVGroup(None, (0,)), KVGroup(None, (1,))), 1, (0, 1), (0, 0), (0, 1), (32,), ((2, 16),) * 2
    )
    monkeypatch.setattr(KVCacheLayout, "from_arch", classmethod(lambda cls, arch, max_len=None: two))
    rng = random.Random(3)
    prefix = [rng.randrange(3, 384) for _ in range(20)]
    prompts = [prefix + [rng.randrange(3, 384) for _ in range(k)] for k in (1, 6, 9, 30)]
    block = 4 * 2 * 2 * 16 * 4  # 4 tokens x 1 tensor x K/V x 2 heads x 16 x fp32
    llm = LLM(
        str(folder),
        kv_cache_memory_bytes=60 * block,
        max_num_batched_tokens=16,
        max_model_len=96,
        admission="greedy",  # start whatever fits now, so that running requests outgrow the pool
        **ENGINE,
    )
    caches = llm.engine.runner.kv_caches  # type: ignore[attr-defined]
    assert len(caches) == 2 and caches[0] is caches[1]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(20), use_tqdm=False)
    ref = load_reference(folder)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(ref, prompt, 20)[0], f"prompt of {len(prompt)} tokens"
    stats = llm.engine.stats()
    assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits > 0


def test_groups_of_several_layers_with_a_padded_last_group_match_transformers(tmp_path):
    """27 layers, 4 full (every sixth, as Gemma 3 places them) and 23 windowed: groups of 4 layers
    (group_size), the last windowed group 3 layers in 4 slots, every tensor shared by seven groups.
    Token-exact with transformers while windowed blocks are given back and the pool runs short."""
    kinds = ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(27)]
    folder = make_tiny_checkpoint(
        tmp_path, "qwen3", num_hidden_layers=27, use_sliding_window=True, sliding_window=W, layer_types=kinds
    )
    layout = KVCacheLayout.from_arch(load_arch(folder), 96)
    assert layout.num_tensors == 4 and [len(g.layers) for g in layout.groups] == [4, 4, 4, 4, 4, 4, 3]
    assert layout.windows == (None,) + (W,) * 6
    rng = random.Random(4)
    prefix = [rng.randrange(3, 384) for _ in range(20)]
    prompts = [prefix + [rng.randrange(3, 384) for _ in range(k)] for k in (2, 9)]
    prompts += [[rng.randrange(3, 384) for _ in range(k)] for k in (6, 17, 33)]
    block = 4 * 4 * 2 * 2 * 16 * 4  # 4 tokens x 4 tensors x K/V x 2 heads x 16 x fp32
    llm = LLM(
        str(folder),
        kv_cache_memory_bytes=90 * block,
        max_num_batched_tokens=16,
        max_model_len=96,
        admission="greedy",  # start whatever fits now, so that running requests outgrow the pool
        **ENGINE,
    )
    assert llm.engine.pool_plan.num_blocks == 90
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(20), use_tqdm=False)
    ref = load_reference(folder)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(ref, prompt, 20)[0], f"prompt of {len(prompt)} tokens"
    assert llm.engine.stats().num_preemptions_total > 0
    assert llm.engine.kv.pool.num_free == 90  # type: ignore[attr-defined]


def test_tensor_parallel_ranks_give_window_blocks_back_alike(windowed):
    """Two ranks, each with its share of the KV heads: the same groups, tables and tokens."""
    folder, ref, _, _ = windowed
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 384) for _ in range(k)] for k in (9, 33)]
    llm = LLM(str(folder), tensor_parallel_size=2, max_num_batched_tokens=16, max_model_len=96, **ENGINE)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(16), use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            assert out.outputs[0].token_ids == hf_greedy(ref, prompt, 16)[0]
    finally:
        llm.engine.runner.shutdown()  # type: ignore[attr-defined]
