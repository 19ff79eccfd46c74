"""Engine configuration: frozen dataclasses built once at the edge (LLM(), the CLI) and passed down.

Each part of the engine takes only the sub-config it needs. Facts learned at run time (the number of KV
blocks, the stop ids of a checkpoint) are return values or constructor arguments, never written back here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from overnight.options import DEFAULT_BLOCK_SIZE
from overnight.options import EngineOptions as _Defaults  # the option table holds every default


@dataclass(frozen=True)
class ModelArch:
    """The architecture of a transformer, named as in HF config.json: a decoder, or (is_encoder) a
    BERT-style encoder."""

    architecture: str  # "llama" | "qwen2" | "qwen3" | "qwen3_moe" | "bert"
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
    # Mixture of experts (Qwen3-MoE). num_experts == 0: every layer has the dense MLP of
    # intermediate_size; otherwise the layers that is_moe_layer() names route each token to
    # num_experts_per_tok of num_experts MLPs of moe_intermediate_size, the others stay dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # rescale the chosen experts' softmax weights to sum to 1
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # Per-layer attention kinds, HF's `layer_types` names: "full_attention" or "sliding_attention" (a
    # window of sliding_window tokens, the query's own included). () means every layer is full.
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    # KV sharing (Gemma 4): the last num_kv_shared_layers layers write no cache of their own and read
    # the cache of the last earlier layer of their kind (kv_source_layer).
    num_kv_shared_layers: int = 0
    # Hybrid linear attention (Qwen3.5 / Qwen3.6, Qwen3-Next; models/qwen3_next.py): the layers that
    # layer_types names "linear_attention" are Gated DeltaNet layers, which keep a fixed-size state per
    # request (runner/state_cache.py) and no KV cache; the others are full attention with an output
    # gate, (1 + w) RMSNorms and RoPE over the first hybrid_rotary_dim dims of each head.
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    hybrid_rotary_dim: int = 0
    shared_expert_intermediate_size: int = 0  # a sigmoid-gated shared expert beside the routed ones
    # Encoders (BERT): bidirectional attention over whole prompts, no KV cache, LayerNorm, learned
    # absolute positions and token-type (segment) embeddings.
    is_encoder: bool = False
    type_vocab_size: int = 0
    layer_norm_eps: float = 1e-12

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def layer_window(self, layer_idx: int) -> int | None:
        """The sliding window of layer `layer_idx`, None for full attention."""
        if self.layer_types and self.layer_types[layer_idx] == "sliding_attention":
            return self.sliding_window
        return None

    def kv_source_layer(self, layer_idx: int) -> int:
        """The layer whose KV cache layer `layer_idx` reads: itself, unless KV-shared."""
        first_shared = self.num_hidden_layers - self.num_kv_shared_layers
        if layer_idx < first_shared:
            return layer_idx
        kind = self.layer_types[layer_idx] if self.layer_types else "full_attention"
        kinds = self.layer_types or ("full_attention",) * self.num_hidden_layers
        return max(i for i in range(first_shared) if kinds[i] == kind)

    def is_linear_layer(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` is linear attention (a state per request, no KV cache)."""
        return bool(self.layer_types) and self.layer_types[layer_idx] == "linear_attention"

    @property
    def num_linear_layers(self) -> int:
        return sum(self.is_linear_layer(i) for i in range(self.num_hidden_layers))

    def linear_state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """One linear layer's state of one request: (conv (K - 1, conv channels), delta rule (Hv, dk, dv))."""
        conv_dim = 2 * self.linear_num_key_heads * self.linear_key_head_dim
        conv_dim += self.linear_num_value_heads * self.linear_value_head_dim
        ssm = (self.linear_num_value_heads, self.linear_key_head_dim, self.linear_value_head_dim)
        return (self.linear_conv_kernel_dim - 1, conv_dim), ssm

    def linear_state_bytes(self) -> int:
        """Bytes of one request's states over every linear layer (float32)."""
        (k, c), (h, dk, dv) = self.linear_state_shapes()
        return self.num_linear_layers * 4 * (k * c + h * dk * dv)

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` has the sparse MLP (HF's rule for Qwen3-MoE)."""
        return (
            self.num_experts > 0
            and (layer_idx + 1) % self.decoder_sparse_step == 0
            and layer_idx not in self.mlp_only_layers
        )

    def mlp_params(self, active_only: bool = False) -> int:
        """Weights of all layers' MLPs, routers included. active_only: only the experts one token goes
        through (num_experts_per_tok per sparse layer), the weights its forward pass multiplies by."""
        dense = 3 * self.hidden_size * self.intermediate_size
        expert = 3 * self.hidden_size * self.moe_intermediate_size
        total = 0
        for i in range(self.num_hidden_layers):
            if self.is_moe_layer(i):
                used = self.num_experts_per_tok if active_only else self.num_experts
                total += self.num_experts * self.hidden_size + used * expert
                if self.shared_expert_intermediate_size:  # and its one-output gate
                    total += 3 * self.hidden_size * self.shared_expert_intermediate_size + self.hidden_size
            else:
                total += dense
        return total

    def rope_scaling_dict(self) -> dict[str, float] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    def kv_bytes_per_token(self, elem_bytes: int) -> int:
        """KV-cache bytes one token takes over all layers (K and V, every KV head)."""
        return 2 * (self.num_hidden_layers - self.num_linear_layers) * self.kv_size * elem_bytes

    def num_linear_parameters(self, active_only: bool = False) -> int:
        """Weights of the projections (q/k/v/o and the MLPs, routers included), all layers; active_only:
        with only the experts one token goes through."""
        h = self.hidden_size
        attention = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.num_linear_layers:  # hybrid: gated attention (q_proj gives q and a gate) + DeltaNet layers
            full = self.num_hidden_layers - self.num_linear_layers
            (_, conv), _ = self.linear_state_shapes()
            heads, value = (
                self.linear_num_value_heads,
                self.linear_num_value_heads * self.linear_value_head_dim,
            )
            gdn = h * (conv + value + 2 * heads) + value * h
            return (
                (attention + h * self.q_size) * full
                + gdn * self.num_linear_layers
                + self.mlp_params(active_only)
            )
        return attention * self.num_hidden_layers + self.mlp_params(active_only)

    def weight_bytes(
        self,
        dtype_bytes: int,
        fp8_linear: bool = False,
        fp8_experts: bool = False,
        int_linear: tuple[int, int, bool] | None = None,
    ) -> int:
        """Bytes of every weight in dtype; fp8_linear: the nn.Linear projections (attention and dense MLPs)
        take one byte each plus a float32 scale per output row (quant/); fp8_experts: the stacked MoE
        experts too, as they are once loaded (they load in dtype and are quantized afterwards, so the
        load itself needs them in dtype). int_linear (bits, group size or 0 for one group per row, whether
        the experts are packed too): the projections packed at `bits` per weight plus a float32 scale
        and zero point per row and group (quant/int_linear.py, quant/int_moe.py); unpacked experts
        stay in dtype (dequantized at load)."""
        total = self.num_parameters() * dtype_bytes
        params, rows = self._dense_linear_shape()
        if int_linear is not None:
            bits, group, experts = int_linear
            if experts:
                sparse = sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))
                params += sparse * self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size
                rows += sparse * self.num_experts * (2 * self.moe_intermediate_size + self.hidden_size)
            groups = params // group if group else rows
            return total - params * dtype_bytes + params * bits // 8 + 8 * groups
        if not fp8_linear:
            return total
        if fp8_experts:
            sparse = sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))
            per_expert = 3 * self.hidden_size * self.moe_intermediate_size
            expert_rows = 2 * self.moe_intermediate_size + self.hidden_size
            total -= sparse * self.num_experts * (per_expert * (dtype_bytes - 1) - 4 * expert_rows)
        return total - params * (dtype_bytes - 1) + 4 * rows

    def _dense_linear_shape(self) -> tuple[int, int]:
        """(weights, output rows) of the projections quantized layers replace: attention and dense MLPs."""
        h = self.hidden_size
        per_layer_rows = self.q_size + 2 * self.kv_size + h  # q/k/v rows and o_proj's
        params = (h * (self.q_size + 2 * self.kv_size) + self.q_size * h) * self.num_hidden_layers
        rows = per_layer_rows * self.num_hidden_layers
        for i in range(self.num_hidden_layers):
            if not self.is_moe_layer(i):
                params += 3 * h * self.intermediate_size
                rows += 2 * self.intermediate_size + h
        return params, rows

    def num_parameters(self) -> int:
        """Every parameter: embeddings, LM head (unless tied), projections, biases and norms."""
        h = self.hidden_size
        per_layer = 2 * h  # the two RMSNorms
        if self.attention_bias:
            per_layer += self.q_size + 2 * self.kv_size
        if self.o_proj_bias:
            per_layer += h
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        hybrid = 0
        if self.num_linear_layers:  # DeltaNet layers: conv, A_log, dt_bias, output norm; no q/k norm
            (k1, conv), _ = self.linear_state_shapes()
            gdn = conv * (k1 + 1) + 2 * self.linear_num_value_heads + self.linear_value_head_dim
            hybrid = self.num_linear_layers * (gdn - (2 * self.head_dim if self.qk_norm else 0))
        return hybrid + (
            self.vocab_size * h + head + self.num_linear_parameters() + self.num_hidden_layers * per_layer + h
        )


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


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = DEFAULT_BLOCK_SIZE  # resolved from the option by options.block_size_for
    gpu_memory_utilization: float = _Defaults.gpu_memory_utilization
    kv_cache_dtype: str = _Defaults.kv_cache_dtype
    kv_cache_memory_bytes: int | None = _Defaults.kv_cache_memory_bytes
    enable_prefix_caching: bool = _Defaults.enable_prefix_caching
    calculate_kv_scales: bool = _Defaults.calculate_kv_scales


@dataclass(frozen=True)
class SchedulerConfig:
    # Resolved limits (the options' None means "by device and mode"; limits.py decides).
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    max_model_len: int = 4096
    enable_chunked_prefill: bool = _Defaults.enable_chunked_prefill


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
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
