"""Liquid AI's LFM2 hybrids (`Lfm2ForCausalLM`: LFM2-350M, -700M, -1.2B, -2.6B; `Lfm2MoeForCausalLM`:
LFM2-8B-A1B): most layers are gated short convolutions, a few (config.json's layer_types
"full_attention", or full_attn_idxs) are attention.

    layer = x + mixer(operator_norm(x)), then + feed_forward(ffn_norm(.))
    mixer: the short conv   in_proj -> B | C | x (hidden each); u = B * x;
                            y = C * (depthwise causal conv of K = conv_L_cache taps over u); out_proj(y)
           or attention     Llama's (models/llama.py) with RMSNorm over each head of q and k before RoPE
    feed_forward: SwiGLU, w2(silu(w1 x) * w3 x), its width auto-adjusted from intermediate_size; in
           LFM2-MoE the first num_dense_layers keep it (intermediate_size as given), the others route
           each token to top-k experts (sigmoid scores; a learned expert_bias only chooses; the chosen
           scores renormalized with eps 1e-6, times routed_scaling_factor): GLM-4.5's grouped sigmoid
           router with one group (layers/moe_grouped_router.py) and the stacked experts (layers/moe.py)
    final norm (embedding_norm), LM head tied to the embeddings

The conv's state per request is its last K - 1 inputs (u, not x), held in the hybrid models' state cache
(runner/state_cache.py: conv [slots, K - 1, hidden] float32, an empty ssm pool); the ops are the Mamba2 /
Gated DeltaNet conv ops without their SiLU (layers/short_conv_ops.py).

The blocks are Llama's (LlamaModel with this file's decoder layer): the checkpoint's names are renamed as
they load (_RENAMES: operator_norm -> input_layernorm, feed_forward -> mlp and its w1 / w3 / w2 (an
expert's too) -> gate / up / down_proj, expert_bias -> the router's e_score_correction_bias,
self_attn.out_proj -> o_proj, q_layernorm -> q_norm, embedding_norm -> the final norm), so fused qkv and
gate/up projections, stacked experts, quantization and the attention backends apply unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from overnight.arch import ModelArch
from overnight.attention.metadata import AttentionBatch
from overnight.errors import ModelLoadError
from overnight.layers.gated_delta_ops import decode_then_prefill
from overnight.layers.norm import RMSNorm
from overnight.layers.rotary import RotaryEmbedding
from overnight.layers.short_conv_ops import ShortConvLayer, short_conv_ops
from overnight.models.checkpoint import EXPERT_TENSORS, load_packed_weights
from overnight.models.field_readers import rope_params
from overnight.models.glm4_moe import Glm4MoeMoE
from overnight.models.layer_spec import LayerSpec
from overnight.models.llama import (
    PACKED_MODULES_MAPPING,
    Attention,
    LlamaModel,
    MlpFactory,
    dense_mlp,
    make_lm_head,
)

# checkpoint name part -> this model's (Llama's blocks), each applied in turn
_RENAMES = {
    ".operator_norm.": ".input_layernorm.",
    ".ffn_norm.": ".post_attention_layernorm.",
    ".feed_forward.": ".mlp.",
    ".mlp.expert_bias": ".mlp.gate.e_score_correction_bias",
    ".self_attn.out_proj.": ".self_attn.o_proj.",
    ".self_attn.q_layernorm.": ".self_attn.q_norm.",
    ".self_attn.k_layernorm.": ".self_attn.k_norm.",
    "model.embedding_norm.": "model.norm.",
}
# the SwiGLU's projections, the dense MLP's and each expert's (mlp.experts.N.w1)
_PROJECTION = re.compile(r"(\.mlp(?:\.experts\.\d+)?)\.w([123])\.")
_PROJECTIONS = {"1": "gate_proj", "3": "up_proj", "2": "down_proj"}


class Lfm2ShortConv(nn.Module):
    """The gated short conv (checkpoint names model.layers.N.conv.{in_proj, conv, out_proj}). Decode rows
    run batched by slot on device tensors (capturable); prefill rows use the step's host offsets."""

    def __init__(self, arch: ModelArch, state_index: int) -> None:
        super().__init__()
        self.state_index = state_index  # this layer's place among the model's conv layers
        h, k, bias = arch.hidden_size, arch.short_conv_kernel, arch.short_conv_bias
        self.hidden_size = h
        self.in_proj = nn.Linear(h, 3 * h, bias=bias)
        self.conv = nn.Conv1d(h, h, k, groups=h, bias=bias)
        self.out_proj = nn.Linear(h, h, bias=bias)

    def forward(self, x: torch.Tensor, attn: AttentionBatch) -> torch.Tensor:
        st = attn.states
        if st is None:
            raise RuntimeError("a short-conv layer needs the step's state batch (AttentionBatch.states)")
        B, C, xs = self.in_proj(x).chunk(3, dim=-1)
        layer = ShortConvLayer(self.conv.weight[:, 0], self.conv.bias)  # [C, K]
        pools = st.conv[self.state_index], st.ssm[self.state_index]
        y = decode_then_prefill(
            short_conv_ops(x), layer, (B * xs,), pools, attn.meta, st, (x, (self.hidden_size,))
        )
        return self.out_proj(C * y)


