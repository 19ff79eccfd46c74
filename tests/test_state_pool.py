"""Tier (a), on the CPU in seconds: the linear-attention state pool of hybrid models is sized before
anything is allocated. The runner allocates exactly plan_states' bytes and takes them out of the KV
pool's budget (on a fake GPU too), `overnight budget` reports the same numbers, a default max_num_seqs
too large for the device is lowered, a given one is refused with the bytes."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch

from overnight.build import build_config
from overnight.config import CacheConfig, SchedulerConfig
from overnight.engine.pool_plan import (
    STATE_SHARE,
    PoolMemoryError,
    _largest_fit,
    _state_pool_bytes,
    fit_state_seqs,
    plan_states,
    split_budget,
)
from overnight.loader.fit import activation_estimate, weight_bytes
from overnight.loader.resolve import resolve_source
from overnight.options import EngineOptions
from overnight.tools.budget import GIB, DeviceMemory, plan_budget
from tests.tiny_hybrid import make_hybrid_checkpoint

H100_GIB = 79.1  # what torch reports for an H100 80 GB
H100 = DeviceMemory("NVIDIA H100", total_bytes=int(H100_GIB * GIB), free_bytes=int(78.6 * GIB))


@pytest.fixture(scope="module")
def tiny_runner(tmp_path_factory):
    from overnight.runner.model_runner import ModelRunner

    folder = make_hybrid_checkpoint(tmp_path_factory.mktemp("qwen3_5"), "qwen3_5")
    opts = EngineOptions(
        model=str(folder),
        load_format="dummy",
        device="cpu",
        dtype="float32",
        max_num_seqs=8,
        max_model_len=256,
        block_size=4,
        kv_cache_memory_bytes=1 << 20,
        skip_tokenizer_init=True,
    )
    source = resolve_source(str(folder), "dummy")
    config = build_config(opts, source, torch.device("cpu"), None)
    return opts, source, config, ModelRunner(config, source)


def test_the_runner_allocates_the_plan_and_the_budget_reports_it(tiny_runner):
    opts, source, config, runner = tiny_runner
    plan = plan_states(config.model.arch, config.scheduler, config.cache)
    assert (plan.slots, plan.snapshots) == (9, 4)  # max_num_seqs + scratch; max(4, 8 // 4)
    assert runner.state_cache.nbytes == plan.total_bytes == 13 * source.arch.linear_state_bytes()
    budget, block_bytes = runner.kv_pool_share()
    assert budget == (1 << 20) - plan.total_bytes  # a set budget covers the states too
    b = plan_budget(opts, source, None)  # `overnight budget` for the same options
    assert (b.state_pool_bytes, b.state_snapshots, b.caches_bytes) == (plan.total_bytes, 4, 1 << 20)
    assert (b.budget_bytes, b.block_bytes) == (budget, block_bytes)


class FakeGPU:
    """torch.cuda's memory queries of a GPU holding `weights` and the state pool, whose largest step
    peaks `activations` above them."""

    def __init__(self, total: int, outside: int, weights: int, states: int, activations: int) -> None:
        self.total, self.outside, self.weights, self.states = total, outside, weights, states
        self.activations = activations

    def install(self, monkeypatch: pytest.MonkeyPatch, runner) -> None:
        held = self.weights + self.states
        free = self.total - self.outside - held
        for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
            monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, self.total))
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: held)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: held)
        monkeypatch.setattr(runner, "profile_peak_bytes", lambda *a: held + self.activations)
        monkeypatch.setattr(runner, "device", torch.device("cuda", 0))
        cache = replace(runner.config.cache, kv_cache_memory_bytes=None)  # measured, as by default
        monkeypatch.setattr(runner, "config", replace(runner.config, cache=cache))


def test_on_a_gpu_the_pool_shrinks_by_exactly_the_states(tiny_runner, monkeypatch):
    _, _, config, runner = tiny_runner
    states = runner.state_cache.nbytes
    gpu = FakeGPU(total=80 * GIB, outside=GIB // 2, weights=17 * GIB, states=states, activations=3 * GIB)
    gpu.install(monkeypatch, runner)
    budget, _ = runner.kv_pool_share()
    util = config.cache.gpu_memory_utilization
    # the weights and the peak as measured, without the states (which sat in memory_allocated)
    caches = split_budget(80 * GIB, util, GIB // 2, 17 * GIB, 20 * GIB)
    assert budget == caches - states
    # everything the engine holds adds up to its share of the device, not a byte more
    assert gpu.weights + gpu.activations + states + budget == int(80 * GIB * util) - GIB // 2


def test_states_larger_than_free_memory_are_refused_before_allocating(monkeypatch):
    from overnight.runner.model_runner import check_states_fit

    arch = resolve_source("qwen3.5-9b", "dummy").arch
    plan = plan_states(arch, SchedulerConfig(max_num_seqs=1024), CacheConfig(enable_prefix_caching=True))
    assert (plan.slots, plan.snapshots) == (1025, 256)
    assert plan.bytes_per_seq == 24 * 4 * (3 * 8192 + 32 * 128 * 128)  # 50.25 MiB
    assert plan.total_bytes == 1281 * plan.bytes_per_seq  # 62.86 GiB: with the weights, past an H100
    free = int(H100_GIB * GIB) - 17 * GIB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, int(H100_GIB * GIB)))
    with pytest.raises(PoolMemoryError) as info:
        check_states_fit(plan, torch.device("cuda", 0))
    assert "1024 requests and 256 prefix-cache snapshots take 62.86 GiB" in str(info.value)
    assert str(plan.total_bytes) in str(info.value) and "62.10 GiB is free" in str(info.value)
    check_states_fit(
        plan_states(arch, SchedulerConfig(max_num_seqs=384), CacheConfig()), torch.device("cuda")
    )


@pytest.mark.parametrize(
    ("name", "gib", "seqs"), [("qwen3.5-9b", H100_GIB, 400), ("qwen3.5-35b-a3b", 139.8, 384)]
)
def test_a_default_max_num_seqs_is_lowered_so_states_and_pool_fit(name, gib, seqs, caplog):
    source = resolve_source(name, "dummy")
    arch, total = source.arch, int(gib * GIB)
    opts = EngineOptions(model=name, load_format="dummy", mode="batch")
    with caplog.at_level(logging.INFO, logger="overnight"):
        config = build_config(opts, source, torch.device("cuda"), gib)
    sched, cache = config.scheduler, config.cache
    assert sched.max_num_seqs == seqs and f"max_num_seqs 1024 -> {seqs}" in caplog.text
    weights = weight_bytes(arch, torch.bfloat16, loaded=True)
    usable = int(total * cache.gpu_memory_utilization)
    old = plan_states(arch, SchedulerConfig(max_num_seqs=1024), cache).total_bytes
    assert weights + old > usable  # the states of the table's 1,024 requests alone overflow the device
    acts = activation_estimate(arch, sched.max_num_batched_tokens, 1024, 2)
    states = plan_states(arch, sched, cache).total_bytes
    assert states <= STATE_SHARE * (usable - weights - acts)  # the KV pool keeps at least as much
    # the next multiple of 16 would pass the share
    assert _state_pool_bytes(arch, seqs + 16, True) > STATE_SHARE * (usable - weights - acts)
    b = plan_budget(opts, source, DeviceMemory("GPU", total, total - GIB // 2))
    assert b.max_num_seqs == b.modes["batch"][0] == seqs and b.seqs_lowered_for_states
    assert b.state_pool_bytes == states
    assert b.budget_bytes == b.caches_bytes - states and b.num_blocks > 0
    assert weights + b.activation_bytes + states + b.budget_bytes <= usable


def test_a_dense_model_keeps_the_table(caplog):
    source = resolve_source("qwen3-8b", "dummy")
    opts = EngineOptions(model="qwen3-8b", load_format="dummy", mode="batch")
    assert build_config(opts, source, torch.device("cuda"), H100_GIB).scheduler.max_num_seqs == 1024


def test_a_given_max_num_seqs_too_large_is_refused_with_the_bytes():
    source = resolve_source("qwen3.5-9b", "dummy")
    opts = EngineOptions(model="qwen3.5-9b", load_format="dummy", max_num_seqs=1024)
    with pytest.raises(PoolMemoryError) as info:
        build_config(opts, source, torch.device("cuda"), H100_GIB)
    msg = str(info.value)
    need = _state_pool_bytes(source.arch, 1024, True)
    assert "max_num_seqs 1024 is too many" in msg and "50.25 MiB a request" in msg
    assert f"62.86 GiB for 1024 requests and their prefix-cache snapshots ({need} bytes)" in msg
    assert "lower max_num_seqs to at most" in msg
    # a given value that fits is kept, past the default's share
    fits = EngineOptions(model="qwen3.5-9b", load_format="dummy", max_num_seqs=640)
    assert build_config(fits, source, torch.device("cuda"), H100_GIB).scheduler.max_num_seqs == 640


def test_the_llm_refuses_before_loading_weights(monkeypatch):
    import overnight.loader.model_loader as model_loader
    from overnight import LLM

    def no_load(*a, **k):
        raise AssertionError("the weights must not start loading")

    monkeypatch.setattr(model_loader, "load_model", no_load)
    # the CPU's 2 GiB pool: 64 requests' states take 3.9 GiB
    with pytest.raises(PoolMemoryError, match="max_num_seqs 64 is too many"):
        LLM("qwen3.5-9b", load_format="dummy", device="cpu", max_num_seqs=64, skip_tokenizer_init=True)


def test_the_largest_fit_is_exact():
    arch = resolve_source("qwen3.5-9b", "dummy").arch
    for room in (0, 10**8, 3 * 10**9, 25 * GIB, 60 * GIB):
        for caching in (True, False):
            n = _largest_fit(arch, room, caching)
            assert n == 0 or _state_pool_bytes(arch, n, caching) <= room
            assert _state_pool_bytes(arch, n + 1, caching) > room
    assert fit_state_seqs(arch, 8, 10**12, True, given=False) == 8  # room to spare: unchanged
    assert fit_state_seqs(arch, 1024, 30 * GIB, False, given=False) == 304  # 15 GiB / 50.25 MiB a slot
    with pytest.raises(PoolMemoryError, match="even one request"):
        fit_state_seqs(arch, 1024, 100 * 2**20, True, given=False)
