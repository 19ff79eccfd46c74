"""Tier (a): planned admission (engine/admission.py) against greedy admission, on the scheduler alone and
through the engine with the fake runner.

The main shape is seed-512-256 on Mistral-Small-24B on an H200 scaled down by 8: 128 requests of 512
prompt tokens and 256 output tokens (ignore_eos) submitted at once, a pool of 63,500 tokens (the GPU's
~508k / 8), max_num_seqs 128 and 2,048 tokens a step (the H200's offline 1,024 and 16,384, / 8). Greedy
admission preempts 30-odd requests there (284 at full size, on the GPU and in bench/preemption_sim.py).
"""

from __future__ import annotations

import random

from overnight.config import DENSE_STEP_TOKENS, DENSE_TAIL_SHARE, SchedulerConfig
from overnight.engine.kv_cache_manager import KVCacheManager
from overnight.engine.request import Request
from overnight.engine.scheduler import Scheduler
from overnight.engine.step_io import ModelRunnerOutput
from overnight.sampling_params import SamplingParams
from tests.engine_helpers import EOS, VOCAB, make_engine, run_all
from tests.fake_runner import reference_output

BLOCK = 16
SPARSE_STEP_TOKENS = 1643.0  # engine/admission.py step_tokens for Qwen3-30B-A3B


def drive(
    admission: str,
    *,
    num_requests: int = 128,
    prompt_len: int = 512,
    max_tokens: int = 256,
    pool_tokens: int = 63_500,
    max_num_seqs: int = 128,
    budget: int = 2048,
    answer_mean: int | None = None,
    windows: tuple[int | None, ...] = (None,),
    scales: tuple[int, ...] | None = None,
    tail_share: float = DENSE_TAIL_SHARE,
    step_tokens: float = DENSE_STEP_TOKENS,
) -> dict[str, float | list[int]]:
    """Run the workload on a Scheduler with a stand-in for the runner (a constant token; with
    answer_mean, EOS after uniform(1, 2 * answer_mean) tokens and ignore_eos off)."""
    rng = random.Random(0)
    config = SchedulerConfig(
        max_num_seqs, budget, prompt_len + max_tokens, True, admission, tail_share, step_tokens
    )
    num_blocks = pool_tokens // BLOCK * len(windows)  # pool_tokens: per sequence-equivalent
    kv = KVCacheManager(num_blocks, BLOCK, enable_caching=True, windows=windows, scales=scales)
    sched = Scheduler(config, kv)
    ends: dict[str, int] = {}
    for i in range(num_requests):
        prompt = [rng.randrange(10, VOCAB) for _ in range(prompt_len)]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=answer_mean is None, detokenize=False)
        sched.add(Request(str(i), prompt, params, 0, frozenset({EOS}), prompt_len + max_tokens, 0.0))
        if answer_mean is not None:
            ends[str(i)] = rng.randint(1, 2 * answer_mean)
    per_step: list[int] = []
    running = 0
    while sched.has_unfinished:
        out = sched.schedule()
        assert out.total_num_scheduled_tokens > 0, "no progress"
        per_step.append(out.total_num_scheduled_tokens)
        running += len(sched.running)
        ids = [r.req_id for r in sched.running if r.num_pending]
        reqs = [sched.requests[r] for r in ids]
        toks = [EOS if ends.get(r.req_id, 1 << 30) <= r.num_output_tokens + 1 else 7 for r in reqs]
        sched.update(out, ModelRunnerOutput(req_ids=ids, sampled_token_ids=toks))
    assert sched.kv.pool.num_free == sched.kv.num_blocks
    return {
        "preemptions": sched.num_preemptions_total,
        "tokens": sum(per_step),
        "mean_running": running / len(per_step),
        "per_step": per_step,
    }


def test_outputs_to_max_tokens_need_no_recompute_and_keep_the_batch_full():
    greedy, planned = drive("greedy"), drive("planned")
    assert greedy["preemptions"] >= 20  # today's rule: ~a quarter of the requests recomputed
    assert planned["preemptions"] == 0
    assert planned["tokens"] == 128 * (512 + 256 - 1)  # every token computed once (the last is sampled)
    assert greedy["tokens"] > planned["tokens"] * 1.1
    assert planned["mean_running"] >= 0.97 * greedy["mean_running"]  # the batch stays as full
    assert len(planned["per_step"]) <= len(greedy["per_step"])


