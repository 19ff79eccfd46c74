"""IBM Granite 4.0 hybrid decoders (`GraniteMoeHybridForCausalLM`: granite-4.0-h-micro, -h-tiny,
-h-small): Mamba2 layers and attention layers, as config.json's `layer_types` says ("mamba" /
"linear_attention" or "attention" / "full_attention"), each followed by an MLP.

    layer = x + r * mixer(norm(x)), then + r * mlp(norm(.))          r: residual_multiplier
    mixer: Mamba2 (models/mamba2_mixer.py; a state per request, no KV cache) or Llama's attention
           (models/llama.py) scaled by attention_multiplier, with RoPE only when position_embedding_type
           is "rope" (the published 4.0 hybrids say "nope": no position encoding at all)
    mlp:   shared_mlp (input_linear -> silu(gate) * up -> output_linear), plus, with num_local_experts,
           the routed experts (top-k of a softmax router, weights renormalised) beside it
    input embeddings times embedding_multiplier, logits divided by logits_scaling (Granite's)

The blocks are Llama's (LlamaModel with this file's decoder layer); the Mamba2 layers share the hybrid
models' state cache (runner/state_cache.py: conv state [K-1, conv_dim], SSM state [H, P, d_state] per
request and layer). Checkpoint names pass unchanged but for the experts: the published checkpoints'
block_sparse_moe.input_linear / output_linear / router.layer (and transformers 5's experts.gate_up_proj /
experts.down_proj / router.weight) load into the stacked experts and the router.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from overnight.arch import ModelArch
from overnight.attention.metadata import AttentionBatch
from overnight.errors import ModelLoadError
from overnight.layers.activation import SiluAndMul
from overnight.layers.moe import Experts, select_experts
from overnight.layers.norm import RMSNorm
from overnight.layers.rotary import RotaryEmbedding
from overnight.models.checkpoint import load_packed_weights
from overnight.models.field_readers import rope_params
from overnight.models.layer_spec import LayerSpec
from overnight.models.llama import Attention, LlamaModel, MlpFactory, make_lm_head, scaled_logits
from overnight.models.mamba2_mixer import Mamba2Mixer

PACKED_MODULES_MAPPING: dict[str, tuple[str, str | int]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
}
# The router stays in the compute dtype under any quantization (its logits pick the experts).
UNQUANTIZED_LINEAR = ("block_sparse_moe.router",)
# checkpoint suffix -> this model's name (the published layout; transformers 5 saves its own names)
_RENAMES = {
    "block_sparse_moe.input_linear.weight": "block_sparse_moe.experts.gate_up_proj",
    "block_sparse_moe.output_linear.weight": "block_sparse_moe.experts.down_proj",
    "block_sparse_moe.router.layer.weight": "block_sparse_moe.router.weight",
}


class GraniteMLP(nn.Module):
    """The shared MLP (the whole MLP of a dense Granite hybrid): input_linear gives [gate | up]."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.input_linear = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.output_linear = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_linear(self.act_fn(self.input_linear(x)))


class GraniteMoE(nn.Module):
    """Routed experts: softmax over the router's top-k logits (the renormalised top-k of a softmax)."""

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.top_k = arch.num_experts_per_tok
        self.router = nn.Linear(arch.hidden_size, arch.num_experts, bias=False)
        self.experts = Experts(arch.num_experts, arch.hidden_size, arch.moe_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.router(x), self.top_k, True)
        return self.experts(x, weights, ids)


class GraniteHybridDecoderLayer(nn.Module):
    def __init__(
        self,
        arch: ModelArch,
        layer_idx: int,
        spec: LayerSpec,
        rotary_emb: RotaryEmbedding | None,
        make_mlp: MlpFactory | None = None,  # LlamaModel's factory argument; the MLP is Granite's own
    ) -> None:
        super().__init__()
        self.mamba: Mamba2Mixer | None = None
        self.self_attn: Attention | None = None
        if arch.is_linear_layer(layer_idx):
            state_index = sum(arch.is_linear_layer(i) for i in range(layer_idx))
            self.mamba = Mamba2Mixer(arch, state_index)
        else:
            self.self_attn = Attention(arch, layer_idx, spec, rotary_emb)
        self.block_sparse_moe = GraniteMoE(arch) if arch.num_experts else None
        shared = arch.shared_expert_intermediate_size if arch.num_experts else arch.intermediate_size
        self.shared_mlp = GraniteMLP(arch.hidden_size, shared)
        self.input_layernorm = RMSNorm(arch.hidden_size, eps=arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, eps=arch.rms_norm_eps)
        self.residual_multiplier = arch.residual_multiplier

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, attn: AttentionBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # As LlamaDecoderLayer: each residual add is deferred into the next (fused add +) norm.
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        if self.mamba is not None:
            x = self.mamba(x, attn)
        else:
            assert self.self_attn is not None
            x = self.self_attn(positions, x, attn)
        if self.residual_multiplier != 1.0:
            x = x * self.residual_multiplier
        x, residual = self.post_attention_layernorm(x, residual)
        out = self.shared_mlp(x)
        if self.block_sparse_moe is not None:
            out = self.block_sparse_moe(x) + out
        if self.residual_multiplier != 1.0:
            out = out * self.residual_multiplier
        return out, residual


