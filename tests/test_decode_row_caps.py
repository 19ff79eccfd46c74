"""Decode row caps: a decode step just past a whole GEMM row tile computes the tile's rows and the last
admitted requests wait a step (engine/scheduler.py _decode_rows, kernels/w4a16_gemm.py decode_row_caps,
build.py decode_row_caps). Engine logic over the fake runner, the caps' derivation from the tiers, and
where the build turns them on."""

from __future__ import annotations

import random

import pytest
import torch

from overnight.arch import ModelArch
from overnight.kernels import w4a16_gemm
from overnight.kernels.w4a16_gemm import W4A16Config, decode_row_caps
from overnight.loader.source import ModelSource
from overnight.options import EngineOptions
from overnight.quant.int_scheme import IntScheme
from overnight.sampling_params import SamplingParams
from tests.engine_helpers import VOCAB, make_engine, run_all
from tests.fake_runner import reference_output


def _run(caps, async_mode, n=14, seed=0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, VOCAB) for _ in range(rng.randint(3, 12))] for _ in range(n)]
    max_tokens = [rng.randint(6, 20) for _ in prompts]
    engine, runner = make_engine(
        max_num_seqs=5, max_num_batched_tokens=64, async_mode=async_mode, decode_row_caps=caps
    )
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(str(i), p, SamplingParams(max_tokens=m, ignore_eos=True))
    seen = []  # (running, waiting) as each step was scheduled

    def check(e):
        seen.append((len(e.scheduler.running), len(e.scheduler.waiting)))

    results = run_all(engine, check)
    return prompts, max_tokens, results, runner.step_log, engine


@pytest.mark.parametrize("async_mode", [False, True], ids=["sync", "one-step-ahead"])
def test_capped_steps_compute_the_cap_and_outputs_stay_the_same(async_mode):
    prompts, max_tokens, results, log, engine = _run(((4, 5),), async_mode)
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        assert results[str(i)] == reference_output(p, m, VOCAB, None), i
    decode_steps = [reqs for tokens, reqs in log if tokens == reqs]
    # five running decodes while requests wait: four of them computed (never five in a decode-only step
    # before the queue empties; the tail, with nothing waiting, runs all five)
    assert 4 in decode_steps
    first_tail = max(i for i, (tokens, reqs) in enumerate(log) if tokens > reqs)  # the last prefill
    assert all(reqs != 5 for tokens, reqs in log[:first_tail] if tokens == reqs)
    assert engine.kv.pool.num_free == engine.kv.num_blocks and engine.kv.req_blocks == {}

    _, _, plain, plain_log, _ = _run((), async_mode)
    assert plain == results
    assert any(reqs == 5 for tokens, reqs in plain_log if tokens == reqs)  # what the cap changed


def test_no_cap_while_nothing_waits_or_outside_its_reach():
    # nothing waits (five requests, five seats): the steps of a run without caps
    _, _, _, log, _ = _run(((4, 5),), False, n=5)
    assert log == _run((), False, n=5)[3]


def test_which_caps_apply_to_five_running_decodes():
    from dataclasses import replace

    engine, _ = make_engine(max_num_seqs=5, max_num_batched_tokens=64)
    for i in range(7):
        engine.add_request(str(i), [11 + i, 12, 13], SamplingParams(max_tokens=10, ignore_eos=True))
    engine.step()  # five prompts in; two wait
    sched = engine.scheduler
    assert len(sched.running) == 5 and len(sched.waiting) == 2
    assert all(r.num_remaining == 1 for r in sched.running)

    def rows(caps):
        sched.config = replace(sched.config, decode_row_caps=caps)
        return sched._decode_rows()

    assert rows(()) == 5
    assert rows(((4, 5),)) == 4
    assert rows(((2, 3), (4, 6))) == 4
    assert rows(((3, 4),)) == 5  # past its reach
    assert rows(((5, 8),)) == 5  # not past the cap
    sched.running[0].num_computed_tokens -= 2  # one request has a chunk of prompt left: not decode-only
    assert rows(((4, 5),)) == 5
    sched.running[0].num_computed_tokens += 2
    waiting, sched.waiting = sched.waiting, type(sched.waiting)()
    assert rows(((4, 5),)) == 5  # nothing waits
    sched.waiting = waiting


