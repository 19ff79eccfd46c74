"""Engine configuration: frozen dataclasses built once at the edge (LLM(), the CLI) and passed down.

Each part of the engine takes only the sub-config it needs. Facts learned at run time (the number of KV
blocks, the stop ids of a checkpoint) are return values or constructor arguments, never written back here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from overnight.arch import ModelArch
from overnight.options import DEFAULT_BLOCK_SIZE
from overnight.options import EngineOptions as _Defaults  # the option table holds every default


@dataclass(frozen=True)
class PoolerConfig:
    """How a pooling model turns a prompt's hidden states into one vector (the model's
    sentence-transformers config, or the options that override it)."""

    pooling_type: str  # "LAST" (the last token's state) | "MEAN" (over the prompt) | "CLS" (the first)
    normalize: bool  # L2-normalize (the default of requests that do not say)
    # Matryoshka: the model may be cut to fewer dimensions; matryoshka_dimensions lists the sizes it
    # was trained for (None: any size).
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    classifier: ClassifierConfig | None = None  # set for sequence classifiers (scores, classes)
    # sentence-transformers Dense modules applied to the pooled vector, in order (EmbeddingGemma's
    # 2_Dense, 3_Dense), before the Matryoshka cut and normalization.
    dense: tuple[DenseLayer, ...] = ()

    def output_size(self, hidden_size: int) -> int:
        """The embedding's width: the last Dense layer's, else the model's hidden size."""
        return self.dense[-1].out_features if self.dense else hidden_size


@dataclass(frozen=True)
class DenseLayer:
    """One sentence-transformers Dense module: y = activation(W x + b), its weights in `folder`
    (model.safetensors or pytorch_model.bin, keys linear.weight / linear.bias)."""

    folder: str
    in_features: int
    out_features: int
    bias: bool
    activation: str  # "identity" | "tanh"


@dataclass(frozen=True)
class ClassifierConfig:
    """A sequence classifier's outputs (cross-encoders score with one label): how its logits become
    what requests return, as the checkpoint says (config.json's sentence-transformers activation, else
    sigmoid for one label, as sentence-transformers' CrossEncoder and vLLM apply, softmax for several)."""

    num_labels: int
    activation: str  # "sigmoid" | "softmax" | "none"
    labels: tuple[str, ...] = ()  # id2label, in label order ("LABEL_0", ... when the config names none)


# How a score head is made from a causal LM's head (vLLM's names): "from_2_way_softmax" takes two tokens
# [false, true] and gives one label, row_true - row_false, so sigmoid(logit) = softmax over the two
# tokens' logits at the true token (Qwen3-Reranker's P("yes")); "no_post_processing" gives one label per
# token, its row (softmax over them for several, sigmoid for one: bge-reranker-v2-gemma's "Yes").
LM_HEAD_METHODS = ("from_2_way_softmax", "no_post_processing")


@dataclass(frozen=True)
class LMHeadClassifier:
    """A sequence classifier over a causal-LM checkpoint (no score.weight in it): its head is the LM
    head's rows of `tokens` (config.json / hf_overrides' classifier_from_token), read at load. token_ids
    are the tokenizer's ids of those tokens, looked up once the tokenizer is loaded (build.py)."""

    method: str  # one of LM_HEAD_METHODS
    tokens: tuple[str, ...]
    token_ids: tuple[int, ...] = ()

    @property
    def num_labels(self) -> int:
        return 1 if self.method == "from_2_way_softmax" else len(self.tokens)


@dataclass(frozen=True)
class ModelConfig:
    """What to load: the source's path, the architecture read from it, the compute dtype, and what the
    engine does with it (runner: "generate" text, or "pooling" into one vector per prompt)."""

    model: str  # folder, .gguf file, or a preset name with load_format="dummy"
    arch: ModelArch
    dtype: torch.dtype
    seed: int = _Defaults.seed  # dummy weights' seed; unseeded requests' draws
    # "fp8": linear layers hold FP8 weights (asked for, or the checkpoint's own quantization_config; the
    # scheme itself travels with the ModelSource); "awq" / "gptq" / "compressed-tensors": the
    # checkpoint's integer weights (quant/int_scheme.py); None: weights in `dtype`.
    quantization: str | None = None
    runner: str = "generate"  # resolved: the option's "auto" is decided by the architecture
    pooler: PoolerConfig | None = None  # set when runner == "pooling"


