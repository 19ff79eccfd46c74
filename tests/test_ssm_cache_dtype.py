"""mamba_ssm_cache_dtype: the storage dtype of hybrid models' delta-rule states (vLLM's option and values).

Tier (a), in seconds: the option's values (bad ones refused by name, on LLM() and the command line),
the state pool's plan and `overnight budget` counting the chosen bytes (a default max_num_seqs about
doubles with a 16-bit state), the runner allocating exactly that, and a model without linear layers
ignoring the option with a log line (as vLLM ignores it there).
Tier (c): tiny Qwen3.5 and Qwen3-Next engines, fp32 weights: a float32 state stays token-exact with
transformers; a bfloat16 state (the only rounding in the run) generates close to the float32 run,
through chunked prefill, prefix-cache snapshots, preemption and (slow: processes) tensor parallelism.
The kernels' side is in test_kernels_gated_delta.py."""

from __future__ import annotations

import argparse
import logging
import random

import pytest
import torch

from overnight import LLM, SamplingParams
from overnight.build import build_config
from overnight.config import CacheConfig, SchedulerConfig, ssm_state_dtype
from overnight.engine.pool_plan import plan_states
from overnight.errors import ConfigError
from overnight.loader.resolve import resolve_source
from overnight.options import EngineOptions, add_engine_args, options_from_args
from overnight.tools.budget import GIB, DeviceMemory, plan_budget, render
from tests.kernel_helpers import agreement
from tests.test_engine_parity import hf_greedy
from tests.tiny_hybrid import make_hybrid_checkpoint

H100_GIB = 79.1  # what torch reports for an H100 80 GB
VOCAB = 101


def test_bad_values_are_refused_by_name():
    with pytest.raises(
        ConfigError, match="mamba_ssm_cache_dtype must be one of auto, float32, float16, bfloat16"
    ):
        EngineOptions(mamba_ssm_cache_dtype="fp8")
    with pytest.raises(ConfigError, match="mamba_ssm_cache_dtype must be a string"):
        EngineOptions(mamba_ssm_cache_dtype=16)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mamba_ssm_cache_dtype must be one of"):
        ssm_state_dtype("bf16")
    # a torch dtype is taken as its name, as for dtype
    assert EngineOptions(mamba_ssm_cache_dtype=torch.bfloat16).mamba_ssm_cache_dtype == "bfloat16"  # type: ignore[arg-type]
    assert [ssm_state_dtype(n) for n in ("auto", "float32", "float16", "bfloat16")] == [
        torch.float32,
        torch.float32,
        torch.float16,
        torch.bfloat16,
    ]


def test_the_command_line_flag():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--mamba-ssm-cache-dtype", "bfloat16"])
    assert options_from_args(args, "batch").mamba_ssm_cache_dtype == "bfloat16"
    assert options_from_args(parser.parse_args([]), "batch").mamba_ssm_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--mamba-ssm-cache-dtype", "fp8"])


def test_the_plan_counts_the_chosen_bytes():
    arch = resolve_source("qwen3.5-9b", "dummy").arch  # 24 linear layers, 32 x 128 x 128 states
    sched = SchedulerConfig(max_num_seqs=384)
    conv, ssm = 3 * 8192, 32 * 128 * 128
    for name, elem in [("auto", 4), ("float32", 4), ("bfloat16", 2), ("float16", 2)]:
        plan = plan_states(arch, sched, CacheConfig(mamba_ssm_cache_dtype=name))
        assert plan.ssm_dtype == ssm_state_dtype(name)
        assert plan.bytes_per_seq == 24 * (4 * conv + elem * ssm)  # the conv state stays float32
        assert plan.total_bytes == plan.bytes_per_seq * (385 + 96)


def test_a_default_max_num_seqs_doubles_with_a_bf16_state(caplog):
    """Qwen3.5-9B in batch mode on an H100: float32 states let 400 requests run (half the memory for
    caches), bfloat16 ones 784 (1.96x: the conv states, 4% of the bytes, stay float32)."""
    source = resolve_source("qwen3.5-9b", "dummy")
    seqs = {}
    for name in ("auto", "bfloat16"):
        opts = EngineOptions(
            model="qwen3.5-9b", load_format="dummy", mode="batch", mamba_ssm_cache_dtype=name
        )
        with caplog.at_level(logging.INFO, logger="overnight"):
            config = build_config(opts, source, torch.device("cuda"), H100_GIB)
        assert config.cache.mamba_ssm_cache_dtype == name
        seqs[name] = config.scheduler.max_num_seqs
        # `overnight budget` plans the same count and says what the states are stored in
        b = plan_budget(opts, source, DeviceMemory("NVIDIA H100", int(H100_GIB * GIB), int(78.6 * GIB)))
        assert b.max_num_seqs == seqs[name]
        assert b.state_pool_bytes == plan_states(source.arch, config.scheduler, config.cache).total_bytes
        stored = "float32" if name == "auto" else name
        assert b.state_dtype == stored and f"delta-rule states in {stored}" in render(
            b, "qwen3.5-9b", source.arch, "bfloat16"
        )
    assert seqs == {"auto": 400, "bfloat16": 784}
    assert "max_num_seqs 1024 -> 784" in caplog.text and "bfloat16 delta-rule states" in caplog.text
    assert "--mamba-ssm-cache-dtype bfloat16 to halve the states" in caplog.text  # said for float32 only


