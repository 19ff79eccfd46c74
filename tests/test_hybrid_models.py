"""Tier (c): hybrid linear-attention models (Qwen3.5 dense and MoE, their ConditionalGeneration
checkpoints, Qwen3-Next) against HF transformers, fp32 greedy, token-exact: prompts of 1 to a few
hundred tokens, prefill chunks that end inside prompts (the state carried across chunks), mixed
batches, preemption (a restart from a zero state or a snapshot), and prefix-cache hits through state
snapshots at block boundaries (a long shared prefix, hit by a second wave), decode batches padded as
CUDA graphs run them (padding rows on the scratch slot); plus the state cache's
accounting: every runner row (and so state slot) given back after finished, aborted and preempted
requests."""

from __future__ import annotations

import random

import pytest
import torch

from overnight import LLM, SamplingParams
from tests.test_engine_parity import hf_greedy
from tests.tiny_hybrid import VARIANTS, make_hybrid_checkpoint

pytestmark = pytest.mark.slow  # real engines beside transformers

ENGINE = dict(skip_tokenizer_init=True, dtype="float32", device="cpu", block_size=4)
VOCAB = 101


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def load_hf(folder, variant: str):
    import transformers

    cls = (
        transformers.AutoModelForImageTextToText
        if variant.endswith("_vl")
        else transformers.AutoModelForCausalLM
    )
    return cls.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=VARIANTS)
def checkpoint(request, tmp_path_factory):
    folder = make_hybrid_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, folder, load_hf(folder, request.param)


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


def check(llm: LLM, ref, prompts: list[list[int]], new_tokens: int) -> None:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(new_tokens), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(ref, prompt, new_tokens)[0], (
            f"{len(prompt)} tokens"
        )


def assert_no_rows_held(llm: LLM, max_num_seqs: int) -> None:
    runner = llm.engine.runner  # type: ignore[attr-defined]
    # The runner hears of the last finished requests with the next step's schedule: run an empty one.
    llm.engine.step()  # type: ignore[attr-defined]
    assert runner.states.reqs == {}
    assert sorted(runner.states._free_slots) == list(range(max_num_seqs))  # no leak, no growth
    assert llm.engine.kv.pool.num_free == llm.engine.pool_plan.num_blocks  # type: ignore[attr-defined]


def test_token_exact_with_chunked_prefill(checkpoint):
    """Chunks of 24 tokens: the longer prompts are cut inside, mixed with other requests' decodes."""
    variant, folder, ref = checkpoint
    llm = LLM(str(folder), max_num_batched_tokens=24, max_num_seqs=6, max_model_len=512, **ENGINE)
    check(llm, ref, prompts_of([1, 2, 5, 23, 40, 77], seed=1), 10)
    assert_no_rows_held(llm, 6)


def test_token_exact_long_prompts_in_one_and_many_chunks(checkpoint):
    variant, folder, ref = checkpoint
    if variant not in ("qwen3_5", "qwen3_next"):
        pytest.skip("the long prompts run on one dense and one fused-projection family")
    prompts = prompts_of([129, 300], seed=2)
    for chunk in (512, 50):
        llm = LLM(str(folder), max_num_batched_tokens=chunk, max_model_len=512, **ENGINE)
        check(llm, ref, prompts, 6)


def run_engine(llm: LLM, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Every prompt added at once, then steps until done: the engine's own loop, deterministic."""
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, greedy(new_tokens))  # type: ignore[attr-defined]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():  # type: ignore[attr-defined]
        for out in engine.step():  # type: ignore[attr-defined]
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done[str(i)] for i in range(len(prompts))]


# (prefix caching, KV pool blocks): with snapshots a pool of 45 blocks makes resumed requests find
# their saved boundary still cached (the pool never holds all seven sequences either way)
@pytest.mark.parametrize(
    ("prefix_caching", "blocks"), [(False, 40), (True, 45)], ids=["from-zero", "from-snapshots"]
)
def test_preemption_restarts_from_a_zero_state_or_a_snapshot(checkpoint, prefix_caching, blocks):
    variant, folder, ref = checkpoint
    if variant not in ("qwen3_5", "qwen3_5_moe_vl"):
        pytest.skip("preemption runs on the dense and the MoE ConditionalGeneration checkpoints")
    prompts = prompts_of([5, 13, 40, 57, 9, 30, 21], seed=3)
    # 2 linear layers' float32 states x (max_num_seqs + 1 slots + 4 prefix-cache snapshots)
    state_bytes = 4 * 2 * (3 * 56 + 4 * 8 * 6) * (7 + 1 + (4 if prefix_caching else 0))
    block_bytes = 4 * 2 * 16 * 2 * 4  # 4 tokens x (K, V) x head 16 x 2 full layers x float32
    llm = LLM(
        str(folder),
        kv_cache_memory_bytes=state_bytes + blocks * block_bytes,
        max_num_batched_tokens=16,
        max_num_seqs=7,
        max_model_len=128,
        enable_prefix_caching=prefix_caching,
        admission="greedy",  # start whatever fits now, so that running requests outgrow the pool
        **ENGINE,
    )
    assert llm.engine.pool_plan.num_blocks == blocks  # type: ignore[attr-defined]
    for prompt, got in zip(prompts, run_engine(llm, prompts, 24)):
        assert got == hf_greedy(ref, prompt, 24)[0], f"{len(prompt)} tokens"
    stats = llm.engine.stats()  # type: ignore[attr-defined]
    assert stats.num_preemptions_total > 0
    # with snapshots, resumed requests start past their last saved boundary instead of at 0
    assert (stats.prefix_cache_hits > 0) == prefix_caching
    assert_no_rows_held(llm, 7)


