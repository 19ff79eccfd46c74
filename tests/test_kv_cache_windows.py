"""Tier (a): sliding-window KV cache groups with the fake runner (engine/kv_groups.py,
engine/kv_cache_manager.py). The fake runner checks every step that each group's table still maps the
positions its layers read (the whole context, or the last W before each query) to the request's tokens,
so a block given back too early, a bad prefix hit or a lost preemption fails there."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from overnight.arch import ModelArch
from overnight.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from overnight.engine import kv_groups
from overnight.engine.block_pool import Block
from overnight.engine.engine import Engine
from overnight.engine.kv_cache_manager import KVCacheManager
from overnight.engine.kv_groups import MAX_PAD_SHARE, KVCacheLayout, group_size, pool_tokens
from overnight.engine.pool_plan import PoolPlan
from overnight.engine.request import Request
from overnight.errors import ConfigError
from overnight.loader.source import ModelSource
from overnight.sampling_params import SamplingParams
from tests.fake_runner import FakeRunner, reference_output
from tests.test_scheduler import VOCAB, random_prompts, run_all

EOS = 3
SW, FULL = "sliding_attention", "full_attention"
GEMMA3_SHAPE = (SW,) * 5 + (FULL,)


def arch_of(
    layer_types: tuple[str, ...] = GEMMA3_SHAPE, window: int | None = 8, shared: int = 0
) -> ModelArch:
    base = ModelArch("llama", VOCAB, 8, 16, len(layer_types), 1, 1, 8)
    return replace(base, layer_types=layer_types, sliding_window=window, num_kv_shared_layers=shared)


GEMMA4_SHAPE = (SW,) * 5 + (FULL, SW, FULL)  # the last two KV-shared


def gemma4_arch(window: int | None = 8) -> ModelArch:
    """Gemma-4-31B's proportions, scaled down: windowed layers 2 KV heads x 8, full layers 1 x 8 wide
    heads of 8 (K = V), the last two layers reading earlier layers' caches."""
    arch = arch_of(GEMMA4_SHAPE, window, shared=2)
    return replace(arch, num_key_value_heads=2, global_head_dim=8, num_global_key_value_heads=1)


def make_engine(
    arch: ModelArch,
    num_blocks: int,
    block_size: int = 4,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 32,
    max_model_len: int = 256,
    caching: bool = True,
    async_mode: bool = False,
) -> tuple[Engine, FakeRunner]:
    config = EngineConfig(
        model=ModelConfig(model="fake", arch=arch, dtype=torch.float32),
        cache=CacheConfig(block_size=block_size, enable_prefix_caching=caching),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
        ),
    )
    layout = KVCacheLayout.from_arch(arch, max_model_len)
    runner = FakeRunner(
        num_blocks,
        block_size,
        VOCAB,
        async_mode=async_mode,
        windows=layout.windows,
        group_block_sizes=layout.group_block_sizes(block_size),
        chunks=layout.chunks,
    )
    source = ModelSource("dummy", "fake", arch, "LlamaForCausalLM", None, (EOS,), None, None, "fake")
    plan = PoolPlan(num_blocks, block_bytes=0, budget_bytes=0, capped=False)
    return Engine(config, runner, source, plan), runner


def run_with_an_abort(
    engine: Engine, prompts: list[list[int]], max_tokens: list[int], preempts: bool
) -> None:
    """The prompts (max_model_len 128) to the end beside one long request aborted after three steps:
    each output is the fake runner's reference, and requests were preempted exactly when `preempts`."""
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(str(i), p, SamplingParams(max_tokens=m))
    engine.add_request("gone", prompts[0] * 2, SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    engine.abort_request("gone")
    results = run_all(engine)
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        assert results[str(i)] == reference_output(p, min(m, 128 - len(p)), VOCAB, EOS), i
    assert (engine.scheduler.num_preemptions_total > 0) == preempts


def assert_no_leak(engine: Engine) -> None:
    pool = engine.kv.pool
    assert engine.kv.req_blocks == {}
    assert pool.num_free == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)


# -- the layout -----------------------------------------------------------------------------------