def test_a_model_without_linear_layers_ignores_it_with_a_log_line(caplog):
    source = resolve_source("qwen3-0.6b", "dummy")
    opts = EngineOptions(model="qwen3-0.6b", load_format="dummy", mamba_ssm_cache_dtype="bfloat16")
    with caplog.at_level(logging.INFO, logger="overnight"):
        config = build_config(opts, source, torch.device("cpu"), None)
    assert "mamba_ssm_cache_dtype bfloat16 ignored" in caplog.text and "qwen3" in caplog.text
    assert plan_states(source.arch, config.scheduler, config.cache).total_bytes == 0


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {v: make_hybrid_checkpoint(tmp_path_factory.mktemp(v), v) for v in ("qwen3_5", "qwen3_next")}


def engine(folder, ssm: str, **kw) -> LLM:
    limits = dict(
        max_num_seqs=8,
        max_num_batched_tokens=32,  # the longer prompts run in chunks, beside other requests' decodes
        max_model_len=256,
    )
    return LLM(
        str(folder),
        skip_tokenizer_init=True,
        dtype="float32",
        device="cpu",
        block_size=4,
        mamba_ssm_cache_dtype=ssm,
        **{**limits, **kw},
    )


def test_the_runner_allocates_the_chosen_dtype(checkpoints):
    llm = engine(checkpoints["qwen3_5"], "bfloat16")
    cache = llm.engine.runner.state_cache  # type: ignore[attr-defined]
    assert {t.dtype for t in cache.ssm + cache.ssm_snapshots} == {torch.bfloat16}
    assert {t.dtype for t in cache.conv + cache.conv_snapshots} == {torch.float32}
    cfg = llm.engine.config  # type: ignore[attr-defined]
    assert cache.nbytes == plan_states(cfg.model.arch, cfg.scheduler, cfg.cache).total_bytes


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


def run(llm: LLM, prompts: list[list[int]], new_tokens: int) -> list[tuple[list[int], list[dict]]]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]


# A bfloat16 state rounds every linear layer's state once a step (relative error up to 2^-9). On these
# tiny random models, over 16 prompts of 16 tokens, that moved the chosen tokens' logprobs by 0.005
# (Qwen3.5) and 0.009 (Qwen3-Next) nats on average, with 100% and 94% of positions before each prompt's
# first divergence. Divergences are held to the house rule (each side's token in the other's top 5),
# not to a bound on the reference's top-2 gap: Qwen3-Next's router (top 2 of 5 experts) flips at a
# near-tie of its scores (a 0.0013 margin, once here), which moves that token's logits by 1.4 nats at
# once, where a float16 state (8x finer) flips nothing. The bounds leave about 3x room; a state
# rounded per token or per element of the update, or read as the wrong dtype, lands far outside them.
LEAST_SHARE, MOST_DLOGPROB = 0.8, 0.03


def assert_close_run(full, half, least_share: float = LEAST_SHARE) -> None:
    agree = agreement(full, half)
    assert agree.mean_abs_dlogprob > 0, "the bfloat16 state changed nothing: is it bfloat16?"
    assert agree.share >= least_share and agree.mean_abs_dlogprob <= MOST_DLOGPROB, agree
    assert agree.divergences_in_top, agree


@pytest.mark.parametrize("variant", ["qwen3_5", "qwen3_next"])
def test_a_float32_state_is_exact_and_a_bfloat16_state_is_close(checkpoints, variant):
    import transformers

    folder = checkpoints[variant]
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rng = random.Random(0)
    prompts = prompts_of([rng.randint(4, 60) for _ in range(16)], seed=1)
    full = run(engine(folder, "float32"), prompts, 16)
    for prompt, (tokens, _) in zip(prompts[:4], full):  # transformers keeps the state in float32 too
        assert tokens == hf_greedy(ref, prompt, 16)[0], f"{len(prompt)} tokens"
    assert_close_run(full, run(engine(folder, "bfloat16"), prompts, 16))