def test_the_module_caps_follow_its_tiers_and_measured_speedups():
    # From session Y's speed-ups: cap * speedup(cap) / speedup(bound), within the tier
    assert decode_row_caps() == ((64, 94), (128, 150), (192, 225), (256, 291))
    for cap, upto in decode_row_caps():
        cfg_cap = w4a16_gemm.default_config(cap, mma_order=True)
        cfg = w4a16_gemm.default_config(upto, mma_order=True)
        assert cfg.path == "fused" and cap % cfg_cap.block_m == 0  # the cap is whole tiles
        # every D past the cap, within reach, takes as many row tiles as the tier's bound
        tiles = {-(-d // cfg.block_m) for d in range(cap + 1, upto + 1)}
        assert len(tiles) == 1


def test_caps_need_a_flat_tier_and_both_speedups():
    tiers = (
        (64, W4A16Config(64, 64)),
        (256, W4A16Config(64, 64)),  # 65-256 rows: 2-4 tiles of 64, the time grows: no cap
        (384, W4A16Config(128, 128)),  # 257-384: three tiles of 128 whatever the rows
        (512, W4A16Config(128, 128)),  # flat too, but 512 is not measured
    )
    speedups = {64: 1.0, 256: 0.6, 384: 0.5}
    assert decode_row_caps(tiers, speedups) == ((256, 307),)
    # a larger tier as fast per row as the cap's: nothing to gain
    assert decode_row_caps(tiers, {64: 1.0, 256: 0.5, 384: 0.5}) == ()


def _source(quantization, arch=None):
    arch = arch or ModelArch("qwen3", 1000, 64, 128, 2, 4, 2, 16)
    return ModelSource("dummy", "x", arch, "Qwen3ForCausalLM", None, (0,), None, None, "x", quantization)


def test_the_build_turns_caps_on_for_packed_int4_on_a_gpu_only():
    from overnight.build import decode_row_caps as build_caps

    awq = IntScheme("awq", 4, 128, False)
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    opts = EngineOptions()
    assert build_caps(opts, _source(awq), gpu) == decode_row_caps()
    assert build_caps(EngineOptions(decode_row_caps="off"), _source(awq), gpu) == ()
    assert build_caps(opts, _source(awq), cpu) == ()
    assert build_caps(opts, _source(None), gpu) == ()
    assert build_caps(opts, _source(IntScheme("awq", 4, 128, False, dense=True)), gpu) == ()
    assert build_caps(opts, _source(IntScheme("gptq", 8, 128, True)), gpu) == ()
    assert build_caps(opts, _source(IntScheme("gptq", 4, 64, True)), gpu) == ()  # not in MMA order
    moe = ModelArch(
        "qwen3_moe",
        1000,
        64,
        128,
        2,
        4,
        2,
        16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    )
    assert build_caps(opts, _source(awq, moe), gpu) == ()


def test_capped_steps_are_counted_on_metrics_and_by_check():
    from overnight.bench.metrics_reader import WindowMetrics
    from overnight.metrics.prometheus import PrometheusObserver
    from overnight.tools.check import describe

    engine, runner = make_engine(max_num_seqs=5, max_num_batched_tokens=64, decode_row_caps=((4, 5),))
    metrics = PrometheusObserver("m")
    engine.observers.append(metrics)
    for i in range(9):
        engine.add_request(str(i), [11 + i, 12, 13], SamplingParams(max_tokens=12, ignore_eos=True))
    run_all(engine)
    capped = engine.stats().decode_row_capped_total
    # each capped step computed four of the five running decodes (a step of four decodes may also
    # be one with four running)
    assert 0 < capped <= sum(1 for tokens, reqs in runner.step_log if tokens == reqs == 4)
    assert capped + 1 >= sum(1 for tokens, reqs in runner.step_log if tokens == reqs == 4)
    assert f'overnight:decode_row_caps_total{{model_name="m"}} {float(capped)}' in metrics.render().decode()

    window = WindowMetrics(10.0, 5, 5.0, 2.0, 0.9, 1.0, 1.0, 0.0, None, 5, row_capped=7.0)
    assert "7 decode steps at a row cap" in describe(window)
    assert "row cap" not in describe(WindowMetrics(10.0, 5, 5.0, 2.0, 0.9, 1.0, 1.0, 0.0, None, 5))


def test_a_real_model_decodes_the_same_under_caps(monkeypatch, batch_model):
    """The CPU runner with a cap forced (the build sets none on the CPU): requests left out of a step
    resume where they were, and greedy outputs are those of a run without caps."""
    import overnight.build as build
    from overnight import LLM

    prompts = [f"w{10 + i} w20 w{30 + 2 * i}" for i in range(10)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    def run(caps):
        monkeypatch.setattr(build, "decode_row_caps", lambda *args: caps)
        llm = LLM(batch_model, max_model_len=96, dtype="float32", device="cpu", max_num_seqs=4)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.config.scheduler.decode_row_caps == caps
        return [o.outputs[0].token_ids for o in outs], llm.engine.stats().decode_row_capped_total

    capped, steps = run(((3, 4),))
    plain, none = run(())
    assert steps > 0 and none == 0
    assert capped == plain


def test_the_build_plans_without_triton(monkeypatch):
    """`overnight budget` plans a GPU's limits on any machine: without triton there are no caps, and no
    error."""
    import sys

    from overnight.build import decode_row_caps as build_caps

    monkeypatch.setitem(sys.modules, "overnight.kernels.w4a16_gemm", None)  # import fails
    monkeypatch.delattr("overnight.kernels.w4a16_gemm", raising=False)
    assert build_caps(EngineOptions(), _source(IntScheme("awq", 4, 128, False)), torch.device("cuda")) == ()
