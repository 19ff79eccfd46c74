"""The composition root: user options in, an engine out.

    EngineOptions (options.py)
      -> resolve_model: the model's source (architecture, stop ids) and its tokenizer, read once
      -> build_config: frozen configs for this device and mode (limits.py picks the defaults)
      -> one engine:   ModelRunner, or the tensor-parallel group (parallel/workers.py); the KV pool
                       (runner/kv_pool.py); Engine (engine/). An encoder-only model (BERT) gets
                       an EncoderEngine instead (encoder/): no KV cache, whole prompts per batch
         or several:   DataParallelEngine over engine processes (parallel/links.py) or Ray actors
                       (parallel/ray.py), each built by build_engine in its own process

Every entry point (LLM, run-batch, serve, bench, budget) comes through here; nothing below imports it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from overnight.arch import ModelArch
from overnight.attention.variants import TMA_TILES
from overnight.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    PoolerConfig,
    RunnerConfig,
    SchedulerConfig,
    ssm_state_dtype,
)
from overnight.engine.admission import step_tokens, tail_share
from overnight.engine.engine import Engine
from overnight.engine.interfaces import EngineClient
from overnight.errors import ConfigError, ModelLoadError
from overnight.limits import default_limits
from overnight.loader.source import ModelSource
from overnight.options import EngineOptions, block_size_for, image_limit
from overnight.runner.device import device_memory_gib, pick_device
from overnight.tokenizer.tokenizer import Tokenizer, load_tokenizer

if TYPE_CHECKING:
    from overnight.parallel.workers import TPRunner
    from overnight.structured.compiler import GrammarCompiler

log = logging.getLogger("overnight")


@dataclass(frozen=True)
class ResolvedModel:
    source: ModelSource
    tokenizer: Tokenizer | None  # None: skip_tokenizer_init, or dummy weights that ship none
    # Structured outputs' grammars for this tokenizer, compiled on first use; None without a tokenizer.
    grammars: GrammarCompiler | None = None


def resolve_model(opts: EngineOptions) -> ResolvedModel:
    """Where the model and its tokenizer come from (files read; no weights loaded)."""
    from overnight.loader.resolve import resolve_source

    source = resolve_source(opts.model, opts.load_format, opts.quantization, opts.hf_overrides)
    if source.arch.vision is not None and image_limit(opts.limit_mm_per_prompt) == 0:
        # Text-only (vLLM's limit_mm_per_prompt={"image": 0}): everything below (the weight-fit check,
        # `overnight budget`, the model build and load, the runner's encoder profiling) reads this arch.
        source = replace(source, arch=replace(source.arch, text_only=True))
        log.info(
            "limit_mm_per_prompt image 0: %s runs text-only, without its vision tower", source.served_name
        )
    source = _with_expert_form(opts, source)
    source = _with_int_form(opts, source)
    if opts.max_model_len and opts.max_model_len < source.arch.max_position_embeddings:
        # The RoPE tables need only the positions a request can reach (a 10M-position Llama 4 config
        # would build 5 GB of float32 table); build_config still checks max_model_len against the model.
        source = replace(source, arch=replace(source.arch, rope_positions=opts.max_model_len))
    if opts.served_model_name:
        source = replace(source, served_name=opts.served_model_name)
    if opts.tokenizer:
        source = replace(source, tokenizer_path=opts.tokenizer)
    if opts.skip_tokenizer_init:
        return ResolvedModel(_with_head_token_ids(source, None), None)
    if source.tokenizer_path is None and source.kind == "dummy":
        log.info("dummy weights without a tokenizer: prompts must be token ids")
        return ResolvedModel(_with_head_token_ids(source, None), None)
    tokenizer = load_tokenizer(source)  # raises ModelLoadError naming what is missing
    source = _with_head_token_ids(source, tokenizer)
    from overnight.structured.compiler import GrammarCompiler

    return ResolvedModel(source, tokenizer, GrammarCompiler.for_tokenizer(tokenizer, source.arch.vocab_size))


def _with_expert_form(opts: EngineOptions, source: ModelSource) -> ModelSource:
    """The source with its MXFP4 experts' form chosen (loader/expert_form.py), in its arch, which the
    weight-fit check, `overnight budget`, the build and the load all read."""
    from overnight.loader.expert_form import check_expert_form_device, choose_expert_form

    if not source.arch.experts_mxfp4:
        choose_expert_form(source.arch, opts.mxfp4_experts, 2, None)  # refuses a form it cannot take
        return source
    device, dtype, memory = _device_facts(opts, source)
    form = choose_expert_form(
        source.arch,
        opts.mxfp4_experts,
        dtype.itemsize,
        memory,
        opts.tensor_parallel_size,
        str(dtype).removeprefix("torch."),
    )
    check_expert_form_device(form.arch, device)
    log.info("%s", form.reason)
    return replace(source, arch=form.arch)


def _with_int_form(opts: EngineOptions, source: ModelSource) -> ModelSource:
    """The source with its integer checkpoint's form chosen (loader/int_form.py: packed, or dequantized
    at load), in its quantization scheme, which the weight-fit check, `overnight budget`, the build, the
    tensor-parallel checks and the load all read."""
    from overnight.loader.int_form import choose_int_form
    from overnight.quant.int_scheme import IntScheme

    if not isinstance(source.quantization, IntScheme):
        choose_int_form(source.arch, source.quantization, opts.int_weights, 2, None)  # refuses a form
        return source
    _, dtype, memory = _device_facts(opts, source)
    form = choose_int_form(
        source.arch,
        source.quantization,
        opts.int_weights,
        dtype.itemsize,
        memory,
        opts.tensor_parallel_size,
        str(dtype).removeprefix("torch."),
    )
    log.info("%s", form.reason)
    return replace(source, quantization=form.scheme)


def _device_facts(opts: EngineOptions, source: ModelSource) -> tuple[torch.device, torch.dtype, int | None]:
    """(the device the engine runs on, the compute dtype, one GPU's total memory in bytes or None on the
    CPU): what the dense-at-load forms' auto decides by."""
    from overnight.loader.model_loader import resolve_dtype

    device = pick_device(opts.device)
    memory = device_memory_gib(device)
    return device, resolve_dtype(opts.dtype, source, device), None if memory is None else int(memory * 2**30)