def test_layout_groups_layers_by_kind_and_shares_tensors():
    one = KVCacheLayout.from_arch(arch_of())  # 5 windowed : 1 full -> six one-layer groups
    assert one.num_tensors == 1 and one.windows == (None, 8, 8, 8, 8, 8)
    assert one.layer_group == (1, 2, 3, 4, 5, 0) and one.layer_tensor == (0,) * 6
    # 52 windowed + 10 full (Gemma-3-27B's counts): groups of 5, not 10 (group_size: 3 of 65 slots
    # empty, not 8 of 70), the full ones exactly filled.
    kinds = tuple(FULL if i % 6 == 5 else SW for i in range(60)) + (SW, SW)
    big = KVCacheLayout.from_arch(arch_of(kinds, window=1024))
    assert big.num_tensors == 5 and big.windows == (None,) * 2 + (1024,) * 11
    assert [len(g.layers) for g in big.groups] == [5] * 12 + [2]
    assert big.groups[0].layers == (5, 11, 17, 23, 29) and big.groups[-1].layers == (60, 61)
    assert sorted(layer for g in big.groups for layer in g.layers) == list(range(62))
    # Only full layers (or a window no shorter than max_model_len): one group, today's layout.
    four_full = arch_of((FULL,) * 4)
    assert KVCacheLayout.from_arch(four_full) == KVCacheLayout.uniform(four_full)
    long_window = arch_of(window=256)
    assert KVCacheLayout.from_arch(long_window, max_model_len=256) == KVCacheLayout.uniform(long_window)
    # KV-shared layers own no cache: they read their source's tensor through its group.
    shared = KVCacheLayout.from_arch(arch_of((SW, FULL, SW, FULL, SW, FULL), shared=2))
    assert shared.layer_source == (0, 1, 2, 3, 2, 3)
    assert shared.windows == (None, 8) and shared.num_tensors == 2
    assert shared.layer_group[4] == shared.layer_group[2] and shared.layer_tensor[5] == shared.layer_tensor[3]


