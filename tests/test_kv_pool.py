"""KV pool sizing, the default limits table, and the errors users get when memory or lengths cannot work.

All on the CPU: the GPU's memory queries are replaced by a fake device with known numbers.
"""

from __future__ import annotations

import pytest
import torch

from overnight import LLM
from overnight.build import build_config
from overnight.config import CacheConfig, SchedulerConfig
from overnight.engine.pool_plan import PoolMemoryError, plan_pool, split_budget
from overnight.errors import ConfigError, ModelLoadError
from overnight.limits import default_limits
from overnight.loader.resolve import resolve_source
from overnight.options import EngineOptions
from overnight.runner.kv_pool import CPU_DEFAULT_POOL_BYTES, kv_budget_bytes
from tests.tiny_models import make_tiny_checkpoint

GIB = 1 << 30

# ---------------------------------------------------------------- plan_pool


def test_plan_pool_divides_the_budget_into_blocks() -> None:
    sched = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=4096)
    plan = plan_pool(10 * GIB + 123, block_bytes=2 << 20, block_size=16, sched=sched)
    assert plan.num_blocks == 5120 and not plan.capped
    assert plan.pool_bytes == 5120 * (2 << 20) and plan.budget_bytes == 10 * GIB + 123


def test_plan_pool_caps_at_twice_max_num_seqs_sequences() -> None:
    """No more blocks than 2 x max_num_seqs x max_model_len tokens (rounded up to whole blocks)."""
    sched = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=64, max_model_len=100)
    plan = plan_pool(GIB, block_bytes=1024, block_size=16, sched=sched)
    assert plan.capped and plan.num_blocks == 2 * 19  # ceil(300 / 16) = 19
    assert plan.budget_bytes == GIB  # what was set aside, before the cap


def test_plan_pool_without_room_for_one_block() -> None:
    sched = SchedulerConfig()
    with pytest.raises(PoolMemoryError, match="no memory is left for the KV cache"):
        plan_pool(1000, block_bytes=1024, block_size=16, sched=sched)
    with pytest.raises(MemoryError):  # callers that catch MemoryError keep working
        plan_pool(-5 * GIB, block_bytes=1024, block_size=16, sched=sched)


# ---------------------------------------------------------------- the budget


def test_kv_cache_memory_bytes_sets_the_budget_on_any_device() -> None:
    cache = CacheConfig(kv_cache_memory_bytes=3 * GIB + 7, gpu_memory_utilization=0.1)
    assert kv_budget_bytes(torch.device("cpu"), cache) == 3 * GIB + 7
    # Never touches the GPU's memory queries (there is no GPU here).
    assert kv_budget_bytes(torch.device("cuda"), cache, lambda: 1 / 0) == 3 * GIB + 7


def test_cpu_default_budget() -> None:
    assert kv_budget_bytes(torch.device("cpu"), CacheConfig()) == CPU_DEFAULT_POOL_BYTES == 2 * GIB


def test_split_budget_arithmetic() -> None:
    total, outside, weights, peak = 140 * GIB, GIB // 2, 16 * GIB, 20 * GIB
    budget = split_budget(total, 0.9, outside, weights, peak)
    assert budget == int(140 * GIB * 0.9) - GIB // 2 - 20 * GIB
    # Memory freed outside torch (a negative reading) is not counted as extra room.
    assert split_budget(total, 0.9, -GIB, weights, peak) == int(140 * GIB * 0.9) - 20 * GIB