def test_the_last_few_requests_do_not_make_a_wave_of_their_own():
    """Qwen3-8B's pool on an H100 at max_num_batched_tokens 32,768 (390,240 tokens) / 8: 48,780 tokens
    hold 63 of the 768-token requests, so held to the plan 128 requests ran as 63 + 63 + 2, the last 2
    alone for 256 steps (on the GPU: 776 steps where 535 ran on a 3% larger pool, -4.4%). As the job's
    tail (at most 1/16 of the running set) they start past the plan, within 1/16 of the pool: two waves,
    and at most the tail is recomputed, near the end of a wave."""
    full = 128 * (512 + 256 - 1)
    tail = drive("planned", pool_tokens=48_780)
    steps = len(tail["per_step"])
    assert steps < 2 * 256 + 40, steps  # two waves of decodes and the prefill steps (three: 768+)
    assert tail["preemptions"] <= 2 and tail["tokens"] <= full + 2 * 768
    # A queue that is no tail is still held to the plan: 46 + 46 + 36 requests, never preempted.
    waves = drive("planned", pool_tokens=36_000)
    assert waves["preemptions"] == 0 and waves["tokens"] == full


def test_a_sparse_models_larger_tail_share_saves_a_wave():
    """Qwen3-30B-A3B's long-1024-1024 on an H100 scaled down: a pool of 27 of the 64 requests at their
    end. A dense model's plan runs them as 27 + 27 + 10 (three waves, the last 10 alone for a whole
    output length); a mixture of experts, whose tail share is 1/2 (tail_share), fills a larger pool and
    runs two waves, for at most the 10 requests past the pool recomputed."""
    kw = dict(num_requests=64, prompt_len=256, max_tokens=256, pool_tokens=27 * 512 + 200, max_num_seqs=64)
    dense = drive("planned", **kw)
    sparse = drive("planned", tail_share=0.5, step_tokens=SPARSE_STEP_TOKENS, **kw)
    assert dense["preemptions"] == 0 and len(dense["per_step"]) > 3 * 256
    assert sparse["preemptions"] <= 10 and sparse["tokens"] <= dense["tokens"] + 10 * 512
    # 531 steps against 769; 658 where the plan filled only the smallest pool that saves a wave (the
    # requests it preempted then ran as a short wave of their own)
    steps = len(sparse["per_step"]), len(dense["per_step"])
    assert steps[0] < 0.75 * steps[1], steps


def test_a_sparse_model_does_not_overcommit_where_the_pool_fills_early():
    """Qwen3-30B-A3B in int4 on an H100, seed-512-256 at full size (the recompute grows with the
    requests, the steps saved do not): the job is 1.31 pools, so the tail share's larger pool would run
    it in one wave; but that pool fills after ~74 of the 256 output tokens, and a quarter of the
    requests would be recomputed for ~47 steps saved (on the GPU: 238 preemptions, docs/performance.md's
    session Z). The cost check keeps the plan: two waves, nothing recomputed; without it (a step worth
    any recompute) the same plan preempts as the GPU did."""
    kw = dict(num_requests=1024, pool_tokens=599_648, max_num_seqs=1024, budget=16384)
    full = 1024 * (512 + 256 - 1)
    costed = drive("planned", tail_share=0.5, step_tokens=SPARSE_STEP_TOKENS, **kw)
    assert costed["preemptions"] == 0 and costed["tokens"] == full
    blind = drive("planned", tail_share=0.5, step_tokens=1e12, **kw)
    assert 200 < blind["preemptions"] < 280 and blind["tokens"] > full + 200 * 512


def test_the_step_is_worth_more_tokens_the_more_weights_it_reads_per_weight_a_token_uses():
    from overnight.engine.admission import step_tokens
    from overnight.loader.resolve import resolve_source

    assert step_tokens(resolve_source("qwen3-8b", "dummy").arch) == DENSE_STEP_TOKENS
    assert (
        10 * DENSE_STEP_TOKENS
        < step_tokens(resolve_source("qwen3-30b-a3b", "dummy").arch)
        < 12 * DENSE_STEP_TOKENS
    )


