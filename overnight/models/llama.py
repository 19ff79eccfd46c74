"""The dense decoder of Llama (3.x, SmolLM2/3), Qwen2, Qwen3, Mistral / Ministral 3, Phi-3/4, Granite and
GLM-4, with fused qkv and gate/up projections.

Attribute names follow the HF checkpoint keys, except the two fused projections; load_weights maps the
checkpoint's separate q/k/v and gate/up tensors into them through packed_modules_mapping (and splits
checkpoints that store them fused: Phi-3's qkv_proj and gate_up_proj, GLM-4's gate_up_proj). The families
differ only in ModelArch fields, read into one LayerSpec per layer (models/layer_spec.py: its attention
kind and its RoPE) and a few block options (bias flags, norms, Granite's multipliers); loading lives in
models/checkpoint.py. OLMo 2/3 (models/olmo.py), Cohere (models/cohere.py), Apertus (models/apertus.py) and
the mixture-of-experts families (models/qwen3_moe.py, models/mixtral.py, models/glm4_moe.py, ...) are
LlamaForCausalLM with their own layer or MLP factory (LlamaForCausalLM.make_layer / make_mlp).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from overnight.arch import ModelArch
from overnight.attention.metadata import AttentionBatch
from overnight.layers.activation import SiluAndMul
from overnight.layers.layer_norm import LayerNormNoBias
from overnight.layers.norm import RMSNorm, sharded_rms_norm_pair
from overnight.layers.rotary import RotaryEmbedding
from overnight.models.checkpoint import load_packed_weights, split_fused_tensors, text_model_tensors
from overnight.models.layer_spec import LayerSpec, layer_specs, rotary_embeddings

# checkpoint projection name -> (fused parameter's module name, shard id inside it)
PACKED_MODULES_MAPPING: dict[str, tuple[str, str | int]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


# Inside each decoder layer: module -> the one linear layer that reads its output. A quantization pass
# may have the producer hand over its output already quantized (quant/apply.py).
LINEAR_INPUT_PRODUCERS: dict[str, str] = {
    "input_layernorm": "self_attn.qkv_proj",
    "post_attention_layernorm": "mlp.gate_up_proj",
    "mlp.act_fn": "mlp.down_proj",
}


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


# Builds the MLP of layer i: the dense families use dense_mlp everywhere; a mixture-of-experts family
# passes its own (models/qwen3_moe.py) and keeps everything else of these blocks.
MlpFactory = Callable[[ModelArch, int], nn.Module]


def dense_mlp(arch: ModelArch, layer_idx: int) -> nn.Module:
    return LlamaMLP(arch.hidden_size, arch.intermediate_size)


class Attention(nn.Module):
    """Grouped-query attention of every dense family, driven by the architecture's flags: a bias on
    q/k/v (Qwen2, some Llamas, GLM-4), a bias on o_proj (Llama's attention_bias covers it), an RMSNorm
    over each head of q and k before RoPE (Qwen3; after it with qk_norm_after_rope: Hunyuan) or over the
    whole q and k projections (OLMo 2/3), and the layer's own window or chunk and RoPE (LayerSpec);
    Llama 4's weightless q/k L2 norm after RoPE and its NoPE layers' position-dependent q scale
    (ModelArch.qk_l2_norm, attn_floor_scale); Command R+'s bias-free LayerNorm over each head of q and
    k, a weight row per head (norm_type "layer")."""

    def __init__(
        self, arch: ModelArch, layer_idx: int, spec: LayerSpec, rotary_emb: RotaryEmbedding | None
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        # Head counts are attributes (not re-derived from arch) so tensor parallelism can shrink them.
        self.num_heads = arch.num_attention_heads
        self.num_kv_heads = arch.num_key_value_heads
        self.head_dim = arch.head_dim
        self.scale = arch.attention_multiplier or arch.head_dim**-0.5  # Granite: attention_multiplier
        self.layer_attention = spec.attention
        self.qkv_proj = nn.Linear(arch.hidden_size, arch.q_size + 2 * arch.kv_size, bias=arch.attention_bias)
        self.o_proj = nn.Linear(arch.q_size, arch.hidden_size, bias=arch.o_proj_bias)
        # Per head: over head_dim only, so the weights are shared by all heads and survive head sharding.
        # Whole (OLMo): over all heads of q (and of k) together.
        self.qk_norm_whole = arch.qk_norm and arch.qk_norm_whole
        q_dim, k_dim = (arch.q_size, arch.kv_size) if self.qk_norm_whole else (arch.head_dim, arch.head_dim)
        # Command R+ (norm_type "layer"): a bias-free LayerNorm over each head with a weight row per head,
        # applied before RoPE outside the rotary layer (whose fused kernel is RMSNorm's).
        self.qk_layer_norm = arch.qk_norm and arch.norm_type == "layer"
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if self.qk_layer_norm:
            self.q_norm = LayerNormNoBias((self.num_heads, self.head_dim), eps=arch.layer_norm_eps)
            self.k_norm = LayerNormNoBias((self.num_kv_heads, self.head_dim), eps=arch.layer_norm_eps)
        elif arch.qk_norm:
            self.q_norm = RMSNorm(q_dim, eps=arch.rms_norm_eps)
            self.k_norm = RMSNorm(k_dim, eps=arch.rms_norm_eps)
        self.qk_norm_after_rope = arch.qk_norm_after_rope and not self.qk_norm_whole
        # Whole norms under tensor parallelism (parallel/tp.py sets these): this rank holds 1/world of
        # the heads, and qk_norm_reduce sums the per-token squares over the ranks (layers/norm.py).
        self.qk_norm_world = 1
        self.qk_norm_reduce: Callable[[torch.Tensor], object] | None = None
        self.rotary_emb = rotary_emb
        # Ministral 3 (llama_4_scaling_beta): q grows with the position, by 1 + beta ln(1 + p // original).
        scaling = arch.rope_scaling_dict() or {}
        beta, original = scaling.get("llama_4_scaling_beta"), scaling.get("original_max_position_embeddings")
        self.q_position_scaling = (
            (float(beta), float(original))
            if isinstance(beta, float) and isinstance(original, float) and beta and rotary_emb is not None
            else None
        )
        # Llama 4: the RoPE layers' q and k L2-normalized per head after the rotation (no weight); the
        # NoPE layers' q scaled by 1 + attn_scale * ln(1 + floor((p + 1) / floor_scale)).
        self.qk_l2_norm_eps = arch.rms_norm_eps if arch.qk_l2_norm and rotary_emb is not None else None
        self.q_temperature = (
            (arch.attn_floor_scale, arch.attn_scale) if arch.attn_floor_scale and rotary_emb is None else None
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor, attn: AttentionBatch) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q_norm, k_norm = self.q_norm, self.k_norm
        if self.qk_norm_whole and q_norm is not None and k_norm is not None:
            q, k, v = qkv.split([self.q_norm_size, self.k_norm_size, self.k_norm_size], dim=-1)
            n = qkv.shape[0]
            if self.qk_norm_reduce is None:
                q, k = q_norm(q), k_norm(k)
            else:
                rms_q, rms_k = cast(RMSNorm, q_norm), cast(RMSNorm, k_norm)  # whole norms are RMSNorms
                q, k = sharded_rms_norm_pair(q, k, rms_q, rms_k, self.qk_norm_world, self.qk_norm_reduce)
            q = q.view(n, -1, self.head_dim)
            k = k.view(n, -1, self.head_dim)
            v = v.view(n, -1, self.head_dim)
            q_norm = k_norm = None
        else:
            q, k, v = split_qkv(qkv, self.num_heads, self.num_kv_heads, self.head_dim)
        if self.qk_layer_norm and q_norm is not None and k_norm is not None:
            q, k = q_norm(q), k_norm(k)
            q_norm = k_norm = None
        if self.rotary_emb is not None and not self.qk_norm_after_rope:
            # The norms run inside the rotary layer, so the GPU path fuses norm + rotation into one kernel.
            # (Any norm left here is an RMSNorm: Command R+'s LayerNorms ran above.)
            q, k = self.rotary_emb(
                positions, q, k, q_norm=cast("RMSNorm | None", q_norm), k_norm=cast("RMSNorm | None", k_norm)
            )
        elif self.rotary_emb is not None:  # Hunyuan: rotate, then normalize each head
            q, k = self.rotary_emb(positions, q, k)
            if q_norm is not None and k_norm is not None:
                q, k = q_norm(q), k_norm(k)
        elif q_norm is not None and k_norm is not None:
            q, k = q_norm(q), k_norm(k)
        if self.q_position_scaling is not None:
            beta, original = self.q_position_scaling
            factor = 1 + beta * torch.log(1 + torch.floor(positions / original))
            q = q * factor.to(q.dtype)[:, None, None]
        if self.qk_l2_norm_eps is not None:
            q, k = l2_norm(q, self.qk_l2_norm_eps), l2_norm(k, self.qk_l2_norm_eps)
        if self.q_temperature is not None:  # in float32, as transformers computes it
            floor_scale, attn_scale = self.q_temperature
            factor = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
            q = (q * factor[:, None, None]).to(q.dtype)
        o = attn(self.layer_idx, q, k, v, self.scale, layer=self.layer_attention)
        return self.o_proj(o.flatten(1))

    @property
    def q_norm_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def k_norm_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, in float32 and cast back (Llama 4's weightless q/k norm). torch's
    rms_norm without a weight: on the CPU bit for bit transformers' x * rsqrt(mean(x^2) + eps), on CUDA
    one fused kernel instead of five."""
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).type_as(x)


