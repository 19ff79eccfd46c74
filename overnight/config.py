"""Engine configuration: frozen dataclasses built once at the edge (LLM(), the CLI) and passed down.

Each part of the engine takes only the sub-config it needs. Facts learned at run time (the number of KV
blocks, the stop ids of a checkpoint) are return values or constructor arguments, never written back here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class ModelArch:
    """The architecture of a decoder-only transformer, named as in HF config.json."""

    architecture: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # Llama 3 style frequency scaling: {"factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}; None means plain RoPE.
    rope_scaling: tuple[tuple[str, float], ...] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on the q/k/v projections (Qwen2; Llama's attention_bias)
    o_proj_bias: bool = False  # bias on o_proj (Llama's attention_bias; never Qwen2)
    qk_norm: bool = False  # RMSNorm on each head of q and k (Qwen3)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def rope_scaling_dict(self) -> dict[str, float] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None


@dataclass(frozen=True)
class ModelConfig:
    """What to load and how: the source, the architecture read from it, the compute dtype."""

    model: str  # folder, repo id in the HF cache, .gguf file, or a preset name with load_format="dummy"
    arch: ModelArch
    dtype: torch.dtype
    load_format: str = "auto"  # auto | safetensors | gguf | dummy
    tokenizer: str | None = None  # where the tokenizer lives; None when skip_tokenizer_init
    max_model_len: int = 4096
    seed: int = 0
    # "fp8": linear layers hold FP8 weights (asked for, or the checkpoint's own quantization_config;
    # the scheme itself travels with the ModelSource); None: weights in `dtype`.
    quantization: str | None = None


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"  # auto | fp8 | fp8_e4m3 | fp8_e5m2
    kv_cache_memory_bytes: int | None = None  # set the pool size directly, overriding utilization
    enable_prefix_caching: bool = True
    calculate_kv_scales: bool = False  # fp8 cache: set each layer's scales from the first prefill


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    max_model_len: int = 4096
    enable_chunked_prefill: bool = True


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1


@dataclass(frozen=True)
class RunnerConfig:
    device: str = "cpu"  # "cpu" | "cuda" | "cuda:N"
    attention_backend: str = "auto"  # auto (triton on CUDA, torch elsewhere) | torch | triton
    enforce_eager: bool = False  # no CUDA graphs
    # Decode steps up to this batch size replay CUDA graphs; larger ones run eagerly, where launching
    # hundreds of kernels from Python costs tens of milliseconds a step. Capped by max_num_seqs.
    max_capture_batch_size: int = 1024


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