def test_the_tail_share_grows_with_the_weights_a_step_reads_per_weight_a_token_uses():
    from overnight.engine.admission import MAX_TAIL_SHARE, tail_share
    from overnight.loader.resolve import resolve_source

    assert tail_share(resolve_source("qwen3-8b", "dummy").arch) == DENSE_TAIL_SHARE
    assert tail_share(resolve_source("qwen3-30b-a3b", "dummy").arch) == MAX_TAIL_SHARE  # ~11x
    assert DENSE_TAIL_SHARE < tail_share(resolve_source("granite-4.0-h-small", "dummy").arch) < 0.25  # ~3.8x


def test_windowed_groups_are_planned_too():
    """Gemma 3 27B's layout scaled down: one full-attention group and six windowed ones, a pool of a
    sixth of the work. A window longer than the context holds every token (as on seed-512-256); a
    shorter one gives blocks back, which the plan counts at most a window's worth a request. With ~10
    sequences in the pool, rounding each request up a block per group costs the long window ~14% of
    the running requests (9.1 against 10.6; 7% at full size, bench/preemption_sim.py), for no
    recompute (greedy computes 14% more tokens)."""
    kw = dict(num_requests=64, prompt_len=128, max_tokens=64, pool_tokens=2048, max_num_seqs=64, budget=512)
    for window in (256, 48):
        greedy = drive("greedy", windows=(None,) + (window,) * 6, **kw)
        planned = drive("planned", windows=(None,) + (window,) * 6, **kw)
        assert greedy["preemptions"] >= 5, window
        # At most what a pool 1/16 larger holds (admission.py: waves), where it saves a wave (256:
        # 413 steps against 449 held to the pool, 4 requests recomputed)
        assert planned["preemptions"] <= 4 and planned["tokens"] <= 1.02 * 64 * (128 + 64 - 1), window
        assert planned["mean_running"] >= 0.8 * greedy["mean_running"], window


def test_groups_of_a_larger_block_size_are_planned_in_it():
    """Gemma 4's layout scaled down: the full group's blocks hold 2 x 16 tokens (block scale 2), five
    windowed groups' 16. The plan counts each group in its own block size: no recompute, and 1.25x the
    running requests of the same pool with the full blocks half padding (one block size)."""
    kw = dict(num_requests=64, prompt_len=256, max_tokens=256, pool_tokens=2048, max_num_seqs=64, budget=512)
    windows = (None,) + (48,) * 5
    scaled = {a: drive(a, windows=windows, scales=(2,) + (1,) * 5, **kw) for a in ("greedy", "planned")}
    padded = drive("planned", windows=windows, **kw)
    assert scaled["greedy"]["preemptions"] > 0
    # At most the job's tail (admission.py: the last request, started past the plan) is recomputed.
    assert scaled["planned"]["preemptions"] <= 1
    assert scaled["planned"]["tokens"] <= 64 * (256 + 256 - 1) + 512
    assert padded["preemptions"] == 0
    # 15.9 against 12.7 (a sequence of 512 tokens: 16 + 5 x 4 blocks against 32 + 5 x 4, 1.44x at
    # the end; less on the way there)
    assert scaled["planned"]["mean_running"] >= 1.2 * padded["mean_running"], (scaled, padded)


def test_a_pool_larger_than_the_work_schedules_as_before():
    greedy, planned = drive("greedy", pool_tokens=125_000), drive("planned", pool_tokens=125_000)
    assert greedy["preemptions"] == 0
    assert planned["per_step"] == greedy["per_step"]


def test_short_answers_under_a_large_max_tokens_are_not_starved():
    """A batch job with max_tokens 2048 whose answers end after ~64 tokens: nothing is reserved for the
    unused max_tokens, so the scheduling is the greedy one, step for step."""
    kw = dict(max_tokens=2048, answer_mean=64)
    greedy, planned = drive("greedy", **kw), drive("planned", **kw)
    assert planned["per_step"] == greedy["per_step"]
    assert planned["preemptions"] == greedy["preemptions"] == 0


