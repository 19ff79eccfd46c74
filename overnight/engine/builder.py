"""The edge where user options become frozen configs and an Engine is assembled.

LLM(), `overnight run-batch`, `overnight serve` and `overnight bench` all pass their options here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields, replace

import torch

from overnight.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    RunnerConfig,
    SchedulerConfig,
)
from overnight.engine.engine import Engine
from overnight.errors import ModelLoadError
from overnight.limits import default_limits

log = logging.getLogger("overnight")


@dataclass(frozen=True)
class EngineOptions:
    """Every knob a user can set, with the names users know. None means: pick the default."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    load_format: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False  # fp8 cache: scales from the first prefill's K/V amax, not 1.0
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    skip_tokenizer_init: bool = False
    device: str | None = None  # None: CUDA when available, else CPU
    enforce_eager: bool = False
    attention_backend: str = "auto"
    mode: str = "offline"  # offline | server | batch: picks the default limits
    served_model_name: str | None = None
    # The engine steps in a process of its own (a one-engine data parallel front), so the caller's
    # Python threads never hold the GIL its step needs. None: off, except that `serve` turns it on (its
    # event loop spends ~80 us of GIL time per streamed token, docs/benchmarks.md).
    engine_process: bool | None = None

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> EngineOptions:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}")
        return cls(**kwargs)  # type: ignore[arg-type]


def pick_device(requested: str | None) -> torch.device:
    if requested:
        return torch.device(requested)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def device_memory_gib(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory / 2**30


def build_config(opts: EngineOptions, source, device: torch.device) -> EngineConfig:
    from overnight.loader.model_loader import resolve_dtype

    arch = source.arch
    model_max = arch.max_position_embeddings
    max_model_len = opts.max_model_len or model_max
    if max_model_len > model_max:
        raise ModelLoadError(
            f"max_model_len {max_model_len} exceeds the model's limit of {model_max} positions"
        )
    if max_model_len < 2:
        raise ModelLoadError("max_model_len must be at least 2")
    limits = default_limits(device_memory_gib(device), opts.mode, max_model_len)
    max_num_seqs = opts.max_num_seqs or limits.max_num_seqs
    batched = opts.max_num_batched_tokens or max(limits.max_num_batched_tokens, 1)
    if not opts.enable_chunked_prefill:
        batched = max(batched, max_model_len)
    dtype = resolve_dtype(opts.dtype, source, device)
    return EngineConfig(
        model=ModelConfig(
            model=source.path,
            arch=arch,
            dtype=dtype,
            load_format=opts.load_format,
            tokenizer=source.tokenizer_path,
            max_model_len=max_model_len,
            seed=opts.seed,
        ),
        cache=CacheConfig(
            block_size=opts.block_size,
            gpu_memory_utilization=opts.gpu_memory_utilization,
            kv_cache_dtype=opts.kv_cache_dtype,
            kv_cache_memory_bytes=opts.kv_cache_memory_bytes,
            enable_prefix_caching=opts.enable_prefix_caching,
            calculate_kv_scales=opts.calculate_kv_scales,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=batched,
            max_model_len=max_model_len,
            enable_chunked_prefill=opts.enable_chunked_prefill,
        ),
        parallel=ParallelConfig(opts.tensor_parallel_size, opts.data_parallel_size),
        runner=RunnerConfig(
            device=str(device),
            attention_backend=opts.attention_backend,
            enforce_eager=opts.enforce_eager,
        ),
    )


def build_engine(opts: EngineOptions) -> Engine:
    if opts.data_parallel_size > 1 or opts.engine_process:  # engine processes behind the Engine's methods
        from overnight.parallel.dp import DataParallelEngine

        return DataParallelEngine(opts)  # type: ignore[return-value]
    from overnight.loader.resolve import resolve_source
    from overnight.runner.kv_pool import kv_budget_bytes, plan_pool
    from overnight.runner.model_runner import ModelRunner

    device = pick_device(opts.device)
    source = resolve_source(opts.model, opts.load_format)
    if opts.served_model_name:
        source = replace(source, served_name=opts.served_model_name)
    config = build_config(opts, source, device)
    tokenizer = None
    if source.tokenizer_path is None and source.kind == "dummy" and not opts.tokenizer:
        log.info("dummy weights without a tokenizer: prompts must be token ids")
    elif not opts.skip_tokenizer_init:
        from overnight.tokenizer.tokenizer import load_tokenizer

        if opts.tokenizer:
            source_for_tok = replace(source, tokenizer_path=opts.tokenizer)
        else:
            source_for_tok = source
        tokenizer = load_tokenizer(source_for_tok)
    sched = config.scheduler
    if config.parallel.tensor_parallel_size > 1:  # rank processes load, size and allocate their shares
        from overnight.parallel.workers import start_tp_runner

        runner, plan = start_tp_runner(config, source)
    else:
        runner = ModelRunner(config, source)

        def measure() -> int:
            return runner.profile_peak_bytes(
                sched.max_num_batched_tokens, sched.max_num_seqs, sched.max_model_len
            )

        budget = kv_budget_bytes(device, config.cache, measure)
        plan = plan_pool(budget, runner.kv_bytes_per_block(), config.cache.block_size, sched)
        runner.init_kv_cache(plan.num_blocks)
        runner.capture_graphs()
    tokens = plan.num_blocks * config.cache.block_size
    log.info(
        "KV pool: %d blocks = %d tokens, %.2f GiB, dtype %s; up to %.1f sequences of max_model_len %d",
        plan.num_blocks,
        tokens,
        plan.pool_bytes / 2**30,
        runner.kv_cache_dtype,
        tokens / sched.max_model_len,
        sched.max_model_len,
    )
    return Engine(
        config,
        runner,
        num_blocks=plan.num_blocks,
        eos_token_ids=source.eos_token_ids,
        vocab_size=source.arch.vocab_size,
        tokenizer=tokenizer,
        source=source,
        pool_plan=plan,
    )