def _with_head_token_ids(source: ModelSource, tokenizer: Tokenizer | None) -> ModelSource:
    """The source with its classifier_from_token ids (a head made from tokens; before any weight loads)
    from `tokenizer`, or, without one (skip_tokenizer_init), from the model's tokenizer loaded for this:
    the tokens name vocabulary entries."""
    from overnight.loader.hf_overrides import with_token_ids

    head = source.lm_head_classifier
    if head is None:
        return source
    if tokenizer is None and source.tokenizer_path is None:
        raise ConfigError(
            f"classifier_from_token names tokens, and {source.served_name} has no tokenizer to look them "
            "up in: pass --tokenizer"
        )
    vocab = (tokenizer or load_tokenizer(source)).hf.get_vocab()
    head = with_token_ids(head, vocab, source.arch.vocab_size, source.served_name)
    return replace(source, lm_head_classifier=head)


def resolve_runner(opts: EngineOptions, source: ModelSource) -> str:
    """The runner, "generate" or "pooling": the option, with auto decided by the architecture
    (encoders and bare decoders, checkpoints saved without an LM head such as "Qwen3Model", pool; a
    multimodal ...ForConditionalGeneration generates with its text model)."""
    if opts.runner == "auto":
        bare = not source.hf_architecture.endswith(("ForCausalLM", "ForConditionalGeneration"))
        return "pooling" if source.arch.is_encoder or bare else "generate"
    if opts.runner == "generate" and (source.arch.is_encoder or source.arch.num_labels):
        kind = "a sequence classifier" if source.arch.num_labels else "an encoder-only model"
        raise ConfigError(
            f"{source.served_name} is {kind} ({source.hf_architecture}): it cannot "
            "generate text; run it with runner 'pooling' (or 'auto')"
        )
    return opts.runner