def test_smaller_groups_hold_more_sequences_in_the_same_bytes(monkeypatch):
    """Gemma-3-27B's counts at 768 tokens (within the window, every group holds every token): groups of
    5 hold 70 / 65 the sequences groups of 10 (the smallest kind's count, vLLM's choice) would."""
    kinds = tuple(FULL if i % 6 == 5 else SW for i in range(60)) + (SW, SW)
    arch = arch_of(kinds, window=1024)
    layouts = [KVCacheLayout.from_arch(arch)]
    monkeypatch.setattr(kv_groups, "MAX_PAD_SHARE", 1.0)  # any padding: groups of 10
    layouts.append(KVCacheLayout.from_arch(arch))
    assert [(x.num_tensors, x.num_groups) for x in layouts] == [(5, 13), (10, 7)]
    pool = 10_000 * 48 * 7 * 16 * (2 * 10 * 8)  # elements: 10,000 sequences in groups of 10
    fits = [pool // (x.blocks_per_sequence(768, 1, 16) * 16 * x.token_elems) for x in layouts]
    assert fits == [10_769, 10_000]  # 10,000 x 70 / 65, rounded down


def test_group_size_keeps_padding_small_and_the_smallest_kind_exact():
    """G is the largest divisor of the smallest kind's count that leaves at most 10% of the slots
    empty while every group holds every token."""
    assert group_size([10, 52]) == 5  # Gemma-3-27B: 10 would leave 8 of 70 empty (11.4%), 5 leaves 3 of 65
    assert group_size([4, 22]) == 4  # Gemma-3-1B: 2 of 28 (7.1%) is within the share
    assert group_size([5, 29]) == 5  # Gemma-3-4B: 1 of 35 (2.9%)
    assert group_size([3, 7, 11]) == 1  # groups of 3 would leave 3 of 24 (12.5%)
    assert group_size([6, 25]) == 3  # 6: 5 of 36 (13.9%); 3: 2 of 33 (6.1%)
    assert group_size([8, 40]) == 8 and group_size([10, 50]) == 10  # Gemma-3-12B, Gemma-4-31B: exact
    assert group_size([12, 36]) == 12 and group_size([18, 18]) == 18  # Llama-4-Scout, gpt-oss-120b
    assert group_size([1, 5]) == 1 and group_size([7]) == 7
    for counts in ([10, 52], [4, 22], [3, 7, 11], [6, 25]):
        g = group_size(counts)
        slots = sum(-(-c // g) * g for c in counts)
        assert min(counts) % g == 0 and slots - sum(counts) <= MAX_PAD_SHARE * slots


def test_pool_tokens_count_a_token_once_in_every_group():
    """A token takes 1 / its group's block size of a block in each group: 100 blocks over groups of
    16, 16 and 32 tokens a block hold 100 / (5 / 32) = 640 tokens; one group holds num_blocks x B."""
    assert pool_tokens(100, (16, 16, 32)) == 640
    assert pool_tokens(100, (16,)) == 1600
    # Gemma-3-27B's 13 groups of one block size: the pool's tokens are a thirteenth of one group's.
    assert pool_tokens(13 * 1000, (16,) * 13) == 16000


def test_layers_of_different_cache_shapes_form_groups_of_their_own():
    """Gemma 4's full layers have their own head size and KV heads: groups by window as for Gemma 3,
    every tensor's slot the largest of its layers', each layer a view of its own shape (kv_groups.py)."""
    arch = replace(arch_of(), global_head_dim=16, num_global_key_value_heads=2)
    layout = KVCacheLayout.from_arch(arch)
    assert layout.windows == (None, 8, 8, 8, 8, 8) and layout.num_tensors == 1
    assert layout.layer_shapes == ((1, 8),) * 5 + ((2, 16),)
    assert layout.tensor_elems == (32,) and layout.token_elems == 2 * 32
    # A windowed layer needs 8 of a slot's 32 elements per token: its groups' blocks hold 4 x B tokens
    # (block scale 4), and no block is padding; without the scale, 24 of 32 would be.
    assert layout.block_scales == (1, 4, 4, 4, 4, 4) and layout.group_block_sizes(4) == (4,) + (16,) * 5
    assert layout.unused_share(0) == 0.0 and layout.unused_share(1) == 0.0
    assert replace(layout, block_scales=(1,) * 6).unused_share(1) == 0.75
    with pytest.raises(ValueError, match="does not fit"):
        replace(layout, block_scales=(2,) * 6)  # the full layers fill their slot: no room for 2 x B
    # Windows no shorter than max_model_len: one group, a tensor per layer of its own shape, no padding.
    long = KVCacheLayout.from_arch(arch, max_model_len=8)
    assert long.windows == (None,) and long.num_tensors == 6
    assert long.tensor_elems == (8,) * 5 + (32,) and long.unused_share(0) == 0.0
    assert long.block_scales == (1,)
    # 50 windowed (2 x 8) + 10 full (1 x 16, Gemma-4-31B's proportions), KV-shared last layers: groups
    # of 10 layers, slots of 16 elements that both kinds fill.
    kinds = tuple(FULL if i % 6 == 5 else SW for i in range(60)) + (SW, FULL)
    big = replace(arch_of(kinds, window=1024, shared=2), num_key_value_heads=2, global_head_dim=16)
    big = replace(big, num_global_key_value_heads=1)
    layout = KVCacheLayout.from_arch(big)
    assert layout.num_tensors == 10 and layout.windows == (None,) + (1024,) * 5
    assert layout.tensor_elems == (16,) * 10 and layout.unused_share(0) == 0.0
    assert layout.block_scales == (1,) * 6  # both kinds fill the slots: one block size
    assert layout.layer_source[60:] == (58, 59) and layout.layer_shapes[60:] == ((2, 8), (1, 16))
    with pytest.raises(ValueError, match="does not fit"):
        replace(layout, tensor_elems=(8,) * 10)


def test_blocks_per_sequence_counts_only_the_window_and_the_chunk():
    layout = KVCacheLayout.from_arch(arch_of(window=16))
    # Full group: 1024 / 4 blocks; each windowed group: cdiv(15 + 32, 4) + 1 = 13.
    assert layout.blocks_per_sequence(1024, chunk=32, block_size=4) == 256 + 5 * 13
    assert layout.blocks_per_sequence(8, chunk=32, block_size=4) == 6 * 2  # shorter than the window


# -- blocks given back ----------------------------------------------------------------------------


@pytest.mark.parametrize("async_mode", [False, True], ids=["sync", "one-step-ahead"])
def test_windowed_groups_give_blocks_back_as_the_window_advances(async_mode):
    w, bs, chunk = 8, 4, 16
    engine, runner = make_engine(
        arch_of(window=w), 4096, bs, max_num_batched_tokens=chunk, async_mode=async_mode
    )
    prompt = list(range(10, 110))
    engine.add_request("a", prompt, SamplingParams(max_tokens=60, ignore_eos=True))
    kv, peak = engine.kv, 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        req = engine.scheduler.requests.get("a")
        if req is None:
            break
        groups = kv.req_blocks["a"]
        held = [sum(b is not None for b in row) for row in groups]
        assert held[0] == len(groups[0]), "the full group keeps every block"
        peak = max(peak, *held[1:])
        # What a windowed group may hold: the window before the step's first query, plus the step.
        assert all(h <= -(-(w - 1 + chunk) // bs) + 1 for h in held[1:]), held
    assert outs and outs[0].outputs[0].token_ids == reference_output(prompt, 60, VOCAB, None)
    assert peak >= 2  # it did hold blocks, and gave the old ones back
    assert runner.chunks["a"][:7] == [16] * 6 + [4]  # the prompt crossed the window in chunks
    assert_no_leak(engine)


@pytest.mark.parametrize(
    "async_mode,num_blocks,shape",
    [
        (False, 3000, "gemma3"),
        (False, 150, "gemma3"),
        (True, 3000, "gemma3"),
        (True, 150, "gemma3"),
        (False, 150, "gemma4"),
        (True, 150, "gemma4"),
        (True, 60, "wide-full"),
    ],
)
def test_same_outputs_and_no_leak_with_preemption_and_aborts(num_blocks, async_mode, shape):
    """gemma4: the full group's blocks hold 2 x 4 tokens (block scale 2); wide-full: the windowed
    groups' hold 4 x 4 (full layers 2 x 16 wide, windowed 1 x 8), so they give back 16 tokens at once."""
    rng = random.Random(3)
    prompts = random_prompts(48, rng, lo=1, hi=70)
    max_tokens = [rng.randint(5, 40) for _ in prompts]
    arch = {
        "gemma3": arch_of(window=6),
        "gemma4": gemma4_arch(window=6),
        "wide-full": replace(arch_of(GEMMA4_SHAPE, 6, 2), global_head_dim=16, num_global_key_value_heads=2),
    }[shape]
    scales = {"gemma3": (1,) * 6, "gemma4": (2,) + (1,) * 5, "wide-full": (1,) + (4,) * 5}[shape]
    assert KVCacheLayout.from_arch(arch, 128).block_scales == scales
    engine, _ = make_engine(arch, num_blocks, 4, max_num_seqs=32, max_model_len=128, async_mode=async_mode)
    run_with_an_abort(engine, prompts, max_tokens, preempts=num_blocks < 3000)
    assert_no_leak(engine)


# 48 prompts of 511 tokens, each to run 200 more
LONG_PROMPTS = [[10 + i] + [20 + j % 400 for j in range(510)] for i in range(48)]


def peak_running(arch: ModelArch, num_blocks: int) -> int:
    """The most of LONG_PROMPTS running at once in a pool of num_blocks blocks of 16 tokens (each
    checked against the reference, no block leaked)."""
    engine, _ = make_engine(
        arch, num_blocks, 16, max_num_seqs=64, max_num_batched_tokens=512, max_model_len=1024, caching=False
    )
    for i, p in enumerate(LONG_PROMPTS):
        engine.add_request(str(i), p, SamplingParams(max_tokens=200, ignore_eos=True))
    peak = 0

    def check(e: Engine) -> None:
        nonlocal peak
        peak = max(peak, len(e.scheduler.running))

    results = run_all(engine, check)
    for i, p in enumerate(LONG_PROMPTS):
        assert results[str(i)] == reference_output(p, 200, VOCAB, None)
    assert_no_leak(engine)
    return peak


def test_a_window_holds_several_times_more_sequences_than_full_attention():
    """The same bytes: a full-only block spans all 6 layers, a windowed layout's block one layer."""
    full_engine_blocks = 400  # 400 blocks x 6 layers
    n_full = peak_running(arch_of((FULL,) * 6), full_engine_blocks)
    n_win = peak_running(arch_of(window=32), 6 * full_engine_blocks)
    assert n_full >= 1 and n_win >= 3 * n_full, (n_win, n_full)


def test_gemma4_shape_holds_several_times_the_sequences_of_one_tensor_per_layer(monkeypatch):
    """The same pool bytes for Gemma 4's shapes at 511 + 200 tokens with a window of 32: the groups'
    layout (windowed blocks given back, the full group's blocks of 2 x 16 tokens: block scale 2)
    against the same groups with one block size (the full group's blocks half padding, the layout
    before block scales) and against one tensor per layer in one group (nothing given back)."""
    arch = gemma4_arch(window=32)
    grouped, per_layer = KVCacheLayout.from_arch(arch, 1024), KVCacheLayout.uniform(arch)
    assert grouped.num_groups == 6 and grouped.block_scales == (2,) + (1,) * 5 and per_layer.num_groups == 1
    padded = replace(grouped, block_scales=(1,) * 6)
    assert grouped.unused_share(0) == 0.0 and padded.unused_share(0) == 0.5
    pool_elems = 300 * 16 * per_layer.token_elems  # 300 blocks of one tensor per layer

    def peak_with(layout: KVCacheLayout) -> int:
        monkeypatch.setattr(KVCacheLayout, "from_arch", classmethod(lambda cls, a, m=None: layout))
        return peak_running(arch, pool_elems // (16 * layout.token_elems))

    n_grouped, n_padded, n_per_layer = peak_with(grouped), peak_with(padded), peak_with(per_layer)
    assert n_per_layer >= 1 and n_padded >= 3 * n_per_layer, (n_padded, n_per_layer)
    # A sequence holds 23 full blocks + 5 x 3 windowed instead of 45 + 5 x 3 (60 / 38 = 1.58x); measured:
    # 44 sequences at once against 27 padded (1.63x), 6 with one tensor per layer.
    assert n_grouped >= 1.5 * n_padded, (n_grouped, n_padded)


# -- prefix hits with windows ---------------------------------------------------------------------


@pytest.mark.parametrize("async_mode", [False, True], ids=["sync", "one-step-ahead"])
def test_prefix_hits_with_windows_and_same_outputs(async_mode):
    rng = random.Random(4)
    prefix = [rng.randrange(10, VOCAB) for _ in range(120)]  # longer than the window
    prompts = [prefix + [rng.randrange(10, VOCAB) for _ in range(rng.randint(1, 20))] for _ in range(16)]

    def run(caching: bool) -> tuple[dict[str, list[int]], Engine]:
        engine, _ = make_engine(
            arch_of(window=10), 3000, 4, max_num_batched_tokens=64, caching=caching, async_mode=async_mode
        )
        engine.add_request("warm", prompts[0], SamplingParams(max_tokens=4))
        run_all(engine)  # computes the prefix; its windowed blocks are given back but keep their hashes
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(max_tokens=8))
        out = run_all(engine)
        assert_no_leak(engine)
        return out, engine

    cached, eng = run(True)
    plain, _ = run(False)
    assert cached == plain
    assert eng.kv.prefix_hits >= 16 * 116  # the prefix's 29 full blocks, every time


def _cached_request(kv: KVCacheManager, tokens: list[int], rid: str) -> Request:
    req = Request(rid, tokens, SamplingParams(max_tokens=1), 0, frozenset(), len(tokens) + 1, 0.0)
    assert kv.allocate(req, len(tokens)) is not None
    req.num_computed_tokens = len(tokens)
    kv.cache_computed_blocks(req)
    return req


def test_prefix_hit_is_the_longest_length_every_group_serves():
    bs, w = 4, 9  # a windowed group needs cdiv(8, 4) = 2 blocks before the hit point
    kv = KVCacheManager(200, bs, True, windows=(None, w))
    tokens = list(range(100, 141))  # 41 tokens: hits of at most 10 blocks
    first = _cached_request(kv, tokens, "a")
    kv.free(first)
    probe = Request("b", tokens, SamplingParams(max_tokens=1), 0, frozenset(), 42, 0.0)
    hit = kv.find_cached_prefix(probe)
    assert hit is not None and hit.num_blocks == 10
    assert [b is None for b in hit.blocks[1]] == [True] * 8 + [False] * 2  # only the window's blocks
    assert all(b is not None for b in hit.blocks[0])

    def evict(group: int, index: int) -> None:
        """Hand one cached block out, as a reuse by another request would."""
        hashes = kv._hashes["b"]
        block = kv.pool.lookup(kv._key(hashes[index], group))
        assert isinstance(block, Block)
        kv.pool.free_queue.move_to_end(block.id, last=False)
        kv.pool.allocate(1)
        kv.pool.free([block])

    evict(1, 8)  # the window before block 10 is broken: the longest run of 2 ends at block 8
    hit = kv.find_cached_prefix(probe)
    assert hit is not None and hit.num_blocks == 8
    evict(0, 5)  # full attention stops at block 5; the window group has blocks 3, 4 there
    hit = kv.find_cached_prefix(probe)
    assert hit is not None and hit.num_blocks == 5
    evict(1, 3)  # the windowed group's last run of 2 at or before 5 is blocks 1, 2
    hit = kv.find_cached_prefix(probe)
    assert (
        hit is not None and hit.num_blocks == 3 and [b is None for b in hit.blocks[1]] == [True, False, False]
    )
    evict(1, 1)  # a run reaching back to block 0 is a hit even shorter than the window: block 0
    hit = kv.find_cached_prefix(probe)
    assert hit is not None and hit.num_blocks == 1 and hit.blocks[1][0] is not None


def test_prefix_hits_are_whole_blocks_of_every_block_size():
    """A full group of block scale 2 (blocks of 8 tokens) beside a windowed group of blocks of 4: its
    block i is registered under base block 2i + 1's hash, and a hit is an even number of base blocks,
    so both groups' hit blocks are whole; tables have one entry per block of their own size."""
    bs, w = 4, 9
    kv = KVCacheManager(200, bs, True, windows=(None, w), scales=(2, 1))
    assert kv.group_block_sizes == (8, 4) and kv.hit_unit == 2
    tokens = list(range(100, 141))  # 41 tokens: 10 full base blocks, 5 blocks of the full group
    first = _cached_request(kv, tokens, "a")
    assert [len(row) for row in kv.req_blocks["a"]] == [6, 11]
    kv.free(first)
    probe = Request("b", tokens, SamplingParams(max_tokens=1), 0, frozenset(), 42, 0.0)
    hit = kv.find_cached_prefix(probe)
    assert hit is not None and hit.num_blocks == 10
    assert len(hit.blocks[0]) == 5 and all(b is not None for b in hit.blocks[0])
    assert [b is None for b in hit.blocks[1]] == [True] * 8 + [False] * 2
    hashes = kv._hashes["b"]
    assert hit.blocks[0][4] is kv.pool.lookup(kv._key(hashes[9], 0))

    def evict(group: int, index: int) -> None:
        block = hit.blocks[group][index]
        assert isinstance(block, Block)
        kv.pool.free_queue.move_to_end(block.id, last=False)
        kv.pool.allocate(1)
        kv.pool.free([block])

    evict(1, 8)  # the window's run of 2 now ends at base block 8: even, so a hit of 8
    again = kv.find_cached_prefix(probe)
    assert again is not None and again.num_blocks == 8 and len(again.blocks[0]) == 4
    evict(0, 2)  # the full group serves its blocks 0, 1 (base blocks 0..3); the window needs 2, 3
    again = kv.find_cached_prefix(probe)
    assert again is not None and again.num_blocks == 4
    assert kv.allocate(probe, 41 - 16, again) == [
        [b.id for b in again.blocks[0]] + kv.block_ids(probe, 0)[2:],
        [0, 0] + [b.id for b in again.blocks[1] if b is not None] + kv.block_ids(probe, 1)[4:],
    ]
    assert [len(row) for row in kv.req_blocks["b"]] == [6, 11]
    probe.num_computed_tokens = 41
    kv.cache_computed_blocks(probe)
    kv.free(probe)
    assert kv.pool.num_free == 200


def test_blocks_given_back_without_a_prefix_are_reused_first():
    kv = KVCacheManager(10, 4, True, windows=(None,))
    cached = _cached_request(kv, list(range(100, 116)), "a")  # 4 hashed blocks
    kv.free(cached)
    plain = Request("p", [1, 2], SamplingParams(max_tokens=1), 0, frozenset(), 3, 0.0)
    kv.allocate(plain, 2)
    kv.free(plain)  # unhashed: to the head of the free queue
    other = Request("o", [5] * 3, SamplingParams(max_tokens=1), 0, frozenset(), 4, 0.0)
    kv.allocate(other, 3)
    assert kv.pool.num_evictions == 0 and len(kv.pool.cached) == 4


# -- the memory check -----------------------------------------------------------------------------


def test_pool_too_small_for_one_sequence_counts_windows():
    arch = arch_of(window=8)
    need = KVCacheLayout.from_arch(arch, 256).blocks_per_sequence(256, 32, 4)
    assert need == 64 + 5 * (-(-(7 + 32) // 4) + 1)
    make_engine(arch, need, 4)  # exactly one sequence fits
    with pytest.raises(ConfigError, match="less than one sequence of max_model_len 256 needs"):
        make_engine(arch, need - 1, 4)


# -- the runner's caches --------------------------------------------------------------------------


class _RecordingBackend:
    def __init__(self) -> None:
        self.calls: list[tuple[torch.Tensor, object, bool]] = []

    def forward(self, q, k, v, kv_cache, meta, scale, kv_scale=None, *, layer=None, sinks=None):
        self.calls.append((kv_cache, meta, k is None))
        return q


def _bare_runner(arch: ModelArch):
    """A ModelRunner of `arch` around no model (torch.nn.Identity): its KV layout and caches only,
    blocks of 4 tokens in float32."""
    from overnight.runner.model_runner import ModelRunner

    config = EngineConfig(
        model=ModelConfig(model="fake", arch=arch, dtype=torch.float32),
        cache=CacheConfig(block_size=4),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64),
    )
    source = ModelSource("dummy", "fake", arch, "LlamaForCausalLM", None, (EOS,), None, None, "fake")
    return ModelRunner(config, source, model=torch.nn.Identity())


def test_runner_aliases_shared_tensors_and_routes_each_layer_to_its_group():
    """KV-shared layers (Gemma 4) own no cache: their entry is their source's tensor, and they read
    through their source's group; layers of different groups share a tensor."""
    arch = arch_of((SW, FULL, SW, FULL, SW, FULL), window=8, shared=2)
    runner = _bare_runner(arch)
    layout = runner.kv_layout
    assert layout.windows == (None, 8) and layout.num_tensors == 2
    runner.init_kv_cache(10)
    caches = runner.kv_caches
    assert len({id(c) for c in caches}) == 2  # two tensors, each one layer of each group
    assert caches[4] is caches[2] and caches[5] is caches[3]
    assert caches[0] is caches[1] and caches[2] is caches[3]  # layers 0 and 1: tensor 0 of two groups
    # One block holds one layer per tensor: 4 tokens x 2 tensors x K/V x 1 head x 8 x fp32.
    assert runner.kv_bytes_per_block() == 4 * 2 * 2 * 8 * 4
    backend = _RecordingBackend()
    runner.backend = backend
    metas = [object(), object()]
    batch = runner.attention_batch(metas[0], metas, caches)  # type: ignore[arg-type]
    q = torch.zeros(1, 1, 8)
    for layer in range(6):
        shared = layer >= 4
        batch(layer, q, None if shared else q, None if shared else q, 1.0)
    assert [c[1] is metas[layout.layer_group[i]] for i, c in enumerate(backend.calls)] == [True] * 6
    assert [layout.layer_group[i] for i in range(6)] == [1, 0, 1, 0, 1, 0]
    assert backend.calls[4][0] is caches[2] and backend.calls[4][2]  # read-only, the source's cache


def test_runner_views_one_tensor_in_each_layers_shape():
    """Gemma 4's shapes: windowed layers 1 head x 8, full ones 2 x 16, sharing tensors of 32-element
    slots; the windowed groups' pages hold 4 x 4 tokens (block scale 4), so a block of one view covers
    exactly the same block of the other, all of it, never another block."""
    arch = replace(arch_of(GEMMA4_SHAPE, shared=2), global_head_dim=16, num_global_key_value_heads=2)
    runner = _bare_runner(arch)
    assert runner.kv_layout.tensor_elems == (32,) and runner.kv_layout.num_groups == 6
    assert runner.kv_bytes_per_block() == 4 * 2 * 32 * 4  # 4 tokens x K/V x one 32-element slot x fp32
    runner.init_kv_cache(10)
    caches = runner.kv_caches
    wide, narrow = caches[5], caches[0]
    assert wide.shape == (2, 10, 4, 2, 16) and narrow.shape == (2, 10, 16, 1, 8)
    assert wide.data_ptr() == narrow.data_ptr() and wide.stride(1) == narrow.stride(1) == 4 * 32
    assert caches[6] is caches[4] and caches[7] is wide  # KV-shared layers: their source's view
    assert all(c is narrow for c in caches[:5])
    wide.zero_()
    narrow[:, 3] = 1.0
    assert wide[:, 3].eq(1).all() and wide[:, [2, 4]].eq(0).all()  # the whole block, nothing else


def test_reference_decodes_of_several_lengths_read_only_their_windows():
    """Batched decodes in the torch reference skip blocks before every window; those given back hold
    NaN here, and each row still equals a dense computation."""
    from overnight.attention.spec import LayerAttention
    from overnight.attention.torch_backend import TorchAttentionBackend, build_metadata
    from tests.test_attention_window_ref import _dense

    torch.manual_seed(0)
    hq, hkv, d, bs, w = 4, 2, 8, 4, 6
    lens = [15, 19, 30]  # blocks 0 and 1 are before every window: not read
    cache = torch.full((2, 24, bs, hkv, d), float("nan"))
    backend, layer = TorchAttentionBackend(), LayerAttention(w)
    tables, next_block, contexts = [], 0, []
    for n in lens:
        k, v = torch.randn(n, hkv, d), torch.randn(n, hkv, d)
        table = list(range(next_block, next_block + -(-n // bs)))
        next_block += len(table)
        meta = build_metadata([n - 1], [n - 1], [table], bs)  # the context, written by a prefill
        backend.forward(torch.zeros(n - 1, hq, d), k[:-1], v[:-1], cache, meta, 0.5, layer=layer)
        for b in range((n - w) // bs):  # blocks wholly before the window: given back
            cache[:, table[b]] = float("nan")
        tables.append(table)
        contexts.append((k, v))
    q = torch.randn(len(lens), hq, d)
    k_new = torch.stack([k[-1] for k, _ in contexts])
    v_new = torch.stack([v[-1] for _, v in contexts])
    meta = build_metadata([1] * 3, lens, tables, bs, num_decodes=3)
    got = backend.forward(q, k_new, v_new, cache, meta, 0.5, layer=layer)
    for i, (n, (k, v)) in enumerate(zip(lens, contexts)):
        want = _dense(q[i : i + 1], k, v, [n - 1], 0.5, w, None, None)
        torch.testing.assert_close(got[i : i + 1], want, rtol=1e-5, atol=1e-5)


def test_decodes_giving_blocks_back_do_not_push_a_shared_prompt_out():
    """A batch job: many requests share a long prompt prefix and decode a lot in a nearly full pool.
    The blocks their windows give back every few tokens hold generated text and are reused first, so
    the prefix's windowed blocks (freed early, needed by every later hit) stay cached (vLLM #48435)."""
    rng = random.Random(5)
    prefix = [rng.randrange(10, VOCAB) for _ in range(64)]
    engine, _ = make_engine(arch_of(window=8), 700, 4, max_num_seqs=8, max_num_batched_tokens=128)
    for i in range(32):  # 8 at a time, of different lengths: each later one arrives amid the churn
        params = SamplingParams(max_tokens=rng.randint(60, 180), ignore_eos=True)
        engine.add_request(str(i), prefix + [rng.randrange(10, VOCAB) for _ in range(5)], params)
    run_all(engine)
    assert engine.scheduler.num_preemptions_total == 0
    assert engine.kv.pool.num_evictions > 0  # the pool did recycle blocks
    # Every request but the first two (admitted in the same step as the first) starts past the prefix.
    assert engine.kv.prefix_hits >= 30 * 64, engine.kv.prefix_hits
    assert_no_leak(engine)


def test_step_buffers_pack_each_groups_tables_and_slots_where_decode_graphs_read_them():
    """A decode batch padded to a graph's bucket b: group g's slot mapping sits at slots[g*b:(g+1)*b]
    (the captured graphs read it there), padding rows write nothing, tables[g] holds group g's ids."""
    from overnight.engine.step_io import NewRequestData
    from overnight.engine.step_io import SchedulerOutput as Out
    from overnight.runner.inputs import StepBuffers
    from overnight.runner.request_state import RequestStates

    states = RequestStates(4, 4, num_groups=2)
    tables = {"a": [[3, 4], [9, 0]], "b": [[5], [7]], "c": [[6, 8], [1, 2]]}
    lens = {"a": 6, "b": 3, "c": 8}
    new = [
        NewRequestData(rid, list(range(10, 10 + lens[rid])), lens[rid], SamplingParams(), 0, t, lens[rid] - 1)
        for rid, t in tables.items()
    ]
    scheduled = states.apply(Out(new, [], {rid: 1 for rid in tables}, 3))
    states.begin(scheduled)
    buffers = StepBuffers(16, 4, 4, 4, torch.device("cpu"), num_groups=2)
    inputs = buffers.build(scheduled, states, {}, pad_to=4)
    slots = [m.slot_mapping.tolist() for m in inputs.group_metas]
    # position lens-1 of each request, in block (lens-1)//4 of the group's table, then one padding row
    assert slots[0] == [4 * 4 + 1, 5 * 4 + 2, 8 * 4 + 3, -1]
    assert slots[1] == [0 * 4 + 1, 7 * 4 + 2, 2 * 4 + 3, -1]
    assert slots[1] == buffers.slots[4:8].tolist()
    assert inputs.group_metas[1].block_tables[:3, :2].tolist() == [[9, 0], [7, 0], [1, 2]]
    assert inputs.meta is inputs.group_metas[0] and inputs.meta.block_tables[2, :2].tolist() == [6, 8]


def test_step_buffers_map_each_group_in_its_own_block_size():
    """Group 1's blocks hold 8 tokens (block scale 2), group 0's 4: a mixed step's slots count each
    group's table in its own block size, and the runner's tables grow per group."""
    from overnight.engine.step_io import NewRequestData
    from overnight.engine.step_io import SchedulerOutput as Out
    from overnight.runner.inputs import StepBuffers
    from overnight.runner.request_state import RequestStates

    states = RequestStates(4, 4, num_groups=2)
    tables = {"a": [[3, 4], [9]], "b": [[5], [7]], "c": [[6, 8], [1]]}
    lens, computed = {"a": 6, "b": 3, "c": 8}, {"a": 5, "b": 2, "c": 0}
    new = [
        NewRequestData(rid, list(range(10, 10 + lens[rid])), lens[rid], SamplingParams(), 0, t, computed[rid])
        for rid, t in tables.items()
    ]
    scheduled = states.apply(Out(new, [], {rid: lens[rid] - computed[rid] for rid in tables}, 10))
    states.begin(scheduled)
    assert states.table_lens[:, [s.state.slot for s in scheduled]].tolist() == [[2, 1, 2], [1, 1, 1]]
    buffers = StepBuffers(16, 4, 4, 4, torch.device("cpu"), num_groups=2, group_block_sizes=(4, 8))
    inputs = buffers.build(scheduled, states, {})
    slots = [m.slot_mapping.tolist() for m in inputs.group_metas]
    # a: position 5, b: position 2, then c's prefill of positions 0..7
    assert slots[0] == [4 * 4 + 1, 5 * 4 + 2] + [6 * 4 + p for p in range(4)] + [8 * 4 + p for p in range(4)]
    assert slots[1] == [9 * 8 + 5, 7 * 8 + 2] + [1 * 8 + p for p in range(8)]