def test_weights_that_do_not_fit_name_the_weights() -> None:
    with pytest.raises(PoolMemoryError, match=r"weights take 80\.00 GiB, more than the 71\.50 GiB") as e:
        split_budget(80 * GIB, 0.9, GIB // 2, 80 * GIB, 85 * GIB)
    assert "gpu_memory_utilization 0.9 x 80.0 GiB" in str(e.value)
    assert isinstance(e.value, ConfigError)


def test_activations_that_do_not_fit_name_the_step() -> None:
    with pytest.raises(PoolMemoryError, match=r"activations of the largest step \(10\.00 GiB\)") as e:
        split_budget(80 * GIB, 0.9, 0, 65 * GIB, 75 * GIB)
    assert "lower max_num_batched_tokens" in str(e.value)


class FakeGPU:
    """torch.cuda's memory queries for a device with `total` bytes holding `weights` bytes of tensors,
    `context` bytes outside torch, and a measured step that peaks `activations` above the weights."""

    def __init__(self, total: int, weights: int, context: int, activations: int) -> None:
        self.total, self.weights, self.context, self.activations = total, weights, context, activations

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        cuda = torch.cuda
        used = self.weights + self.context
        monkeypatch.setattr(cuda, "mem_get_info", lambda device=None: (self.total - used, self.total))
        monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: self.weights)
        monkeypatch.setattr(cuda, "memory_reserved", lambda device=None: self.weights)
        for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
            monkeypatch.setattr(cuda, name, lambda device=None: None)

    def measure(self) -> int:
        return self.weights + self.activations


def test_gpu_budget_from_measured_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = FakeGPU(total=140 * GIB, weights=16 * GIB, context=GIB, activations=3 * GIB)
    gpu.install(monkeypatch)
    budget = kv_budget_bytes(torch.device("cuda"), CacheConfig(gpu_memory_utilization=0.9), gpu.measure)
    assert budget == int(140 * GIB * 0.9) - GIB - 16 * GIB - 3 * GIB


def test_gpu_weights_beyond_utilization(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = FakeGPU(total=80 * GIB, weights=70 * GIB, context=GIB, activations=GIB)
    gpu.install(monkeypatch)
    with pytest.raises(PoolMemoryError, match=r"the model's weights take 70\.00 GiB"):
        kv_budget_bytes(torch.device("cuda"), CacheConfig(gpu_memory_utilization=0.8), gpu.measure)
    # The same model with a larger share fits.
    assert kv_budget_bytes(torch.device("cuda"), CacheConfig(gpu_memory_utilization=0.95), gpu.measure) > 0


# ---------------------------------------------------------------- the default limits table

# (device GiB, mode) -> (max_num_seqs, max_num_batched_tokens) before the min() rules; a batch job gets
# at least the offline budget, twice its tokens on 70+ GiB GPUs (limits.py's changes from the table
# users know).
TABLE = {
    (None, "offline"): (256, 4096),
    (None, "server"): (128, 2048),
    (None, "batch"): (256, 4096),
    (192.0, "offline"): (1024, 16384),
    (192.0, "server"): (1024, 16384),
    (192.0, "batch"): (1024, 32768),
    (139.8, "offline"): (1024, 16384),  # H200
    (139.8, "server"): (1024, 8192),
    (139.8, "batch"): (1024, 32768),
    (79.6, "server"): (1024, 8192),  # H100
    (39.4, "offline"): (256, 8192),  # A100-40G
    (39.4, "server"): (256, 2048),
    (39.4, "batch"): (256, 8192),
    (22.0, "server"): (256, 2048),  # L4
}


@pytest.mark.parametrize(("gib", "mode"), list(TABLE))
def test_default_limits_rows(gib: float | None, mode: str) -> None:
    lim = default_limits(gib, mode, max_model_len=32768)
    assert (lim.max_num_seqs, lim.max_num_batched_tokens) == TABLE[gib, mode]


def test_default_limits_row_boundaries() -> None:
    assert default_limits(160.0, "server", 4096).max_num_batched_tokens == 16384
    assert default_limits(159.9, "server", 4096).max_num_batched_tokens == 8192
    assert default_limits(70.0, "offline", 4096).max_num_seqs == 1024
    assert default_limits(69.9, "offline", 4096).max_num_seqs == 256
    assert default_limits(139.8, "offline", 4096).row == ">= 70 GiB (H100, H200)"
    assert default_limits(None, "offline", 4096).row == "CPU"


def test_default_limits_min_rules() -> None:
    """batched tokens = min(max_num_seqs x max_model_len, value); max_num_seqs = min(max_num_seqs, tokens)."""
    lim = default_limits(139.8, "offline", max_model_len=8)
    assert lim.max_num_batched_tokens == 1024 * 8 and lim.max_num_seqs == 1024
    lim = default_limits(None, "server", max_model_len=3)
    assert lim.max_num_batched_tokens == 128 * 3 and lim.max_num_seqs == 128
    lim = default_limits(39.4, "offline", max_model_len=1)
    assert (lim.max_num_seqs, lim.max_num_batched_tokens) == (256, 256)
    with pytest.raises(ValueError, match="mode must be one of"):
        default_limits(80.0, "interactive", 4096)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("pool"), "qwen3")  # max_position_embeddings 512