def pooler_config(opts: EngineOptions, source: ModelSource) -> PoolerConfig:
    """The model's own pooling (loader/pooling_config.py) with the pooling_type / normalize options
    in place of its own."""
    from overnight.loader.pooling_config import read_pooler_config

    config = read_pooler_config(source, opts.pooling_type)  # upper case: options.check_options
    if opts.normalize is not None:
        config = replace(config, normalize=opts.normalize)
    return config


def build_config(
    opts: EngineOptions, source: ModelSource, device: torch.device, memory_gib: float | None
) -> EngineConfig:
    """The frozen configs for this model on `device` with memory_gib of memory (None: a CPU), which picks
    the default limits. Raises ConfigError (or ModelLoadError, for a length the model cannot do) for
    impossible options."""
    from overnight.loader.model_loader import resolve_dtype

    runner = resolve_runner(opts, source)
    pooler = pooler_config(opts, source) if runner == "pooling" else None
    if pooler is not None and opts.tensor_parallel_size > 1:
        raise ConfigError("runner 'pooling' does not run tensor parallel yet: use data_parallel_size")

    model_max = source.arch.max_position_embeddings
    max_model_len = opts.max_model_len or model_max
    if max_model_len > model_max:
        raise ModelLoadError(
            f"max_model_len {max_model_len} exceeds the model's limit of {model_max} positions"
        )
    if max_model_len < 2:
        raise ConfigError("max_model_len must be at least 2")
    check_parallel(opts, source)
    check_cache(opts)
    lora = lora_config(opts, source, runner)
    limits = default_limits(memory_gib, opts.mode, max_model_len)
    max_num_seqs = opts.max_num_seqs or limits.max_num_seqs
    batched = opts.max_num_batched_tokens or max(limits.max_num_batched_tokens, 1)
    if not opts.enable_chunked_prefill or source.arch.is_encoder:  # an encoder sees whole prompts
        batched = max(batched, max_model_len)
    # Only last-token pooling can start past a cached prefix: the others need every token's state.
    prefix_caching = opts.enable_prefix_caching and (pooler is None or pooler.pooling_type == "LAST")
    dtype = resolve_dtype(opts.dtype, source, device)
    ssm_dtype = ssm_state_dtype(opts.mamba_ssm_cache_dtype)
    if source.arch.num_linear_layers:  # before anything is allocated: the states must fit beside a pool
        fitted = fit_hybrid_seqs(
            opts, source, device, memory_gib, dtype, max_num_seqs, batched, max_model_len, prefix_caching
        )
        if fitted < max_num_seqs:
            log.info(
                "max_num_seqs %d -> %d: a request's linear-attention states take %.1f MiB (%d layers, "
                "%s delta-rule states), and with their prefix-cache snapshots those of %d requests would "
                "take more than half the memory left for caches (`overnight budget` shows it); set "
                "max_num_seqs to choose%s",
                max_num_seqs,
                fitted,
                source.arch.linear_state_bytes(ssm_dtype) / 2**20,
                source.arch.num_linear_layers,
                str(ssm_dtype).removeprefix("torch."),
                max_num_seqs,
                ", or --mamba-ssm-cache-dtype bfloat16 to halve the states"
                if ssm_dtype == torch.float32
                else "",
            )
            max_num_seqs = fitted
    elif opts.mamba_ssm_cache_dtype != "auto":  # as vLLM: an option of state caches, unused without them
        log.info(
            "mamba_ssm_cache_dtype %s ignored: the model (%s) has no linear-attention layers, so no "
            "state cache",
            opts.mamba_ssm_cache_dtype,
            source.arch.architecture,
        )
    return EngineConfig(
        model=ModelConfig(
            model=source.path,
            arch=source.arch,
            dtype=dtype,
            seed=opts.seed,
            quantization=source.quantization.name if source.quantization is not None else None,
            runner=runner,
            pooler=pooler,
        ),
        cache=CacheConfig(
            block_size=block_size_for(opts.kv_cache_dtype, opts.block_size),
            gpu_memory_utilization=opts.gpu_memory_utilization,
            kv_cache_dtype=opts.kv_cache_dtype,
            kv_cache_memory_bytes=opts.kv_cache_memory_bytes,
            enable_prefix_caching=prefix_caching,
            calculate_kv_scales=opts.calculate_kv_scales,
            mamba_ssm_cache_dtype=opts.mamba_ssm_cache_dtype,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=batched,
            max_model_len=max_model_len,
            enable_chunked_prefill=opts.enable_chunked_prefill,
            admission=opts.admission,
            admission_tail_share=tail_share(source.arch),
            admission_step_tokens=step_tokens(source.arch),
            decode_row_caps=decode_row_caps(opts, source, device),
        ),
        parallel=ParallelConfig(tensor_parallel_size=opts.tensor_parallel_size),
        runner=RunnerConfig(
            device=str(device),
            attention_backend=opts.attention_backend,
            attention_variant=opts.attention_variant,
            enforce_eager=opts.enforce_eager,
        ),
        lora=lora,
    )


