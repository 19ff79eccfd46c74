"""TII's Falcon-H1 hybrids (`FalconH1ForCausalLM`: Falcon-H1-0.5B / 1.5B / 3B / 7B / 34B): every layer runs
Llama's attention AND a Mamba2 mixer side by side on the same normed input, sums their outputs, then an
MLP.

    n = norm(x);  x = x + attn(n) * attention_out + mamba(n) * ssm_out;  x = x + mlp(norm(x))
    attn:  q, k, v of n * attention_in, k times key_multiplier (before RoPE)
    mamba: in_proj(n * ssm_in) times ssm_multipliers per section (z, x, B, C, dt), then models/mamba2_mixer.py
           (no gated norm unless mamba_rms_norm; with mamba_norm_before_gate the gate comes after it)
    mlp:   down(silu(gate(n) * gate_mult) * up(n)) * down_mult
    input embeddings times embedding_multiplier, logits times lm_head_multiplier

Each of those muP multipliers but the first and last is a constant on one side of a linear map, so it is
folded into that map's weights (and bias, where it scales the bias too) as the checkpoint streams in
(rename_checkpoint, before FP8 conversion and tensor-parallel slicing): the forward pass has none of
them. In float32 the folded products differ from transformers' order of operations by rounding only.

Every layer is both kinds (ModelArch.layer_types "hybrid"): the KV cache keys it by its layer index like
any attention layer, the state cache (runner/state_cache.py) by its place among the layers with a state
(ModelArch.linear_state_index; here the same index). Checkpoint names are transformers' but for the final
norm (model.final_layernorm -> model.norm) and the fused q/k/v and gate/up projections. Tensor
parallelism takes parallel/tp_mamba2.py's rules for the mixer and the dense ones for attention and MLP.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from overnight.arch import ModelArch
from overnight.attention.metadata import AttentionBatch
from overnight.errors import ModelLoadError
from overnight.layers.norm import RMSNorm
from overnight.layers.rotary import RotaryEmbedding
from overnight.models.checkpoint import load_packed_weights
from overnight.models.field_readers import rope_params
from overnight.models.granite_hybrid import json_float
from overnight.models.layer_spec import LayerSpec
from overnight.models.llama import (
    PACKED_MODULES_MAPPING,
    Attention,
    LlamaMLP,
    LlamaModel,
    MlpFactory,
    make_lm_head,
    scaled_logits,
)
from overnight.models.mamba2_mixer import Mamba2Mixer

# ModelArch.weight_multipliers' names, each a constant folded into one projection (see fold_multipliers)
MULTIPLIERS = (
    "attention_in",
    "key",
    "attention_out",
    "ssm_in",
    "ssm_out",
    "mlp_gate",
    "mlp_down",
    "ssm_z",
    "ssm_x",
    "ssm_b",
    "ssm_c",
    "ssm_dt",
)


class FalconH1DecoderLayer(nn.Module):
    def __init__(
        self,
        arch: ModelArch,
        layer_idx: int,
        spec: LayerSpec,
        rotary_emb: RotaryEmbedding | None,
        make_mlp: MlpFactory | None = None,  # LlamaModel's factory argument; the MLP is Llama's
    ) -> None:
        super().__init__()
        self.self_attn = Attention(arch, layer_idx, spec, rotary_emb)
        self.mamba = Mamba2Mixer(arch, arch.linear_state_index(layer_idx))
        self.feed_forward = LlamaMLP(arch.hidden_size, arch.intermediate_size)
        self.input_layernorm = RMSNorm(arch.hidden_size, eps=arch.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(arch.hidden_size, eps=arch.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, attn: AttentionBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # As LlamaDecoderLayer: each residual add is deferred into the next (fused add +) norm.
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.mamba(x, attn) + self.self_attn(positions, x, attn)  # the multipliers are in the weights
        x, residual = self.pre_ff_layernorm(x, residual)
        return self.feed_forward(x), residual


class FalconH1ForCausalLM(nn.Module):
    packed_modules_mapping = PACKED_MODULES_MAPPING

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        if not arch.is_mamba2 or set(arch.layer_types) != {"hybrid"}:
            raise ModelLoadError("a Falcon-H1 architecture needs its Mamba2 sizes and hybrid layers")
        self.arch = arch
        # The checkpoint's sizes: tensor parallelism shrinks self.arch to one rank's share, but the
        # multipliers fold into whole tensors, before they are sliced.
        self.checkpoint_arch = arch
        self.checkpoint_kv_scales: dict[int, tuple[float, float]] = {}
        self.model = LlamaModel(arch, make_layer=FalconH1DecoderLayer)
        self.lm_head = make_lm_head(arch, self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBatch) -> torch.Tensor:
        return self.model(input_ids, positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return scaled_logits(self.arch, self.lm_head(hidden))  # logit_scale: lm_head_multiplier

    def rename_checkpoint(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint stream with the final norm renamed and the multipliers folded in (applied once,
        by loader/model_loader.checkpoint_weights, before FP8 conversion and tensor-parallel slicing)."""
        return fold_multipliers(self.checkpoint_arch, weights)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """weights: rename_checkpoint's stream (the multipliers already folded: folding is not idempotent)."""
        load_packed_weights(self, weights)