class GraniteMoeHybridForCausalLM(nn.Module):
    packed_modules_mapping = PACKED_MODULES_MAPPING
    unquantized_linear: tuple[str, ...] = UNQUANTIZED_LINEAR

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        if not arch.is_mamba2:
            raise ModelLoadError("a Granite hybrid's architecture needs its Mamba2 sizes (mamba_n_heads)")
        self.arch = arch
        self.checkpoint_kv_scales: dict[int, tuple[float, float]] = {}
        self.model = LlamaModel(arch, make_layer=GraniteHybridDecoderLayer)
        self.lm_head = make_lm_head(arch, self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBatch) -> torch.Tensor:
        return self.model(input_ids, positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return scaled_logits(self.arch, self.lm_head(hidden))

    @staticmethod
    def rename_checkpoint(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Applied to the checkpoint stream before FP8 conversion (loader/model_loader.checkpoint_weights),
        which looks tensors up by the model's names."""
        return _granite_names(weights)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_packed_weights(self, _granite_names(weights))  # renamed names pass unchanged


def _granite_names(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        for old, new in _RENAMES.items():
            if name.endswith(old):
                name = name.removesuffix(old) + new
                break
        yield name, tensor


# ---------------------------------------------------------------------------------------------------
# config.json -> ModelArch

_LAYER_KINDS = {"mamba": "linear_attention", "attention": "full_attention"}  # the published names


def granite_hybrid_arch(cfg: dict[str, Any]) -> ModelArch:
    """ModelArch of a GraniteMoeHybrid config. Raises ModelLoadError naming what is missing or
    unsupported."""
    try:
        return _granite_hybrid_arch(cfg)
    except KeyError as e:
        raise ModelLoadError(f"config.json lacks required field {e.args[0]!r}") from None


def _granite_hybrid_arch(cfg: dict[str, Any]) -> ModelArch:
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"unsupported hidden_act {cfg['hidden_act']!r} (only silu)")
    n, hidden = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
    types = cfg.get("layer_types") or cfg.get("layers_block_type") or ["linear_attention"] * n
    types = [_LAYER_KINDS.get(t, t) for t in types]
    kinds = ("full_attention", "linear_attention")
    if len(types) != n or any(t not in kinds for t in types):
        raise ModelLoadError(f"layer_types must name {n} layers, each one of mamba, attention")
    position = cfg.get("position_embedding_type")
    if position not in (None, "nope", "rope"):
        raise ModelLoadError(f"unsupported position_embedding_type {position!r} (rope, nope or none)")
    theta, scaling = rope_params(cfg)
    heads = int(cfg["num_attention_heads"])
    # Mamba2: heads of d_head values ("auto": mamba_expand * hidden / heads), groups of B / C
    m_heads, groups = int(cfg.get("mamba_n_heads", 128)), int(cfg.get("mamba_n_groups", 1))
    inner = int(cfg.get("mamba_expand", 2)) * hidden
    d_head = cfg.get("mamba_d_head", "auto")
    d_head = inner // m_heads if d_head in ("auto", None) else int(d_head)
    if m_heads <= 0 or groups <= 0 or m_heads % groups or d_head * m_heads != inner:
        raise ModelLoadError(
            f"Mamba2 sizes do not fit: mamba_n_heads {m_heads} x mamba_d_head {d_head} must equal "
            f"mamba_expand * hidden_size ({inner}), and mamba_n_groups {groups} divide the heads"
        )
    if int(cfg.get("mamba_d_conv", 4)) < 2:
        raise ModelLoadError(f"mamba_d_conv must be at least 2, got {cfg['mamba_d_conv']}")
    limit = cfg.get("time_step_limit") or (0.0, float("inf"))
    moe: dict[str, Any] = {}
    experts = int(cfg.get("num_local_experts") or 0)
    shared = int(cfg.get("shared_intermediate_size", 1024))
    if experts:
        if not 0 < int(cfg["num_experts_per_tok"]) <= experts:
            raise ModelLoadError("num_experts_per_tok must be positive and at most num_local_experts")
        moe = dict(
            num_experts=experts,
            num_experts_per_tok=int(cfg["num_experts_per_tok"]),
            moe_intermediate_size=int(cfg["intermediate_size"]),
            shared_expert_intermediate_size=shared,
            shared_expert_gated=False,
            norm_topk_prob=True,
        )
    return ModelArch(
        architecture="granitemoehybrid",
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=shared,  # the shared MLP (a dense model's only MLP)
        num_hidden_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        o_proj_bias=bool(cfg.get("attention_bias", False)),
        layer_types=tuple(types),
        no_rope_layers=() if position == "rope" else tuple(range(n)),
        attention_multiplier=float(cfg.get("attention_multiplier", 1.0)),
        embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
        logits_scaling=float(cfg.get("logits_scaling", 1.0)),
        mamba_n_heads=m_heads,
        mamba_d_head=d_head,
        mamba_d_state=int(cfg.get("mamba_d_state", 256)),
        mamba_n_groups=groups,
        mamba_d_conv=int(cfg.get("mamba_d_conv", 4)),
        mamba_conv_bias=bool(cfg.get("mamba_conv_bias", True)),
        mamba_proj_bias=bool(cfg.get("mamba_proj_bias", False)),
        mamba_dt_limit=(json_float(limit[0]), json_float(limit[1])),
        **moe,
    )


def json_float(v: Any) -> float:
    """A float of config.json: a number, "inf" / "Infinity", or transformers 5's {"__float__": "Infinity"}."""
    if isinstance(v, dict) and "__float__" in v:
        v = v["__float__"]
    try:
        return float(v)
    except (TypeError, ValueError):
        raise ModelLoadError(f"time_step_limit holds {v!r}, not a number") from None
