"""Tier (a): chunked-attention KV cache groups (Llama 4's local layers: a query at p reads
floor(p / C) * C .. p) with the fake runner (engine/kv_groups.py, engine/kv_cache_manager.py). The fake
runner checks every step that each chunked group's table still maps the positions from the step's first
query's chunk start to the request's tokens; these tests check on top which blocks are held after each
step, exactly, and that outputs and the pool survive preemption, aborts and prefix hits."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from overnight.arch import ModelArch
from overnight.engine.admission import Admission
from overnight.engine.block_pool import Block
from overnight.engine.kv_cache_manager import KVCacheManager
from overnight.engine.kv_groups import KVCacheLayout, KVGroup, local_blocks
from overnight.engine.request import Request
from overnight.errors import ConfigError
from overnight.sampling_params import SamplingParams
from tests.fake_runner import reference_output
from tests.test_kv_cache_windows import (
    LONG_PROMPTS,
    _cached_request,
    assert_no_leak,
    make_engine,
    peak_running,
    run_with_an_abort,
)
from tests.test_scheduler import VOCAB, random_prompts

CHUNKED, FULL = "chunked_attention", "full_attention"
LLAMA4_SHAPE = (CHUNKED,) * 3 + (FULL,)  # every fourth layer global


def llama4_arch(chunk: int = 8, layer_types: tuple[str, ...] = LLAMA4_SHAPE) -> ModelArch:
    base = ModelArch("llama", VOCAB, 8, 16, len(layer_types), 1, 1, 8)
    return replace(base, layer_types=layer_types, attention_chunk_size=chunk)


# -- the layout -----------------------------------------------------------------------------------


def test_layout_declares_chunked_groups():
    layout = KVCacheLayout.from_arch(llama4_arch(), 256)
    assert layout.num_tensors == 1 and layout.layer_group == (1, 2, 3, 0)
    assert layout.windows == (None,) * 4 and layout.chunks == (None, 8, 8, 8)
    assert layout.groups[0].is_full and not layout.groups[1].is_full and layout.gives_back
    # Scout's proportions (36 chunked, 12 global): groups of 12 layers, the global one first.
    scout = KVCacheLayout.from_arch(llama4_arch(8192, LLAMA4_SHAPE * 12), 131072)
    assert scout.num_tensors == 12 and scout.chunks == (None,) + (8192,) * 3
    # A chunk no shorter than max_model_len never leaves a position behind: one full group.
    arch = llama4_arch(64)
    assert KVCacheLayout.from_arch(arch, 64) == KVCacheLayout.uniform(arch)
    assert not KVCacheLayout.uniform(arch).gives_back
    with pytest.raises(ValueError, match="a window .* or a chunk .*, not both"):
        KVGroup(8, (0,), chunk=8)
    with pytest.raises(ValueError, match="only in groups without a window"):
        KVCacheManager(10, 4, True, windows=(None, 8), chunks=(None, 8))


def test_blocks_per_sequence_counts_only_the_chunk_and_the_step():
    layout = KVCacheLayout.from_arch(llama4_arch(16), 1024)
    # Full group: 1024 / 4 blocks; a chunked group: chunk starts are block boundaries, so C - 1 + 32
    # tokens from one: cdiv(47, 4) = 12 blocks; between prefill chunks cdiv(16, 4) = 4.
    assert layout.blocks_per_sequence(1024, chunk=32, block_size=4) == 256 + 3 * 12
    assert layout.blocks_per_sequence(1024, chunk=1, block_size=4) == 256 + 3 * 4
    assert layout.blocks_per_sequence(8, chunk=32, block_size=4) == 4 * 2  # shorter than the chunk
    # A chunk not a multiple of the block: its start may fall mid-block, one block more.
    assert local_blocks(None, 10, 1, 4) == 4 and local_blocks(None, 8, 1, 4) == 2
    assert local_blocks(8, None, 1, 4) == 3 and local_blocks(None, None, 1, 4) is None
    kv = KVCacheManager(10, 4, True, windows=(None,) * 4, chunks=layout.chunks)
    assert Admission(kv).window_caps == [(4, 4, 3)] and Admission(kv).full_sizes == [(4, 1)]


# -- blocks given back ----------------------------------------------------------------------------


def test_blocks_given_back_at_the_step_whose_first_query_enters_a_new_chunk():
    """C = 8, blocks of 4, prefill steps of 6 tokens: after every step a chunked group holds exactly
    the blocks from its first query's chunk start on. The step computing 6..11 crosses the boundary at
    8 and still holds blocks 0, 1 (its query at 6 reads 0..6); the next one, from 12, gives them back
    (and holds 2..4)."""
    c, bs, step = 8, 4, 6
    engine, runner = make_engine(llama4_arch(c), 200, bs, max_num_batched_tokens=step)
    prompt = list(range(10, 40))  # 30 tokens
    engine.add_request("a", prompt, SamplingParams(max_tokens=20, ignore_eos=True))
    kv, held_after = engine.kv, []
    while engine.has_unfinished_requests():
        outs = engine.step()
        if "a" not in kv.req_blocks:
            break
        groups = kv.req_blocks["a"]
        first = sum(runner.chunks["a"][:-1])  # the step's first position (sync: one step at a time)
        end = first + runner.chunks["a"][-1]
        gone = first // c * c // bs
        assert all(b is not None for b in groups[0]) and len(groups[0]) == -(-end // bs)
        for row in groups[1:]:
            assert [b is None for b in row] == [True] * gone + [False] * (len(row) - gone), (first, row)
        held_after.append((first, sum(b is not None for b in groups[1])))
    assert outs[0].outputs[0].token_ids == reference_output(prompt, 20, VOCAB, None)
    assert runner.chunks["a"][:6] == [6] * 5 + [1]  # the prompt in steps of 6 (then decode)
    assert held_after[:4] == [(0, 2), (6, 3), (12, 3), (18, 2)]  # 6..11 crossed 8, kept blocks 0, 1
    assert max(h for _, h in held_after) <= local_blocks(None, c, step, bs)
    assert_no_leak(engine)


@pytest.mark.parametrize("async_mode", [False, True], ids=["sync", "one-step-ahead"])
def test_a_long_sequence_holds_at_most_its_chunk_and_a_step(async_mode):
    c, bs, step = 16, 4, 12
    engine, runner = make_engine(llama4_arch(c), 4096, bs, max_num_batched_tokens=step, async_mode=async_mode)
    prompt = list(range(10, 110))
    engine.add_request("a", prompt, SamplingParams(max_tokens=100, ignore_eos=True))
    kv, peak = engine.kv, 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        if "a" not in kv.req_blocks:
            break
        held = [sum(b is not None for b in row) for row in kv.req_blocks["a"]]
        assert held[0] == len(kv.req_blocks["a"][0]), "the full group keeps every block"
        peak = max(peak, *held[1:])
        assert all(h <= local_blocks(None, c, step, bs) for h in held[1:]), held
    assert outs and outs[0].outputs[0].token_ids == reference_output(prompt, 100, VOCAB, None)
    assert peak >= c // bs  # it held a whole chunk, and gave the older ones back
    assert_no_leak(engine)


@pytest.mark.parametrize("async_mode,num_blocks", [(False, 3000), (False, 120), (True, 3000), (True, 120)])
def test_same_outputs_and_no_leak_with_preemption_aborts_and_prefix_hits(num_blocks, async_mode):
    rng = random.Random(5)
    shared = [rng.randrange(10, VOCAB) for _ in range(37)]  # spans chunks of 8 and ends mid-block
    prompts = random_prompts(40, rng, lo=1, hi=70)
    prompts += [shared + p[:10] for p in prompts[:12]]
    max_tokens = [rng.randint(5, 40) for _ in prompts]
    engine, _ = make_engine(
        llama4_arch(8), num_blocks, 4, max_num_seqs=32, max_model_len=128, async_mode=async_mode
    )
    run_with_an_abort(engine, prompts, max_tokens, preempts=num_blocks < 3000)
    assert engine.kv.prefix_hits >= 11 * 36  # the shared 36 tokens (9 blocks), after the first
    assert_no_leak(engine)


def test_chunked_layers_hold_several_times_more_sequences_than_full_attention():
    """The same bytes: a full-only block spans all 4 layers, the chunked layout's block one layer; a
    sequence of 711 tokens holds 45 blocks of the global group + 3 x 2 (C = 32, blocks of 16) instead of
    45 blocks of 4 layers. Measured: 15 sequences at once against 4."""
    n_full = peak_running(replace(llama4_arch(32), layer_types=()), 200)
    n_chunked = peak_running(llama4_arch(32), 4 * 200)
    assert n_full >= 1 and n_chunked >= 3 * n_full, (n_chunked, n_full)
    assert len(LONG_PROMPTS[0]) == 511


# -- prefix hits ----------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk,scales", [(12, (1, 1)), (8, (1, 1)), (10, (1, 1)), (16, (2, 1))])
def test_prefix_hit_is_the_longest_every_chunked_group_serves(chunk, scales):
    """Against the definition, over random evictions of the chunked group's blocks: the longest hit
    h <= the most (a whole number of every group's blocks) whose chunked blocks from the one holding
    h's chunk start up to h are all cached; the hit's chunked row is None before that block."""
    bs, n_tokens = 4, 61  # hits of at most 15 base blocks
    rng = random.Random(chunk)
    unit = max(scales)
    for trial in range(12):
        kv = KVCacheManager(200, bs, True, windows=(None, None), scales=scales, chunks=(None, chunk))
        tokens = [rng.randrange(10, 200) for _ in range(n_tokens)]
        kv.free(_cached_request(kv, tokens, f"a{trial}"))
        probe = Request("b", tokens, SamplingParams(max_tokens=1), 0, frozenset(), n_tokens + 1, 0.0)
        assert kv.find_cached_prefix(probe) is not None
        hashes = kv._hashes["b"]
        evicted = set(rng.sample(range(15), rng.randint(1, 4)))
        for i in evicted:  # hand the chunked group's block i out, as a reuse would
            block = kv.pool.lookup(kv._key(hashes[i], 1))
            assert isinstance(block, Block)
            kv.pool.free_queue.move_to_end(block.id, last=False)
            kv.pool.allocate(1)
            kv.pool.free([block])

        # h serves if no evicted block lies between the one holding h's chunk start and h
        want = max(
            h for h in range(0, 16, unit) if not any(h * bs // chunk * chunk // bs <= i < h for i in evicted)
        )
        hit = kv.find_cached_prefix(probe)
        assert (hit.num_blocks if hit else 0) == want, (evicted, want)
        if hit is not None:
            first = want * bs // chunk * chunk // bs
            assert [b is None for b in hit.blocks[1]] == [True] * first + [False] * (want - first)
            assert len(hit.blocks[0]) == want // scales[0] and all(b is not None for b in hit.blocks[0])


def test_pool_too_small_for_one_sequence_counts_chunks():
    arch = llama4_arch(8)
    need = KVCacheLayout.from_arch(arch, 256).blocks_per_sequence(256, 32, 4)
    assert need == 64 + 3 * (-(-(7 + 32) // 4))  # chunk starts on block boundaries: no partial block
    make_engine(arch, need, 4)  # exactly one sequence fits
    with pytest.raises(ConfigError, match="less than one sequence of max_model_len 256 needs"):
        make_engine(arch, need - 1, 4)
