"""The engine flags every command shares (--model, --max-num-seqs, ...), mapped onto EngineOptions."""

from __future__ import annotations

import argparse

from overnight.engine.builder import EngineOptions


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        help="HF folder, repo id in the local HF cache, .gguf file, or a preset with "
        "--load-format dummy (default: the embedded SmolLM2-135M-Instruct)",
    )
    g.add_argument("--tokenizer", default=None)
    g.add_argument("--served-model-name", default=None)
    g.add_argument(
        "--dtype", default="auto", choices=["auto", "bfloat16", "bf16", "float16", "half", "float32", "float"]
    )
    g.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"])
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"])
    g.add_argument(
        "--calculate-kv-scales",
        action="store_true",
        help="fp8 KV cache: set each layer's scales from the first prefill (default: the "
        "checkpoint's scales, else 1.0)",
    )
    g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    g.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill", action="store_false")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    g.add_argument("--skip-tokenizer-init", action="store_true")
    g.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda when available)")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    g.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="step the engine in a process of its own (default: on for serve and its sweeps, off otherwise)",
    )


def options_from_args(args: argparse.Namespace, mode: str) -> EngineOptions:
    return EngineOptions(
        model=args.model,
        tokenizer=args.tokenizer,
        served_model_name=args.served_model_name,
        dtype=args.dtype,
        load_format=args.load_format,
        seed=args.seed,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        kv_cache_dtype=args.kv_cache_dtype,
        calculate_kv_scales=args.calculate_kv_scales,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_size=args.data_parallel_size,
        skip_tokenizer_init=args.skip_tokenizer_init,
        device=args.device,
        enforce_eager=args.enforce_eager,
        attention_backend=args.attention_backend,
        mode=mode,
        engine_process=args.engine_process,
    )