# mamba_ssm_cache_dtype -> the storage dtype of the delta-rule state. auto is float32, as transformers
# keeps the state (and as overnight did before the option): a 16-bit state halves the state pool's bytes
# at the cost of one rounding per step (the kernels compute in float32 and round as they store).
SSM_STATE_DTYPES: dict[str, torch.dtype] = {
    "auto": torch.float32,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def ssm_state_dtype(name: str) -> torch.dtype:
    """The delta-rule state's storage dtype for a mamba_ssm_cache_dtype value; ValueError naming the
    allowed values for any other (the option's choices refuse it earlier, for users)."""
    if name not in SSM_STATE_DTYPES:
        raise ValueError(f"mamba_ssm_cache_dtype must be one of {', '.join(SSM_STATE_DTYPES)}; got {name!r}")
    return SSM_STATE_DTYPES[name]


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = DEFAULT_BLOCK_SIZE  # resolved from the option by options.block_size_for
    gpu_memory_utilization: float = _Defaults.gpu_memory_utilization
    kv_cache_dtype: str = _Defaults.kv_cache_dtype
    kv_cache_memory_bytes: int | None = _Defaults.kv_cache_memory_bytes
    enable_prefix_caching: bool = _Defaults.enable_prefix_caching
    calculate_kv_scales: bool = _Defaults.calculate_kv_scales
    # Hybrid models' delta-rule state storage (SSM_STATE_DTYPES); unused by models without linear layers.
    mamba_ssm_cache_dtype: str = _Defaults.mamba_ssm_cache_dtype

    @property
    def ssm_state_dtype(self) -> torch.dtype:
        return ssm_state_dtype(self.mamba_ssm_cache_dtype)


DENSE_TAIL_SHARE = 1 / 16  # a dense model's admission tail share (engine/admission.py)
# Tokens computed that cost what one step's weight reads cost, for a dense model (engine/admission.py
# step_tokens): Qwen3-8B on an H200, 3.8 ms a step over 25 us a token.
DENSE_STEP_TOKENS = 150.0


def decode_row_cap(caps: tuple[tuple[int, int], ...], rows: int) -> int | None:
    """The cap of SchedulerConfig.decode_row_caps that holds a decode step of `rows` requests (cap < rows
    <= upto), or None."""
    return next((cap for cap, upto in caps if cap < rows <= upto), None)


@dataclass(frozen=True)
class SchedulerConfig:
    # Resolved limits (the options' None means "by device and mode"; limits.py decides).
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    max_model_len: int = 4096
    enable_chunked_prefill: bool = _Defaults.enable_chunked_prefill
    admission: str = _Defaults.admission  # "planned": engine/admission.py; "greedy": whatever fits now
    # Planned admission's tail share (engine/admission.py tail_share, from the model): where a pool
    # larger by this share holds the job in one wave fewer, the plan may overcommit the real one.
    admission_tail_share: float = DENSE_TAIL_SHARE
    # And the tokens computed a step's weight reads are worth (engine/admission.py step_tokens): the
    # overcommit is taken only where the steps it saves outweigh what it recomputes.
    admission_step_tokens: float = DENSE_STEP_TOKENS
    # (cap, upto) pairs: a step of D decodes, cap < D <= upto, while requests wait, computes cap of them
    # and the last admitted wait a step: where the GEMMs pad D to whole row tiles, fewer rows cost less
    # time per token (kernels/w4a16_gemm.py decode_row_caps; build.py sets them from the model's layers).
    decode_row_caps: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = _Defaults.tensor_parallel_size


@dataclass(frozen=True)
class RunnerConfig:
    device: str = "cpu"  # "cpu" | "cuda" | "cuda:N" (resolved: the option's None means "cuda if available")
    attention_backend: str = _Defaults.attention_backend
    attention_variant: str = _Defaults.attention_variant  # kernel configs by name (attention/variants.py)
    enforce_eager: bool = _Defaults.enforce_eager
    # Decode steps up to this batch size replay CUDA graphs; larger ones run eagerly, where launching
    # hundreds of kernels from Python costs tens of milliseconds a step. Capped by max_num_seqs.
    max_capture_batch_size: int = 1024


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters (overnight/lora/): max_loras device slots, each sized for max_lora_rank; a host
    cache of max_cpu_loras loaded adapters (>= max_loras)."""

    max_loras: int = _Defaults.max_loras
    max_lora_rank: int = _Defaults.max_lora_rank
    max_cpu_loras: int = _Defaults.max_loras


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    lora: LoRAConfig | None = None  # None: LoRA disabled (no wrapped layers, no slots)