def decode_row_caps(
    opts: EngineOptions, source: ModelSource, device: torch.device
) -> tuple[tuple[int, int], ...]:
    """The scheduler's decode row caps (SchedulerConfig.decode_row_caps) under decode_row_caps "auto": the
    W4A16 kernel's (kernels/w4a16_gemm.py decode_row_caps) where a step's GEMMs are its packed int4
    layers on a GPU, words in MMA order (4-bit codes, groups a multiple of 128). None for an MoE, whose
    steps are its experts' GEMMs, tiled by the rows each expert gets."""
    from overnight.engine.admission import weight_ratio
    from overnight.quant.int_scheme import IntScheme

    q = source.quantization
    if opts.decode_row_caps == "off" or device.type != "cuda" or not isinstance(q, IntScheme):
        return ()
    if q.dense or q.int8_activations or not q.group_size or weight_ratio(source.arch) > 1:
        return ()
    try:  # triton: a GPU run with packed layers loads it anyway; `overnight budget` may plan without it
        from overnight.kernels import w4a16_gemm
    except ImportError:
        return ()
    fits = w4a16_gemm.mma_order_fits(q.bits, q.group_size, w4a16_gemm.MMA_BLOCK)  # the layers' own rule
    if w4a16_gemm.KERNEL != "v2" or not w4a16_gemm.MMA_ORDER or not fits:
        return ()
    return w4a16_gemm.decode_row_caps()


def cache_bytes_estimate(
    opts: EngineOptions,
    source: ModelSource,
    device: torch.device,
    memory_gib: float | None,
    dtype: torch.dtype,
    max_num_seqs: int,
    max_num_batched_tokens: int,
) -> int:
    """The memory the caches (KV pool and linear-attention states) will get on one device, known before
    loading: kv_cache_memory_bytes; the CPU's fixed pool; on a GPU gpu_memory_utilization of its total
    less the weights and the largest step's activations, both estimated from the architecture (one
    tensor-parallel rank's). The runner measures the real figure at start-up (runner/kv_pool.py)."""
    from overnight.loader.fit import activation_estimate, linear_formats, weight_bytes
    from overnight.runner.kv_pool import CPU_DEFAULT_POOL_BYTES

    if opts.kv_cache_memory_bytes is not None:
        return opts.kv_cache_memory_bytes
    if memory_gib is None:
        return CPU_DEFAULT_POOL_BYTES
    arch, weights_arch = _rank_archs(source, opts.tensor_parallel_size)
    fp8, int_linear = linear_formats(source.quantization, device)
    weights = weight_bytes(
        weights_arch, dtype, fp8_linear=fp8, loaded=True, int_linear=int_linear, scheme=source.quantization
    )
    acts = activation_estimate(arch, max_num_batched_tokens, max_num_seqs, dtype.itemsize)
    return int(memory_gib * 2**30 * opts.gpu_memory_utilization) - weights - acts