# ---------------------------------------------------------------------------------------------------
# Folding the multipliers into the checkpoint's tensors

# checkpoint suffix (after model.layers.N.) -> the multipliers its weight rows take; a bias takes them
# too, but for the input-side ones (attention_in, ssm_in), which scale what the weight multiplies
_OUTPUT_SIDE = {
    "self_attn.k_proj": ("key",),
    "self_attn.o_proj": ("attention_out",),
    "mamba.out_proj": ("ssm_out",),
    "feed_forward.gate_proj": ("mlp_gate",),
    "feed_forward.down_proj": ("mlp_down",),
}
_INPUT_SIDE = {
    "self_attn.q_proj": "attention_in",
    "self_attn.k_proj": "attention_in",
    "self_attn.v_proj": "attention_in",
    "mamba.in_proj": "ssm_in",
}


def ssm_row_scales(arch: ModelArch, m: dict[str, float]) -> torch.Tensor:
    """in_proj's per-row multipliers (transformers' mup_vector): z, x, B, C and dt sections."""
    inner, gn, heads = arch.mamba_intermediate, arch.mamba_n_groups * arch.mamba_d_state, arch.mamba_n_heads
    sizes = (inner, inner, gn, gn, heads)
    names = ("ssm_z", "ssm_x", "ssm_b", "ssm_c", "ssm_dt")
    return torch.cat([torch.full((n,), m[k], dtype=torch.float32) for n, k in zip(sizes, names)])