def test_bfloat16_snapshots_serve_prefix_cache_hits(checkpoints):
    """A shared system prompt: the second wave restores the first wave's bfloat16 snapshot (copied as
    stored, no second rounding) and generates as the float32 run does. Measured: 0.006 nats, two
    divergences at near-ties (0.002 and 0.024 nats apart), 83% of the 48 positions before them; one
    such flip early in a prompt costs up to a sixth, so the share's bound is lower here. A snapshot
    restored wrong diverges at once in every second-wave prompt."""
    rng = random.Random(5)
    system = [rng.randrange(3, VOCAB) for _ in range(100)]
    waves = [[system + prompts_of([k], seed=k)[0] for k in ks] for ks in ((9, 4, 17), (6, 1, 30))]
    results = {}
    for ssm in ("float32", "bfloat16"):
        llm = engine(checkpoints["qwen3_next"], ssm)
        first = run(llm, waves[0], 8)
        before = llm.engine.stats().prefix_cache_hits  # type: ignore[attr-defined]
        second = run(llm, waves[1], 8)
        assert llm.engine.stats().prefix_cache_hits - before >= 3 * 96  # type: ignore[attr-defined]
        results[ssm] = first + second
    assert_close_run(results["float32"], results["bfloat16"])


@pytest.mark.slow  # starts tensor-parallel processes
def test_tensor_parallel_ranks_hold_their_heads_states_in_bfloat16(tmp_path):
    """Each rank allocates its heads' states in the chosen dtype (the cache config travels to the
    workers whole): tp 2 generates tp 1's tokens, prefix-cache hits included."""
    from tests.test_tp_models import HEADS, HYBRID, _greedy, _waves

    folder = make_hybrid_checkpoint(tmp_path, "qwen3_5_moe", **HEADS)
    first, second = _waves()
    one = LLM(str(folder), mamba_ssm_cache_dtype="bfloat16", **HYBRID)
    assert one.engine.runner.state_cache.ssm[0].dtype == torch.bfloat16  # type: ignore[attr-defined]
    expected = [
        [o.outputs[0].token_ids for o in one.generate(w, _greedy(6), use_tqdm=False)] for w in (first, second)
    ]
    llm = LLM(str(folder), tensor_parallel_size=2, mamba_ssm_cache_dtype="bfloat16", **HYBRID)
    try:
        got = [
            [o.outputs[0].token_ids for o in llm.generate(w, _greedy(6), use_tqdm=False)]
            for w in (first, second)
        ]
        assert llm.engine.stats().prefix_cache_hits >= 2 * 40  # type: ignore[attr-defined]
    finally:
        llm.engine.shutdown()  # type: ignore[attr-defined]
    assert [[list(t) for t in w] for w in got] == [[list(t) for t in w] for w in expected]


def run_engine(llm: LLM, prompts: list[list[int]], new_tokens: int) -> list[tuple[list[int], list[dict]]]:
    """Every prompt added at once, then steps until done (test_hybrid_models.run_engine, with logprobs)."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, logprobs=5)
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)  # type: ignore[attr-defined]
    done = {}
    while eng.has_unfinished_requests():  # type: ignore[attr-defined]
        for out in eng.step():  # type: ignore[attr-defined]
            if out.finished:
                done[out.request_id] = (list(out.outputs[0].token_ids), out.outputs[0].logprobs)
    return [done[str(i)] for i in range(len(prompts))]


# (prefix caching, KV pool blocks) as test_hybrid_models' preemption test: with snapshots a pool of 45
# blocks makes resumed requests find their saved boundary still cached
@pytest.mark.parametrize(
    ("prefix_caching", "blocks"), [(False, 40), (True, 45)], ids=["from-zero", "from-snapshots"]
)
def test_preempted_requests_restart_from_a_zero_or_bfloat16_snapshot_state(
    checkpoints, prefix_caching, blocks
):
    """A KV pool too small for seven requests: running ones are preempted and restart from a zero state
    or a bfloat16 snapshot; the run stays close to the float32 run under the same pressure (measured:
    97% of positions before the first divergence, one near-tie 0.02 nats apart, 0.006 nats)."""
    prompts = prompts_of([5, 13, 40, 57, 9, 30, 21], seed=3)
    arch = resolve_source(str(checkpoints["qwen3_5"]), "auto").arch
    sched = SchedulerConfig(max_num_seqs=7)
    block_bytes = 4 * 2 * 16 * 2 * 4  # 4 tokens x (K, V) x head 16 x 2 full layers x float32
    results = {}
    for ssm in ("float32", "bfloat16"):
        cache = CacheConfig(enable_prefix_caching=prefix_caching, mamba_ssm_cache_dtype=ssm)
        llm = engine(
            checkpoints["qwen3_5"],
            ssm,
            max_num_seqs=7,
            max_num_batched_tokens=16,
            max_model_len=128,
            kv_cache_memory_bytes=plan_states(arch, sched, cache).total_bytes + blocks * block_bytes,
            enable_prefix_caching=prefix_caching,
            admission="greedy",  # start whatever fits now, so that running requests outgrow the pool
        )
        assert llm.engine.pool_plan.num_blocks == blocks  # type: ignore[attr-defined]
        results[ssm] = run_engine(llm, prompts, 24)
        stats = llm.engine.stats()  # type: ignore[attr-defined]
        assert stats.num_preemptions_total > 0 and (stats.prefix_cache_hits > 0) == prefix_caching
    assert_close_run(results["float32"], results["bfloat16"])