def _rank_archs(source: ModelSource, tp: int) -> tuple[ModelArch, ModelArch]:
    """(the shapes one rank computes with, the shapes of the weights it holds); the model's when tp 1."""
    if tp == 1:
        return source.arch, source.arch
    from overnight.parallel.tp_shards import TPShards

    shards = TPShards(source.arch, 0, tp)
    return shards.local_arch, shards.rank_weights_arch


def fit_hybrid_seqs(
    opts: EngineOptions,
    source: ModelSource,
    device: torch.device,
    memory_gib: float | None,
    dtype: torch.dtype,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    prefix_caching: bool,
) -> int:
    """max_num_seqs whose linear-attention states fit beside a useful KV pool (engine/pool_plan.py
    fit_state_seqs): a default lowered (and logged), a given value refused with the bytes (PoolMemoryError,
    a ConfigError). Memory too small for the weights and a step is left to the later checks, which say so.
    The activations are estimated for max_num_seqs before it is lowered: on the safe side."""
    from overnight.attention.kv_quant import kv_cache_torch_dtype
    from overnight.engine.pool_plan import fit_state_seqs
    from overnight.loader.fit import kv_bytes_per_sequence

    cache_bytes = cache_bytes_estimate(
        opts, source, device, memory_gib, dtype, max_num_seqs, max_num_batched_tokens
    )
    if cache_bytes <= 0:
        return max_num_seqs
    arch, _ = _rank_archs(source, opts.tensor_parallel_size)
    kv_elem = kv_cache_torch_dtype(opts.kv_cache_dtype, dtype).itemsize
    # The least KV pool worth having: one step's chunk of one sequence (the pool sizing's own checks
    # decide whether longer sequences fit: the scheduler preempts, or the cap of max_model_len binds).
    chunk = min(max_model_len, max_num_batched_tokens)
    one_seq = kv_bytes_per_sequence(arch, chunk, max_num_batched_tokens, kv_elem)
    given = opts.max_num_seqs is not None
    ssm_dtype = ssm_state_dtype(opts.mamba_ssm_cache_dtype)
    return fit_state_seqs(arch, max_num_seqs, cache_bytes, prefix_caching, given, one_seq, ssm_dtype)


def lora_config(opts: EngineOptions, source: ModelSource, runner: str) -> LoRAConfig | None:
    """The LoRA config when enable_lora; ConfigError for options or a model LoRA cannot work with."""
    if not opts.enable_lora:
        return None
    from overnight.lora.targets import SINGLE_DEVICE_FAMILIES, SUPPORTED_ARCHITECTURES

    if runner != "generate" or source.arch.architecture not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            f"enable_lora: LoRA adapters run on generating {', '.join(SUPPORTED_ARCHITECTURES)} models, "
            f"not on {source.arch.architecture!r} with runner {runner!r}"
        )
    if opts.tensor_parallel_size > 1 and source.arch.architecture in SINGLE_DEVICE_FAMILIES:
        raise ConfigError(
            f"enable_lora: LoRA on {source.arch.architecture!r} models with tensor_parallel_size > 1 is "
            "not supported yet (use tensor_parallel_size 1, or data parallelism)"
        )
    if opts.max_loras < 1 or opts.max_lora_rank < 1:
        raise ConfigError(
            f"max_loras and max_lora_rank must be at least 1 (got {opts.max_loras}, {opts.max_lora_rank})"
        )
    cpu = opts.max_cpu_loras if opts.max_cpu_loras is not None else opts.max_loras
    if cpu < opts.max_loras:
        raise ConfigError(f"max_cpu_loras ({cpu}) must be at least max_loras ({opts.max_loras})")
    return LoRAConfig(max_loras=opts.max_loras, max_lora_rank=opts.max_lora_rank, max_cpu_loras=cpu)


def check_cache(opts: EngineOptions) -> None:
    """Raise ConfigError for a block size the cache or the attention variant cannot take, before any
    weight loads."""
    block_size = block_size_for(opts.kv_cache_dtype, opts.block_size)
    tile = TMA_TILES.get(opts.attention_variant)
    if tile and opts.kv_cache_dtype != "auto" and block_size % tile:
        raise ConfigError(
            f"attention variant {opts.attention_variant!r} reads tiles of {tile} tokens from one page: "
            f"set --block-size to a multiple of {tile} (got {block_size})"
        )