def test_long_answers_that_may_stop_preempt_less_once_a_preemption_was_seen():
    """Answers that may stop but run long (~40% of max_tokens): the first preemption raises the share
    of max_tokens planned for them, so later admissions leave room and fewer requests are recomputed."""
    kw = dict(max_tokens=1024, answer_mean=400, num_requests=256, max_num_seqs=256)
    greedy, planned = drive("greedy", **kw), drive("planned", **kw)
    assert greedy["preemptions"] > 0
    assert planned["preemptions"] < 0.7 * greedy["preemptions"]
    assert planned["tokens"] < greedy["tokens"]


def test_requests_longer_than_the_room_left_wait_for_it():
    """Requests whose ends need 30 of the 40 blocks: the next starts only once the one before is near
    enough its end that both fit to their ends (about 18 steps before), never three at once, never
    preempted."""
    engine, runner = make_engine(
        num_blocks=40, block_size=4, max_num_seqs=8, max_model_len=160, async_mode=True
    )
    rng = random.Random(3)
    prompts = [[rng.randrange(10, VOCAB) for _ in range(20)] for _ in range(4)]
    for i, p in enumerate(prompts):  # 20 + 100 tokens each: 30 of the 40 blocks
        engine.add_request(str(i), p, SamplingParams(max_tokens=100, ignore_eos=True))
    results = run_all(engine)
    for i, p in enumerate(prompts):
        assert results[str(i)] == reference_output(p, 100, VOCAB, None)
    assert engine.scheduler.num_preemptions_total == 0
    assert max(reqs for _, reqs in runner.step_log) == 2
    overlap = sum(reqs == 2 for _, reqs in runner.step_log)
    assert 3 <= overlap <= 3 * 25  # three handovers
    assert engine.kv.pool.num_free == 40


def test_engine_outputs_are_unchanged_and_nothing_is_preempted_one_step_ahead():
    """Through the engine with the fake runner, which checks every block table against the tokens: a
    tight pool, mixed lengths, one step run ahead. Held to the pool (tail share 0: no wave may be saved
    by overcommitting it) the plan preempts nothing; with a dense model's share it may preempt a request
    it started past the pool, and the outputs are the same."""
    rng = random.Random(4)
    prompts = [[rng.randrange(10, VOCAB) for _ in range(rng.randint(4, 40))] for _ in range(48)]
    max_tokens = [rng.randint(8, 40) for _ in prompts]
    outs = {}
    for name, admission, share in (
        ("greedy", "greedy", 0.0),
        ("exact", "planned", 0.0),
        ("planned", "planned", 1 / 16),
    ):
        engine, runner = make_engine(
            num_blocks=60,
            block_size=4,
            max_num_seqs=32,
            max_model_len=96,
            async_mode=True,
            admission=admission,
            tail_share=share,
        )
        for i, (p, m) in enumerate(zip(prompts, max_tokens)):
            engine.add_request(str(i), p, SamplingParams(max_tokens=m, ignore_eos=True))
        outs[name] = run_all(engine)
        assert engine.kv.pool.num_free == 60 and engine.kv.req_blocks == {}
        preemptions = engine.scheduler.num_preemptions_total
        assert (
            preemptions > 0 if name == "greedy" else preemptions == 0 if name == "exact" else preemptions <= 2
        )
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        expected = reference_output(p, m, VOCAB, None)
        assert outs["planned"][str(i)] == outs["exact"][str(i)] == outs["greedy"][str(i)] == expected


def test_deferrals_are_counted_and_served_as_a_counter():
    """Each step in which the plan holds a waiting request back counts once, in the scheduler's stats
    and on /metrics (overnight check reads it: the pool is the limit even at low usage)."""
    from overnight.metrics.prometheus import PrometheusObserver

    engine, _ = make_engine(
        num_blocks=24, block_size=16, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=384
    )
    for i in range(4):  # each ends at 15 blocks: one and a half fit
        engine.add_request(f"r{i}", list(range(120)), SamplingParams(max_tokens=121, ignore_eos=True))
    metrics = PrometheusObserver("m")
    engine.observers.append(metrics)
    engine.step()
    first = engine.stats().kv_admission_deferrals_total
    assert first == 1 and engine.stats().num_running == 1
    for _ in range(5):
        engine.step()
    stats = engine.stats()
    assert stats.kv_admission_deferrals_total == 6 and stats.num_preemptions_total == 0
    page = metrics.render().decode()
    assert 'overnight:kv_admission_deferrals_total{model_name="m"} 6.0' in page
