"""overnight/bench/throughput.py's run_ours on the CPU: by the time it hands the allocator's cache back
to the driver, its engine is gone, so a second engine in the same process (bench throughput
--lora-adapters: the base model, then the adapters) finds the memory the first one held. On the GPU the
first engine was still referenced when the cache was emptied, its weights and KV pool stayed with the
allocator, and the second run was refused for want of free memory (docs/performance.md, session K)."""

from __future__ import annotations

import gc

from overnight.bench import throughput
from overnight.bench.throughput import run_ours
from overnight.bench.workloads import Workload
from overnight.engine.engine import Engine
from overnight.options import EngineOptions
from tests.tiny_models import make_tiny_checkpoint


def _engines() -> int:
    return sum(isinstance(o, Engine) for o in gc.get_objects())


def test_run_ours_releases_its_engine_before_emptying_the_cache(tmp_path, monkeypatch):
    folder = make_tiny_checkpoint(tmp_path, "qwen3", vocab_size=1536)  # workloads draw ids below vocab - 1000
    workload = Workload("tiny", str(folder), num_requests=4, input_len=(4, 8), output_len=(2, 3))
    opts = EngineOptions(model=str(folder), skip_tokenizer_init=True, max_model_len=64)
    gc.collect()
    before = _engines()
    alive_at_release: list[int] = []
    # Count the engines still there when the cache would go back to the driver.
    monkeypatch.setattr(throughput, "release_gpu_cache", lambda: alive_at_release.append(_engines() - before))
    first, tokens = run_ours(opts, workload)
    assert first.output_tokens == sum(len(t) for t in tokens) and first.requests == 4
    assert alive_at_release == [0]
    second, again = run_ours(opts, workload)
    assert again == tokens and alive_at_release == [0, 0]


def test_run_ours_reports_its_output_spread(tmp_path):
    """The run's extra counts the distinct tokens its requests emitted at each output position they
    reach, from the very tokens it returns (bench/vllm_throughput.py reports the same for vLLM)."""
    folder = make_tiny_checkpoint(tmp_path, "qwen3", vocab_size=1536)
    workload = Workload("tiny", str(folder), num_requests=4, input_len=(4, 8), output_len=(2, 3))
    opts = EngineOptions(model=str(folder), skip_tokenizer_init=True, max_model_len=64)
    result, tokens = run_ours(opts, workload)
    assert result.extra is not None
    assert result.extra["distinct_tokens"] == {"0": len({t[0] for t in tokens})}