def check_parallel(opts: EngineOptions, source: ModelSource) -> None:
    """Raise ModelLoadError for sizes the model's heads cannot be split into, before any process starts
    or any weight loads (sizes below 1 are refused when the options are made)."""
    if opts.tensor_parallel_size > 1:
        from overnight.parallel.tp_shards import TPShards

        TPShards(source.arch, 0, opts.tensor_parallel_size).check()


def check_int_parallel(
    source: ModelSource, tensor_parallel_size: int, int_linear: tuple[int, int, bool] | None
) -> None:
    """Raise ModelLoadError for a quantized checkpoint the tensor-parallel shares cannot hold exactly:
    integer ones (parallel/tp_int.py), Gemma 4's per-layer sizes (parallel/tp_gemma4.py) and the Mamba2
    hybrids' projections (parallel/tp_mamba2.py). int_linear:
    linear_formats' answer for the device (None: dequantized there)."""
    from overnight.quant.int_scheme import IntScheme
    from overnight.quant.scheme import QuantScheme

    if tensor_parallel_size == 1:
        return
    if isinstance(source.quantization, IntScheme):
        from overnight.parallel.tp_int import check_int_tp

        # int_linear: the device keeps packed layers (and experts, its last field); else dequantized
        packed = int_linear is not None
        experts = packed and bool(int_linear and int_linear[2])
        check_int_tp(source.quantization, source.arch, tensor_parallel_size, experts, packed)
    from overnight.parallel.tp_gemma4 import check_gemma4_quantized_tp

    block_k = source.quantization.block_k if isinstance(source.quantization, QuantScheme) else None
    check_gemma4_quantized_tp(source.arch, tensor_parallel_size, block_k, int_linear)
    from overnight.parallel.tp_mamba2 import check_mamba2_quantized_tp

    check_mamba2_quantized_tp(source.arch, tensor_parallel_size, block_k, int_linear)


def build_engine(opts: EngineOptions) -> EngineClient:
    """The engine these options describe: one, or data_parallel_size behind one front."""
    model = resolve_model(opts)
    check_parallel(opts, model.source)
    if opts.data_parallel_size > 1 or opts.engine_process:  # engines in processes of their own
        from overnight.parallel.dp import DataParallelEngine
        from overnight.parallel.links import ProcessLinks

        # Each engine process builds its own engine (data_parallel_size=1, in-process) with this function.
        one = replace(opts, data_parallel_size=1, engine_process=False)
        links = ProcessLinks(one, opts.data_parallel_size, build_engine)
        return DataParallelEngine(links, model.source, model.tokenizer, model.grammars)
    return _single_engine(opts, model)


def build_ray_engine(
    opts: EngineOptions,
    num_replicas: int,
    *,
    address: str | None = None,
    gpus_per_replica: float | None = None,
    cpus_per_replica: float = 1.0,
) -> EngineClient:
    """num_replicas engines on a Ray cluster behind one front: the cluster at `address` ("auto": the
    running one, None: RAY_ADDRESS or a new local one), or the one this process is connected to."""
    from overnight.parallel.dp import DataParallelEngine
    from overnight.parallel.ray import RayLinks, require_ray

    ray = require_ray()
    model = resolve_model(opts)
    if not ray.is_initialized():
        ray.init(address=address)
    links = RayLinks(
        replace(opts, data_parallel_size=1),
        num_replicas,
        build_engine,
        gpus_per_replica=gpus_per_replica,
        cpus_per_replica=cpus_per_replica,
    )
    return DataParallelEngine(links, model.source, model.tokenizer, model.grammars)