def test_build_config_applies_the_defaults_and_user_values(tiny) -> None:
    source = resolve_source(str(tiny))
    cpu = torch.device("cpu")
    sched = build_config(EngineOptions(model=str(tiny)), source, cpu, None).scheduler
    assert (sched.max_model_len, sched.max_num_seqs, sched.max_num_batched_tokens) == (512, 256, 4096)
    sched = build_config(
        EngineOptions(model=str(tiny), mode="server", max_model_len=8), source, cpu, None
    ).scheduler
    assert (sched.max_num_seqs, sched.max_num_batched_tokens) == (128, 128 * 8)
    opts = EngineOptions(model=str(tiny), max_num_seqs=7, max_num_batched_tokens=99)
    sched = build_config(opts, source, cpu, None).scheduler
    assert (sched.max_num_seqs, sched.max_num_batched_tokens) == (7, 99)


# ---------------------------------------------------------------- errors users get


def test_max_model_len_above_the_models_limit(tiny) -> None:
    with pytest.raises(ModelLoadError, match="max_model_len 1024 exceeds the model's limit of 512"):
        LLM(str(tiny), skip_tokenizer_init=True, device="cpu", max_model_len=1024)


def test_pool_smaller_than_one_sequence_of_max_model_len(tiny) -> None:
    """kv_cache_memory_bytes for 20 blocks (320 tokens) with max_model_len 512."""
    opts = dict(skip_tokenizer_init=True, device="cpu", dtype="float32", max_model_len=512)
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # layers x K/V x block_size x kv heads x head_dim x fp32
    with pytest.raises(
        ConfigError, match="the KV pool holds 320 tokens, less than one sequence of max_model_len 512"
    ):
        LLM(str(tiny), kv_cache_memory_bytes=20 * block_bytes, **opts)
    with pytest.raises(MemoryError, match="no memory is left for the KV cache"):
        LLM(str(tiny), kv_cache_memory_bytes=block_bytes - 1, **opts)
    # The same bytes hold 4x the tokens in fp8: 1280 >= 512, so the engine starts.
    llm = LLM(str(tiny), kv_cache_memory_bytes=20 * block_bytes, kv_cache_dtype="fp8", **opts)
    assert llm.engine.pool_plan.num_blocks * llm.engine.config.cache.block_size == 1280


def test_start_up_runs_the_sizes_between_the_graphs_and_the_step_budget(tiny) -> None:
    """After the peak-memory step, start-up runs each power-of-two step size above the largest decode
    graph once, so size-tuned kernels (the MoE GEMMs' tiles) compile then, not mid-job."""
    llm = LLM(
        str(tiny), skip_tokenizer_init=True, device="cpu", dtype="float32", max_model_len=128, max_num_seqs=8
    )
    runner = llm.engine.runner
    seen: list[int] = []
    model = runner.model
    runner.model = lambda ids, pos, attn: (seen.append(len(ids)), model(ids, pos, attn))[1]
    runner.model.compute_logits = model.compute_logits
    try:
        runner.profile_peak_bytes(300, 8, 128)
    finally:
        runner.model = model
    # 300 tokens (peak), then 16, 32, 64, 128, 256: above min(max_capture_batch_size, max_num_seqs) = 8.
    assert seen == [300, 16, 32, 64, 128, 256]
    assert runner.warm_up_sizes(8) == [] and runner.warm_up_sizes(17) == [16]
