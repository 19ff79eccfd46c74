"""Hybrid linear-attention decoders: Qwen3.5 / Qwen3.6 (dense and MoE) and Qwen3-Next.

Layer i is a Gated DeltaNet layer (models/gated_deltanet.py; a state per request, no KV cache) when
ModelArch.layer_types[i] == "linear_attention", else full attention. What differs from the Qwen3
decoder of models/llama.py:

- full attention has an output gate: q_proj gives [q | gate] per head, and o = attn * sigmoid(gate);
  q and k are RMS-normed per head, then RoPE turns only their first hybrid_rotary_dim dims. Qwen3.5's
  M-RoPE gives every text token the same position on its three axes, and then each frequency reads
  that one position: text-only M-RoPE is plain RoPE over the rotary dims (the parity tests check it);
  image prompts get M-RoPE proper (models/qwen3_5_vl.py);
- every RMSNorm but the delta rule's output norm scales by (1 + w), computed in float32;
- MoE layers (Qwen3-Next, Qwen3.5-MoE) add a shared expert scaled by sigmoid(shared_expert_gate(x)).

Families: "qwen3_5" (dense MLP everywhere), "qwen3_5_moe" and "qwen3_next" (MoE where is_moe_layer);
Qwen3-Next's linear layers project with fused in_proj_qkvz / in_proj_ba. The ConditionalGeneration
checkpoints of Qwen3.5 keep the text model under model.language_model.*: it is read from there; the
multi-token-prediction head (mtp.*) is skipped, and so is the vision tower (model.visual.*) of a
config without vision_config (the dummy presets). With one, models/qwen3_5_vl.py wraps this decoder.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from overnight.arch import ModelArch
from overnight.attention.metadata import AttentionBatch
from overnight.attention.spec import LayerAttention
from overnight.errors import ModelLoadError
from overnight.layers.moe import Experts, select_experts
from overnight.layers.mrope import MRotaryEmbedding
from overnight.layers.norm import OffsetRMSNorm
from overnight.layers.rotary import RotaryEmbedding
from overnight.models.checkpoint import EXPERT_TENSORS
from overnight.models.gated_deltanet import GatedDeltaNet
from overnight.models.llama import LlamaMLP, load_packed_weights, make_lm_head
from overnight.models.vision.interface import VisionRows, merge_image_rows
from overnight.quant.fp8 import QuantizedActivation, dense_input, num_tokens

log = logging.getLogger("overnight")

HYBRID_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
# Only the stacked experts are fused; every other tensor keeps its checkpoint name.
PACKED_MODULES_MAPPING: dict[str, tuple[str, str | int]] = {
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}

# Linears every quantization keeps in the compute dtype: the router (its logits pick the experts) and
# the shared expert's one-output gate.
UNQUANTIZED_LINEAR = ("mlp.gate", "mlp.shared_expert_gate")
# FP8 keeps these too, as Qwen's own FP8 checkpoints do (their modules_to_not_convert): a Gated
# DeltaNet layer's b / a projections, Hv outputs each (b is the write strength through a sigmoid, a the
# decay through exp(-exp(A_log) * softplus(a + dt_bias)): an error in either compounds over every later
# token of the state, and together they hold under 1% of the layer's weights), and the vision tower (a
# small share of an image model, run once per image). conv1d and the norms are not nn.Linear.
FP8_UNQUANTIZED_LINEAR = (
    "linear_attn.in_proj_ba",
    "linear_attn.in_proj_b",
    "linear_attn.in_proj_a",
    r"re:visual\.",
)
# An FP8 checkpoint's tensors of layers that run in the compute dtype here: the routed experts (loaded
# dequantized, then quantized per row into the e4m3 stack as they arrive: quant/apply.py), and the
# small layers above in a checkpoint that stored them in FP8 anyway.
DEQUANTIZED_AT_LOAD = (
    EXPERT_TENSORS,
    *UNQUANTIZED_LINEAR,
    *FP8_UNQUANTIZED_LINEAR[:3],
)

# Inside each decoder layer, the linears that read a producer's output as a QuantizedActivation under
# FP8 (quant/apply.py: the producer quantizes once when every one of them present in the layer is an
# Fp8Linear), and the modules that read the same output in the compute dtype (dense_input).
#
# The input norm feeds only FP8 projections in a full-attention layer (q, k, v: one quantization
# instead of three), but in a Gated DeltaNet layer also the b / a projections, which stay bf16 (see
# FP8_UNQUANTIZED_LINEAR: their error compounds through the state); the post-attention norm feeds a
# dense MLP's FP8 gate_up_proj alone, but in a MoE layer also the bf16 router, the shared expert's
# gate and the routed experts (weight-only FP8: they read activations in the compute dtype). Where a
# bf16 reader is present the norm hands over both forms: its output as before, which those readers
# take unchanged (no new rounding where the precision matters), and one quantization of it, shared by
# the FP8 projections (in_proj_qkv and in_proj_z, or the shared expert's gate and up, would each
# quantize the same rows otherwise). Not fusing there would leave the hybrids' commonest layers
# quantizing their input twice; quantizing the bf16 readers' input too would add FP8 rounding where
# the checkpoints deliberately keep 16 bits.
LINEAR_INPUT_PRODUCERS: dict[str, tuple[str, ...]] = {
    "input_layernorm": (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "linear_attn.in_proj_qkv",
        "linear_attn.in_proj_z",
        "linear_attn.in_proj_qkvz",
    ),
    "post_attention_layernorm": (
        "mlp.gate_up_proj",
        "mlp.shared_expert.gate_proj",
        "mlp.shared_expert.up_proj",
    ),
    "mlp.act_fn": ("mlp.down_proj",),
}
DENSE_INPUT_READERS: dict[str, tuple[str, ...]] = {
    "input_layernorm": (
        "linear_attn.in_proj_b",
        "linear_attn.in_proj_a",
        "linear_attn.in_proj_ba",
    ),
    "post_attention_layernorm": ("mlp.gate", "mlp.shared_expert_gate", "mlp.experts"),
}


class GatedAttention(nn.Module):
    def __init__(self, arch: ModelArch, layer_idx: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = arch.num_attention_heads
        self.num_kv_heads = arch.num_key_value_heads
        self.head_dim = arch.head_dim
        self.rotary_dim = rotary_emb.head_dim
        self.scale = arch.head_dim**-0.5
        h, bias = arch.hidden_size, arch.attention_bias
        self.q_proj = nn.Linear(h, 2 * arch.q_size, bias=bias)  # per head: [q | gate]
        self.k_proj = nn.Linear(h, arch.kv_size, bias=bias)
        self.v_proj = nn.Linear(h, arch.kv_size, bias=bias)
        self.o_proj = nn.Linear(arch.q_size, h, bias=bias)
        self.q_norm = OffsetRMSNorm(arch.head_dim, arch.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(arch.head_dim, arch.rms_norm_eps)
        self.rotary_emb = rotary_emb
        self.layer = LayerAttention()

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor | QuantizedActivation, attn: AttentionBatch
    ) -> torch.Tensor:
        t, d = num_tokens(x), self.head_dim
        q, gate = self.q_proj(x).view(t, self.num_heads, 2 * d).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).view(t, self.num_kv_heads, d))
        v = self.v_proj(x).view(t, self.num_kv_heads, d)
        rd = self.rotary_dim
        q_rot, k_rot = self.rotary_emb(positions, q[..., :rd].contiguous(), k[..., :rd].contiguous())
        q = torch.cat([q_rot, q[..., rd:]], dim=-1)
        k = torch.cat([k_rot, k[..., rd:]], dim=-1)
        o = attn(self.layer_idx, q, k, v, self.scale, layer=self.layer).reshape(t, -1)
        return self.o_proj(o * torch.sigmoid(gate.reshape(t, -1)))


class SharedExpertMoe(nn.Module):
    """Routed experts (the fused MoE path of layers/moe.py) plus a shared expert and its gate."""

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.top_k = arch.num_experts_per_tok
        self.norm_topk_prob = arch.norm_topk_prob
        h = arch.hidden_size
        self.gate = nn.Linear(h, arch.num_experts, bias=False)  # the router
        self.experts = Experts(arch.num_experts, h, arch.moe_intermediate_size)
        self.shared_expert = SplitMLP(h, arch.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(h, 1, bias=False)

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        dense = dense_input(x)  # the router, the shared gate and the experts (DENSE_INPUT_READERS)
        weights, ids = select_experts(self.gate(dense), self.top_k, self.norm_topk_prob)
        shared = torch.sigmoid(self.shared_expert_gate(dense)) * self.shared_expert(x)
        return self.experts(dense, weights, ids) + shared


class SplitMLP(nn.Module):
    """A gated MLP whose projections keep their checkpoint names (the shared expert: its size is not
    the dense intermediate_size the fused loader assumes)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class HybridDecoderLayer(nn.Module):
    def __init__(
        self, arch: ModelArch, layer_idx: int, state_index: int | None, rotary_emb: RotaryEmbedding
    ) -> None:
        super().__init__()
        self.linear_attn: GatedDeltaNet | None = None
        self.self_attn: GatedAttention | None = None
        if state_index is not None:
            self.linear_attn = GatedDeltaNet(arch, state_index, arch.architecture == "qwen3_next")
        else:
            self.self_attn = GatedAttention(arch, layer_idx, rotary_emb)
        self.mlp: nn.Module = (
            SharedExpertMoe(arch)
            if arch.is_moe_layer(layer_idx)
            else LlamaMLP(arch.hidden_size, arch.intermediate_size)
        )
        self.input_layernorm = OffsetRMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = OffsetRMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, attn: AttentionBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        normed: torch.Tensor | QuantizedActivation  # see LINEAR_INPUT_PRODUCERS
        if residual is None:
            residual = x
            normed = self.input_layernorm(x)
        else:
            normed, residual = self.input_layernorm(x, residual)
        if self.linear_attn is not None:
            x = self.linear_attn(normed, attn)
        else:
            assert self.self_attn is not None
            x = self.self_attn(positions, normed, attn)
        normed, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(normed), residual