def test_slots_follow_requests_through_aborts(checkpoint):
    variant, folder, ref = checkpoint
    if variant != "qwen3_next":
        pytest.skip("engine bookkeeping, one family is enough")
    llm = LLM(str(folder), max_num_batched_tokens=32, max_num_seqs=3, max_model_len=256, **ENGINE)
    engine = llm.engine
    runner = engine.runner  # type: ignore[attr-defined]
    seen: list[int] = []
    fill = runner.state_cache.fill

    def spy(scheduled, num_rows):
        seen.extend(s.state.slot for s in scheduled)
        fill(scheduled, num_rows)

    runner.state_cache.fill = spy
    prompts = prompts_of([30, 7, 50, 12, 3, 64, 20, 9], seed=4)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, greedy(6 + i))  # type: ignore[attr-defined]
    steps = 0
    while engine.has_unfinished_requests():  # type: ignore[attr-defined]
        engine.step()  # type: ignore[attr-defined]
        steps += 1
        if steps == 3:
            engine.abort_request("0")  # type: ignore[attr-defined]
            engine.abort_request("5")  # type: ignore[attr-defined]  # still waiting
    assert seen and max(seen) < 3
    assert_no_rows_held(llm, 3)
    # the engine still serves exact tokens after the aborts freed and reused slots
    check(llm, ref, prompts[1:4], 8)


def test_shared_prefix_hits_through_state_snapshots(checkpoint):
    """A long shared system prompt: the first wave computes it (a later request saves the state at the
    junction), the second wave starts past it, restored from the snapshot; tokens stay exact."""
    variant, folder, ref = checkpoint
    if variant not in ("qwen3_5", "qwen3_next"):
        pytest.skip("snapshots run on one dense and one MoE family")
    rng = random.Random(5)
    system = [rng.randrange(3, VOCAB) for _ in range(150)]
    first = [system + [rng.randrange(3, VOCAB) for _ in range(k)] for k in (9, 4, 17)]
    second = [system + [rng.randrange(3, VOCAB) for _ in range(k)] for k in (6, 1, 30)]
    llm = LLM(str(folder), max_num_batched_tokens=64, max_num_seqs=4, max_model_len=512, **ENGINE)
    check(llm, ref, first, 6)
    before = llm.engine.stats().prefix_cache_hits  # type: ignore[attr-defined]
    snapshots = llm.engine.scheduler.snapshots  # type: ignore[attr-defined]
    assert snapshots is not None and snapshots.num_cached >= 2
    check(llm, ref, second, 6)
    hits = llm.engine.stats().prefix_cache_hits - before  # type: ignore[attr-defined]
    assert hits >= 3 * 148  # every second-wave prompt starts past the system prompt's 37 full blocks
    # a prompt run alone, then again: the repeat hits its last boundary (<= prompt_len - 1), saved by
    # the first run (the most recent snapshot, so not evicted)
    alone = system + [rng.randrange(3, VOCAB) for _ in range(21)]
    check(llm, ref, [alone], 4)
    before = llm.engine.stats().prefix_cache_hits  # type: ignore[attr-defined]
    check(llm, ref, [alone], 4)
    assert llm.engine.stats().prefix_cache_hits - before == (len(alone) - 1) // 4 * 4  # type: ignore[attr-defined]
    assert_no_rows_held(llm, 4)


def test_padded_decode_batches_leave_real_states_alone(checkpoint):
    variant, folder, ref = checkpoint
    if variant != "qwen3_5_moe":
        pytest.skip("one family is enough for the padding rows")
    check_padded_decodes(folder, ref)


def check_padded_decodes(folder, ref) -> None:
    """The CUDA-graph path on the CPU: decode steps run as DecodeGraphs would replay them (batch padded
    to a bucket, padding rows on the scratch slot, metadata from the static buffers), eagerly."""
    from overnight.runner.cuda_graph import DecodeGraphs

    llm = LLM(str(folder), max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256, **ENGINE)
    runner = llm.engine.runner  # type: ignore[attr-defined]
    graphs = DecodeGraphs(runner.model, runner.attention_batch, runner.kv_caches, runner.buffers, 8, 256)
    assert graphs.sizes == [1, 2, 4, 8]
    replayed: list[int] = []

    def replay(b: int):
        replayed.append(b)
        return graphs._forward(b)

    graphs.replay = replay  # type: ignore[method-assign]
    runner.graphs = graphs
    prompts = prompts_of([3, 11, 6, 20, 1], seed=6)  # five decodes run in a bucket of 8, then fewer
    check(llm, ref, prompts, 9)
    assert 8 in replayed and any(b in replayed for b in (1, 2, 4))