class Lfm2DecoderLayer(nn.Module):
    def __init__(
        self,
        arch: ModelArch,
        layer_idx: int,
        spec: LayerSpec,
        rotary_emb: RotaryEmbedding | None,
        make_mlp: MlpFactory = dense_mlp,
    ) -> None:
        super().__init__()
        self.conv: Lfm2ShortConv | None = None
        self.self_attn: Attention | None = None
        if arch.is_linear_layer(layer_idx):
            self.conv = Lfm2ShortConv(arch, sum(arch.is_linear_layer(i) for i in range(layer_idx)))
        else:
            self.self_attn = Attention(arch, layer_idx, spec, rotary_emb)
        self.mlp = make_mlp(arch, layer_idx)
        self.input_layernorm = RMSNorm(arch.hidden_size, eps=arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, eps=arch.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, attn: AttentionBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # As LlamaDecoderLayer: each residual add is deferred into the next (fused add +) norm.
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        if self.conv is not None:
            x = self.conv(x, attn)
        else:
            assert self.self_attn is not None
            x = self.self_attn(positions, x, attn)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


def lfm2_mlp(arch: ModelArch, layer_idx: int) -> nn.Module:
    """LFM2-MoE's sparse block past its dense layers (its router in float32, as GLM-4.5's); else SwiGLU."""
    return Glm4MoeMoE(arch) if arch.is_moe_layer(layer_idx) else dense_mlp(arch, layer_idx)


class Lfm2ForCausalLM(nn.Module):
    """LFM2 and LFM2-MoE (the architecture's num_experts says which)."""

    packed_modules_mapping = PACKED_MODULES_MAPPING
    # The router is no nn.Linear, so quantization passes leave it (and its bias) in float32; an FP8
    # checkpoint's expert and router tensors are dequantized as they load (as GLM-4.5's).
    unquantized_linear: tuple[str, ...] = ("mlp.gate",)
    dequantized_at_load: tuple[str, ...] = (EXPERT_TENSORS, "mlp.gate")

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        if not arch.is_short_conv:
            raise ModelLoadError("an LFM2 architecture needs its short conv's size (conv_L_cache)")
        self.arch = arch
        self.checkpoint_kv_scales: dict[int, tuple[float, float]] = {}
        self.model = LlamaModel(arch, make_mlp=lfm2_mlp, make_layer=Lfm2DecoderLayer)
        self.lm_head = make_lm_head(arch, self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBatch) -> torch.Tensor:
        return self.model(input_ids, positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @staticmethod
    def rename_checkpoint(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Applied to the checkpoint stream before FP8 conversion (loader/model_loader.checkpoint_weights),
        which looks tensors up by the model's names."""
        return lfm2_names(weights)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_packed_weights(self, lfm2_names(weights))  # renamed names pass unchanged


def lfm2_names(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        for old, new in _RENAMES.items():
            name = name.replace(old, new)
        name = _PROJECTION.sub(lambda m: f"{m.group(1)}.{_PROJECTIONS[m.group(2)]}.", name)
        yield name, tensor


# ---------------------------------------------------------------------------------------------------
# config.json -> ModelArch


def lfm2_ff_dim(cfg: dict[str, Any]) -> int:
    """The feed-forward width as transformers' Lfm2MLP computes it: with block_auto_adjust_ff_dim,
    int(2/3 of intermediate_size), then (when block_ffn_dim_multiplier is set) times the multiplier,
    rounded up to a multiple of block_multiple_of. block_ff_dim is the older configs' intermediate_size."""
    size = int(cfg.get("block_ff_dim") or cfg.get("intermediate_size") or 12288)
    if not cfg.get("block_auto_adjust_ff_dim", True):
        return size
    size = int(2 * size / 3)
    multiplier = cfg.get("block_ffn_dim_multiplier", 1.0)
    if multiplier is not None:
        multiple = int(cfg.get("block_multiple_of", 256))
        if multiple <= 0:
            raise ModelLoadError(f"block_multiple_of must be positive, got {multiple}")
        size = int(float(multiplier) * size)
        size = multiple * ((size + multiple - 1) // multiple)
    return size


def lfm2_arch(cfg: dict[str, Any], moe: bool = False) -> ModelArch:
    """ModelArch of an Lfm2 config (moe: an Lfm2Moe one). Raises ModelLoadError naming what is missing or
    unsupported."""
    try:
        return _lfm2_arch(cfg, moe)
    except KeyError as e:
        raise ModelLoadError(f"config.json lacks required field {e.args[0]!r}") from None


def _lfm2_moe_fields(cfg: dict[str, Any], n: int) -> dict[str, Any]:
    """LFM2-MoE's experts and router; its dense layers' MLP is intermediate_size wide as given."""
    experts, top_k = int(cfg.get("num_experts", 32)), int(cfg.get("num_experts_per_tok", 4))
    if experts < 2 or not 0 < top_k <= experts:
        raise ModelLoadError(
            f"num_experts_per_tok {top_k} must be in 1..num_experts, and num_experts ({experts}) at least 2"
        )
    if not cfg.get("use_expert_bias", True):
        raise ModelLoadError("use_expert_bias false is not supported yet (the published LFM2-MoE have one)")
    dense = int(cfg.get("num_dense_layers", 2))
    return dict(
        intermediate_size=int(cfg.get("intermediate_size", 7168)),
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=int(cfg.get("moe_intermediate_size", 1792)),
        mlp_only_layers=tuple(range(min(max(dense, 0), n))),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        router_scoring="sigmoid",
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        router_renorm_eps=1e-6,
    )


def _lfm2_arch(cfg: dict[str, Any], moe: bool) -> ModelArch:
    n, hidden = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
    types = cfg.get("layer_types")
    if types is None:  # older configs: the attention layers' indices (transformers' default: all)
        attn = cfg.get("full_attn_idxs")
        attn = set(range(n)) if attn is None else {int(i) for i in attn}
        types = ["full_attention" if i in attn else "conv" for i in range(n)]
    if len(types) != n or any(t not in ("conv", "full_attention") for t in types):
        raise ModelLoadError(f"layer_types must name {n} layers, each one of conv, full_attention")
    k = int(cfg.get("conv_L_cache", 3))
    if k < 2:
        raise ModelLoadError(f"conv_L_cache must be at least 2, got {k}")
    heads = int(cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim")  # not an Lfm2Config field, but LlamaAttention reads one if given
    if not head_dim and hidden % heads:
        raise ModelLoadError(f"hidden_size {hidden} does not split into {heads} attention heads")
    kv_heads = int(cfg.get("num_key_value_heads") or 8)  # Lfm2Config's default
    if kv_heads <= 0 or heads % kv_heads:
        raise ModelLoadError(f"num_key_value_heads {kv_heads} must divide num_attention_heads {heads}")
    if "rope_theta" not in (cfg.get("rope_parameters") or {}) and "rope_theta" not in cfg:
        cfg = {**cfg, "rope_theta": 1e6}  # Lfm2Config's default_theta
    theta, scaling = rope_params(cfg)
    tied = cfg.get("tie_embedding", cfg.get("tie_word_embeddings", True))  # the older name wins, as there
    mlp = _lfm2_moe_fields(cfg, n) if moe else dict(intermediate_size=lfm2_ff_dim(cfg))
    return ModelArch(
        architecture="lfm2_moe" if moe else "lfm2",
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        num_hidden_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=int(head_dim or hidden // heads),
        rms_norm_eps=float(cfg.get("norm_eps", 1e-5)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 128_000)),
        tie_word_embeddings=bool(tied),
        qk_norm=True,
        layer_types=tuple("linear_attention" if t == "conv" else t for t in types),
        short_conv_kernel=k,
        short_conv_bias=bool(cfg.get("conv_bias", False)),
        **mlp,
    )