class HybridModel(nn.Module):
    """The decoder. With arch.mrope_section (Qwen3.5's image checkpoints, models/qwen3_5_vl.py) the
    full-attention layers turn their rotary dims by M-RoPE: 1-D positions still rotate as plain RoPE,
    [3, T] ones (a prefill step with image tokens) by the interleaved t / h / w layout. The linear
    layers never read positions."""

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        rotary_emb = _rotary(arch)
        linear = [i for i in range(arch.num_hidden_layers) if arch.is_linear_layer(i)]
        self.layers = nn.ModuleList(
            HybridDecoderLayer(arch, i, linear.index(i) if i in linear else None, rotary_emb)
            for i in range(arch.num_hidden_layers)
        )
        self.norm = OffsetRMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBatch,
        vision: VisionRows | None = None,
    ) -> torch.Tensor:
        x = merge_image_rows(self.embed_tokens(input_ids), vision)  # Qwen3.5 has no deepstack
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, attn)
        x, _ = self.norm(x, residual)
        return x


def _rotary(arch: ModelArch) -> RotaryEmbedding:
    if not arch.mrope_section:
        return RotaryEmbedding(arch.hybrid_rotary_dim, arch.max_position_embeddings, arch.rope_theta)
    t, h, w = arch.mrope_section
    mrope = MRotaryEmbedding(
        arch.hybrid_rotary_dim,
        arch.max_position_embeddings,
        arch.rope_theta,
        (t, h, w),
        interleaved=arch.mrope_interleaved,
    )
    return cast(RotaryEmbedding, mrope)  # the same call signature and head_dim