def split_qkv(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[T, (Hq + 2 Hkv) * D] -> q [T, Hq, D], k and v [T, Hkv, D] (views; v is not contiguous)."""
    n = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return q.view(n, -1, head_dim), k.view(n, -1, head_dim), v.view(n, -1, head_dim)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)). GLM-4's sandwich adds a norm on each
    sub-block's output (post_self_attn_layernorm, post_mlp_layernorm); Granite scales each output by
    residual_multiplier before its residual add."""

    def __init__(
        self,
        arch: ModelArch,
        layer_idx: int,
        spec: LayerSpec,
        rotary_emb: RotaryEmbedding | None,
        make_mlp: MlpFactory = dense_mlp,
    ) -> None:
        super().__init__()
        self.self_attn = Attention(arch, layer_idx, spec, rotary_emb)
        self.mlp = make_mlp(arch, layer_idx)
        self.input_layernorm = RMSNorm(arch.hidden_size, eps=arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, eps=arch.rms_norm_eps)
        sandwich = arch.norm_placement == "sandwich"
        self.post_self_attn_layernorm = RMSNorm(arch.hidden_size, eps=arch.rms_norm_eps) if sandwich else None
        self.post_mlp_layernorm = RMSNorm(arch.hidden_size, eps=arch.rms_norm_eps) if sandwich else None
        self.residual_multiplier = arch.residual_multiplier

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, attn: AttentionBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual add of each sub-block is deferred into the next norm (fused add + norm); the
        # layer returns the un-added pair and the next layer, or the final norm, adds them.
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, attn)
        if self.post_self_attn_layernorm is not None:
            x = self.post_self_attn_layernorm(x)
        if self.residual_multiplier != 1.0:
            x = x * self.residual_multiplier
        x, residual = self.post_attention_layernorm(x, residual)
        x = self.mlp(x)
        if self.post_mlp_layernorm is not None:
            x = self.post_mlp_layernorm(x)
        if self.residual_multiplier != 1.0:
            x = x * self.residual_multiplier
        return x, residual