def _single_engine(opts: EngineOptions, model: ResolvedModel) -> EngineClient:
    from overnight.engine.kv_groups import KVCacheLayout, pool_tokens
    from overnight.loader.fit import check_weights_fit, linear_formats
    from overnight.runner.kv_pool import set_up_kv_pool
    from overnight.runner.model_runner import ModelRunner

    source = model.source
    t_start = time.perf_counter()
    if source.quantization is not None:
        log.info("quantization: %s", source.quantization.describe())
    device = pick_device(opts.device)
    if device.type == "cuda":
        from overnight.kernels.jit_watch import remember_compiles

        remember_compiles()  # a variant compiled mid-run is then logged by what changed from start-up's
    config = build_config(opts, source, device, device_memory_gib(device))
    fp8_linear, int_linear = linear_formats(source.quantization, device)
    check_int_parallel(source, config.parallel.tensor_parallel_size, int_linear)
    # Before any weight is allocated: a model too large is a sentence, not the kernel's OOM killer.
    tp = config.parallel.tensor_parallel_size
    rank_arch = None
    if tp > 1:  # one rank's weights, as apply_tp leaves them (replicated parts whole)
        from overnight.parallel.tp_shards import TPShards

        rank_arch = TPShards(source.arch, 0, tp).rank_weights_arch
    check_weights_fit(
        source.arch,
        config.model.dtype,
        device,
        source.served_name,
        tp,
        fp8_linear=fp8_linear,
        int_linear=int_linear,
        rank_arch=rank_arch,
        scheme=source.quantization,
    )
    if source.arch.is_encoder:
        from overnight.encoder.engine import EncoderEngine

        return EncoderEngine(config, source, model.tokenizer)
    sched = config.scheduler
    runner: ModelRunner | TPRunner
    if config.parallel.tensor_parallel_size > 1:  # rank processes load, size and allocate their shares
        from overnight.parallel.workers import TPRunner

        # Rank 0 masks structured outputs with this tokenizer (--tokenizer included), loaded there; none
        # without one.
        tok_path = source.tokenizer_path if model.tokenizer is not None else None
        runner = TPRunner(config, replace(source, tokenizer_path=tok_path))
    else:
        runner = ModelRunner(config, source, grammars=model.grammars)
    t_model = time.perf_counter()
    try:
        # One rank's shapes under tensor parallelism: its block scales are the runners' (kv_groups.py).
        arch = source.arch
        if config.parallel.tensor_parallel_size > 1:
            from overnight.parallel.tp_shards import TPShards

            arch = TPShards(source.arch, 0, config.parallel.tensor_parallel_size).local_arch
        layout = KVCacheLayout.from_arch(arch, sched.max_model_len)
        plan = set_up_kv_pool(runner, config.cache, sched, layout)
    except BaseException:
        runner.shutdown()
        raise
    log.info(
        "start-up: model %.1f s (weights%s), KV pool %.1f s (memory profile, warm-up, allocation, graphs)",
        t_model - t_start,
        " and their quantization" if source.quantization is not None else "",
        time.perf_counter() - t_model,
    )
    if device.type == "cuda" and config.parallel.tensor_parallel_size == 1:
        from overnight.kernels.jit_watch import log_compiles_after_startup

        # Start-up ran every kernel the model needs (the peak-memory step, the decode graphs): a compile
        # from here on is a new feature's first use, or a kernel specializing on a per-step value.
        log_compiles_after_startup(log)
    # Tokens the pool holds within the windows, and the sequences of max_model_len (windowed layers
    # hold only their window: engine/kv_groups.py).
    bs = config.cache.block_size
    tokens = pool_tokens(plan.num_blocks, layout.group_block_sizes(bs))
    per_seq = layout.blocks_per_sequence(sched.max_model_len, 1, bs)
    log.info(
        "KV pool: %d blocks = %d tokens, %.2f GiB, dtype %s; up to %.1f sequences of max_model_len %d",
        plan.num_blocks,
        tokens,
        plan.pool_bytes / 2**30,
        runner.kv_cache_dtype,
        plan.num_blocks / per_seq,
        sched.max_model_len,
    )
    return Engine(config, runner, source, plan, model.tokenizer, model.grammars)