class Qwen3NextForCausalLM(nn.Module):
    """Qwen3.5 / Qwen3.5-MoE / Qwen3-Next text models (ModelArch.architecture says which)."""

    packed_modules_mapping = PACKED_MODULES_MAPPING
    unquantized_linear: tuple[str, ...] = UNQUANTIZED_LINEAR
    fp8_unquantized_linear: tuple[str, ...] = FP8_UNQUANTIZED_LINEAR
    dequantized_at_load: tuple[str, ...] = DEQUANTIZED_AT_LOAD
    linear_input_producers = LINEAR_INPUT_PRODUCERS
    dense_input_readers = DENSE_INPUT_READERS

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.arch = arch
        self.checkpoint_kv_scales: dict[int, tuple[float, float]] = {}
        self.model = HybridModel(arch)
        self.lm_head = make_lm_head(arch, self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBatch) -> torch.Tensor:
        return self.model(input_ids, positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @staticmethod
    def rename_checkpoint(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Applied to the checkpoint stream before integer / FP8 conversion and tensor-parallel slicing
        (loader/model_loader.checkpoint_weights), which look tensors up by the model's names."""
        return _text_weights(weights)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_packed_weights(self, _text_weights(weights))  # renamed names pass unchanged


def _text_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The text model's tensors under their CausalLM names: model.language_model.* -> model.*; the
    vision tower and the MTP head are skipped (counted in one log line)."""
    skipped = 0
    for name, tensor in weights:
        if name.startswith(("model.visual.", "visual.", "mtp.")):
            skipped += 1
            continue
        if name.startswith("model.language_model."):
            name = "model." + name.removeprefix("model.language_model.")
        yield name, tensor
    if skipped:
        log.info("skipped %d tensors of the vision tower / MTP head (text-only model)", skipped)


# ---------------------------------------------------------------------------------------------------
# config.json -> ModelArch


def hybrid_arch(cfg: dict[str, Any], family: str) -> ModelArch:
    """ModelArch of a Qwen3.5 / Qwen3.5-MoE / Qwen3-Next config (a ConditionalGeneration config's
    text_config included). Raises ModelLoadError naming what is missing or unsupported."""
    text = cfg.get("text_config") or cfg
    try:
        arch = _hybrid_arch(text, family)
        tie = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        return replace(arch, tie_word_embeddings=bool(tie))
    except KeyError as e:
        raise ModelLoadError(f"config.json lacks required field {e.args[0]!r}") from None


def _hybrid_arch(cfg: dict[str, Any], family: str) -> ModelArch:
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"unsupported hidden_act {cfg['hidden_act']!r} (only silu)")
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:  # Qwen3-Next's rule: every full_attention_interval-th layer is full attention
        interval = int(cfg.get("full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    legacy = {"attention": "full_attention", "mamba": "linear_attention"}  # older configs' names
    types = [legacy.get(t, t) for t in types]
    kinds = ("full_attention", "linear_attention")
    if len(types) != n or any(t not in kinds for t in types):
        raise ModelLoadError(f"layer_types must name {n} layers, each one of {', '.join(kinds)}")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope", None):
        raise ModelLoadError(f"unsupported RoPE type {rope_type!r} for {family} (default only)")
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    # 0.25 when absent: the transformers configs' default for these families
    factor = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
    rotary_dim = int(head_dim * factor)
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ModelLoadError(f"partial_rotary_factor {factor} gives an unusable rotary dim {rotary_dim}")
    moe: dict[str, Any] = {}
    if family != "qwen3_5":
        experts = int(cfg.get("num_experts") or 0)
        if experts <= 0 or not 0 < int(cfg["num_experts_per_tok"]) <= experts:
            raise ModelLoadError("num_experts and num_experts_per_tok must be positive, top-k <= experts")
        moe = dict(
            num_experts=experts,
            num_experts_per_tok=int(cfg["num_experts_per_tok"]),
            moe_intermediate_size=int(cfg["moe_intermediate_size"]),
            shared_expert_intermediate_size=int(cfg["shared_expert_intermediate_size"]),
            # Qwen3.5-MoE always renormalises its top-k weights (its config has no flag).
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(sorted(int(i) for i in cfg.get("mlp_only_layers") or ())),
        )
    linear: dict[str, Any] = {
        k: int(cfg[k])
        for k in (
            "linear_num_key_heads",
            "linear_num_value_heads",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_conv_kernel_dim",
        )
    }
    if (
        any(v <= 0 for v in linear.values())
        or linear["linear_num_value_heads"] % linear["linear_num_key_heads"]
    ):
        raise ModelLoadError(
            "linear attention needs positive head counts and sizes, value heads a multiple of key heads"
        )
    return ModelArch(
        architecture=family,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=int(cfg.get("intermediate_size") or 0),
        num_hidden_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        qk_norm=True,
        layer_types=tuple(types),
        hybrid_rotary_dim=rotary_dim,
        **linear,
        **moe,
    )