# Builds decoder layer i from its description and RoPE table (LlamaDecoderLayer, OLMo's post-norm one).
LayerFactory = Callable[[ModelArch, int, LayerSpec, "RotaryEmbedding | None", MlpFactory], nn.Module]


class LlamaModel(nn.Module):
    def __init__(
        self, arch: ModelArch, make_mlp: MlpFactory = dense_mlp, make_layer: LayerFactory = LlamaDecoderLayer
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        specs = layer_specs(arch)
        tables = rotary_embeddings(arch, specs)
        self.layers = nn.ModuleList(
            make_layer(arch, i, spec, tables[spec.rope] if spec.rope else None, make_mlp)
            for i, spec in enumerate(specs)
        )
        self.norm = final_norm(arch)
        self.embedding_multiplier = arch.embedding_multiplier  # Granite

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBatch) -> torch.Tensor:
        return self.decode(self.embed_tokens(input_ids), positions, attn)

    def decode(self, x: torch.Tensor, positions: torch.Tensor, attn: AttentionBatch) -> torch.Tensor:
        """The layers over input embeddings x [T, hidden] (an image model's, images merged in)."""
        if self.embedding_multiplier != 1.0:
            x = x * self.embedding_multiplier
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, attn)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    """The decoder plus LM head of the dense families (the architecture's fields say which)."""

    packed_modules_mapping = PACKED_MODULES_MAPPING
    linear_input_producers = LINEAR_INPUT_PRODUCERS
    # Each layer's MLP: a mixture-of-experts family on these blocks names its own (Qwen3-MoE, GLM-4.5,
    # ERNIE 4.5, Hunyuan; Apertus' xIELU MLP)
    make_mlp: MlpFactory = staticmethod(dense_mlp)
    # Each decoder layer: a family with other residual wiring names its own (OLMo's post-norm blocks,
    # Cohere's parallel ones)
    make_layer: LayerFactory = LlamaDecoderLayer

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.arch = arch
        # The checkpoint's sizes: tensor parallelism replaces self.arch with one rank's (parallel/tp.py)
        self.checkpoint_arch = arch
        self.checkpoint_kv_scales: dict[int, tuple[float, float]] = {}  # filled by load_weights
        self.model = LlamaModel(arch, make_mlp=self.make_mlp, make_layer=self.make_layer)
        self.lm_head = make_lm_head(arch, self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBatch) -> torch.Tensor:
        return self.model(input_ids, positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return scaled_logits(self.arch, self.lm_head(hidden))

    def rename_checkpoint(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Applied to the checkpoint stream before FP8 conversion and tensor-parallel slicing
        (loader/model_loader.checkpoint_weights): Phi-3's and GLM-4's fused tensors become the separate
        q/k/v and gate/up ones, which online FP8 quantizes into the fused parameter's row scales."""
        return split_fused_tensors(self.checkpoint_arch, weights)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        # split again for callers that bypass checkpoint_weights (split names pass unchanged)
        load_packed_weights(self, split_fused_tensors(self.arch, weights))


def scaled_logits(arch: ModelArch, logits: torch.Tensor) -> torch.Tensor:
    if arch.logit_scale != 1.0:  # Cohere
        logits = logits * arch.logit_scale
    return logits if arch.logits_scaling == 1.0 else logits / arch.logits_scaling  # Granite


def final_norm(arch: ModelArch) -> nn.Module:
    """The norm after the last layer: RMSNorm, or Cohere's bias-free LayerNorm (norm_type "layer")."""
    if arch.norm_type == "layer":
        return LayerNormNoBias(arch.hidden_size, eps=arch.layer_norm_eps)
    return RMSNorm(arch.hidden_size, eps=arch.rms_norm_eps)


class Mistral3ForConditionalGeneration(LlamaForCausalLM):
    """The text model of a Mistral 3 checkpoint whose config.json has no vision_config (one with it is
    models/mistral3_vl.py's image model): the decoder's tensors are renamed to the plain layout, any
    vision tower's and projector's skipped (one log line says how many)."""

    @staticmethod
    def rename_checkpoint(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Applied to the checkpoint stream before FP8 conversion and tensor-parallel slicing
        (loader/model_loader.checkpoint_weights)."""
        return text_model_tensors(weights)


def make_lm_head(arch: ModelArch, embed_tokens: nn.Embedding) -> nn.Linear:
    if not arch.tie_word_embeddings:
        return nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
    # Tied: allocate nothing (meta) and point the weight at the embedding table.
    head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False, device="meta")
    head.weight = embed_tokens.weight
    return head