def fold_multipliers(
    arch: ModelArch, weights: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint stream with each multiplied projection's weight (and bias) scaled, in float32 and
    rounded once to the tensor's dtype, and the final norm under Llama's name. arch: the checkpoint's
    whole sizes (in_proj's row sections)."""
    m = dict(arch.weight_multipliers)
    sections = ssm_row_scales(arch, m)
    rows = None if bool(torch.all(sections == 1.0)) else sections  # None: in_proj's rows keep their values
    for name, t in weights:
        if name == "model.final_layernorm.weight":
            yield "model.norm.weight", t
            continue
        module, _, kind = name.rpartition(".")
        suffix = module.split(".", 3)[-1] if module.startswith("model.layers.") else ""
        scale = 1.0
        for key in _OUTPUT_SIDE.get(suffix, ()):
            scale *= m[key]
        if kind == "weight" and suffix in _INPUT_SIDE:
            scale *= m[_INPUT_SIDE[suffix]]
        row_scale = rows if suffix == "mamba.in_proj" else None
        if scale == 1.0 and row_scale is None:
            yield name, t
            continue
        if kind not in ("weight", "bias") or t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ModelLoadError(
                f"cannot fold Falcon-H1's multipliers into {name} ({t.dtype}): only into 16- or 32-bit "
                "float weights and biases (pre-quantized Falcon-H1 checkpoints are not supported yet)"
            )
        f = t.float() * scale
        if row_scale is not None:
            f = f * (row_scale.to(t.device)[:, None] if t.dim() == 2 else row_scale.to(t.device))
        yield name, f.to(t.dtype)


# ---------------------------------------------------------------------------------------------------
# config.json -> ModelArch


def falcon_h1_arch(cfg: dict[str, Any]) -> ModelArch:
    """ModelArch of a FalconH1 config. Raises ModelLoadError naming what is missing or unsupported."""
    try:
        return _falcon_h1_arch(cfg)
    except KeyError as e:
        raise ModelLoadError(f"config.json lacks required field {e.args[0]!r}") from None


def _multiplier_list(cfg: dict[str, Any], key: str, n: int) -> list[float]:
    v = cfg.get(key)
    if v is None:
        return [1.0] * n
    if not isinstance(v, list | tuple) or len(v) != n:
        raise ModelLoadError(f"{key} must be a list of {n} numbers, got {v!r}")
    return [float(x) for x in v]


def _falcon_h1_arch(cfg: dict[str, Any]) -> ModelArch:
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"unsupported hidden_act {cfg['hidden_act']!r} (only silu)")
    if cfg.get("mlp_bias"):
        raise ModelLoadError("mlp_bias is not supported for Falcon-H1 (the published models have none)")
    proj_bias = bool(cfg.get("mamba_proj_bias", False))
    if bool(cfg.get("projectors_bias", False)) != proj_bias:
        raise ModelLoadError(
            "mamba_proj_bias and projectors_bias must agree (in_proj's and out_proj's biases)"
        )
    n, hidden = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    m_heads, groups = int(cfg.get("mamba_n_heads", 128)), int(cfg.get("mamba_n_groups", 1))
    d_ssm = cfg.get("mamba_d_ssm", 1024)
    inner = int(cfg.get("mamba_expand", 2)) * hidden if d_ssm is None else int(d_ssm)
    d_head = cfg.get("mamba_d_head", "auto")
    d_head = inner // max(m_heads, 1) if d_head in ("auto", None) else int(d_head)
    if m_heads <= 0 or groups <= 0 or m_heads % groups or d_head * m_heads != inner:
        raise ModelLoadError(
            f"Mamba2 sizes do not fit: mamba_n_heads {m_heads} x mamba_d_head {d_head} must equal "
            f"the mixer's width ({inner}: mamba_d_ssm, else mamba_expand * hidden_size), and "
            f"mamba_n_groups {groups} divide the heads"
        )
    if int(cfg.get("mamba_d_conv", 4)) < 2:
        raise ModelLoadError(f"mamba_d_conv must be at least 2, got {cfg['mamba_d_conv']}")
    limit = cfg.get("time_step_limit") or (0.0, float("inf"))
    gate, down = _multiplier_list(cfg, "mlp_multipliers", 2)
    ssm = _multiplier_list(cfg, "ssm_multipliers", 5)
    multipliers = dict(
        attention_in=float(cfg.get("attention_in_multiplier", 1.0)),
        key=float(cfg.get("key_multiplier", 1.0)),
        attention_out=float(cfg.get("attention_out_multiplier", 1.0)),
        ssm_in=float(cfg.get("ssm_in_multiplier", 1.0)),
        ssm_out=float(cfg.get("ssm_out_multiplier", 1.0)),
        mlp_gate=gate,
        mlp_down=down,
        **dict(zip(("ssm_z", "ssm_x", "ssm_b", "ssm_c", "ssm_dt"), ssm)),
    )
    theta, scaling = rope_params(cfg)
    bias = bool(cfg.get("attention_bias", False))
    return ModelArch(
        architecture="falcon_h1",
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_hidden_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bias,
        o_proj_bias=bias,
        layer_types=("hybrid",) * n,
        embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
        logit_scale=float(cfg.get("lm_head_multiplier", 1.0)),
        weight_multipliers=tuple((k, multipliers[k]) for k in MULTIPLIERS),
        mamba_n_heads=m_heads,
        mamba_d_head=d_head,
        mamba_d_state=int(cfg.get("mamba_d_state", 256)),
        mamba_n_groups=groups,
        mamba_d_conv=int(cfg.get("mamba_d_conv", 4)),
        mamba_conv_bias=bool(cfg.get("mamba_conv_bias", True)),
        mamba_proj_bias=proj_bias,
        mamba_dt_limit=(json_float(limit[0]), json_float(limit[1])),
        mamba_norm_groups=groups,  # FalconH1RMSNormGated normalizes each group's slice
        mamba_rms_norm=bool(cfg.get("mamba_rms_norm", False)),
        mamba_norm_before_gate=bool(cfg.get("mamba_norm_before_gate", True)),
    )
