"""DeepSeek-V2 / V3 (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM: DeepSeek-V2-Lite / V2.5, V3, R1, Kimi-K2,
Moonlight) and GLM-4.7-Flash (Glm4MoeLiteForCausalLM): multi-head latent attention with a sparse MLP.

Attention (MLAttention, checkpoint names as transformers'):

    x --> q_a_proj --> q_a_layernorm --> q_b_proj --> per head [q_nope (Dn) | q_pe (P)]   (q_proj when
      |                                                                                   q_lora_rank is 0)
      \\-> kv_a_proj_with_mqa --> [c (R) | k_pe (P)]; c --> kv_a_layernorm
    q_pe, k_pe rotated (RoPE over P dims: interleaved pairs in V2 and in V3 with rope_interleave, which
    pairs dims as transformers does; YaRN's mscale in the table); the cache row [norm(c) | k_pe];
    attention through kv_b_proj (W_UK, W_UV per head) in attention/mla.py's two forms; o_proj.

The softmax scale is (Dn + P) ** -0.5, times mscale(factor, mscale_all_dim) ** 2 under YaRN, as
transformers computes it. The MLP of layer i is dense (gate_up_proj) for the first first_k_dense_replace
layers (GLM-4.7-Flash: mlp_layer_types), the others routed experts (layers/moe.py) plus
n_shared_experts x moe_intermediate_size of shared MLP:

    V3, Kimi-K2, Moonlight, GLM-4.7-Flash: sigmoid scores plus e_score_correction_bias, grouped choice
        (noaux_tc: layers/moe_grouped_router.py, GLM-4.5's router)
    V2: softmax scores, "greedy" top-k or "group_limited_greedy" (the topk_group groups of the highest
        single score), weights times routed_scaling_factor, never renormalized (transformers' V2 router
        does not read norm_topk_prob; the published V2 checkpoints set it false)

Multi-token-prediction layers (num_nextn_predict_layers, numbered from num_hidden_layers on) are dropped
before loading, as GLM-4.5's are.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from overnight.arch import ModelArch
from overnight.attention.metadata import AttentionBatch
from overnight.attention.mla import split_kv_b
from overnight.layers.moe import Experts
from overnight.layers.norm import RMSNorm
from overnight.layers.rotary import RotaryEmbedding
from overnight.models.checkpoint import EXPERT_TENSORS
from overnight.models.glm4_moe import Glm4MoeTopkRouter, without_mtp_layers
from overnight.models.layer_spec import LayerSpec
from overnight.models.llama import LlamaMLP, LlamaModel, MlpFactory, load_packed_weights, make_lm_head
from overnight.models.qwen3_next import SplitMLP

# Only the dense MLP's gate/up are fused; q/k/v do not exist as such in latent attention.
PACKED_MODULES_MAPPING: dict[str, tuple[str, str | int]] = {
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# transformers' DeepseekV3RMSNorm(q_lora_rank) / (kv_lora_rank): the default eps, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def softmax_scale(arch: ModelArch) -> float:
    """(Dn + P) ** -0.5, times YaRN's mscale(factor, mscale_all_dim) ** 2 when both are set."""
    scale = (arch.qk_nope_head_dim + arch.qk_rope_head_dim) ** -0.5
    scaling = arch.rope_scaling_dict() or {}
    factor, all_dim = scaling.get("factor"), scaling.get("mscale_all_dim")
    if scaling.get("rope_type", "default") != "default" and isinstance(factor, float) and factor > 1:
        if isinstance(all_dim, float) and all_dim:
            mscale = 0.1 * all_dim * math.log(factor) + 1.0
            scale *= mscale * mscale
    return scale


class MLAttention(nn.Module):
    def __init__(self, arch: ModelArch, layer_idx: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        h, bias = arch.hidden_size, arch.attention_bias
        self.num_heads = arch.num_attention_heads
        self.nope_dim, self.rope_dim = arch.qk_nope_head_dim, arch.qk_rope_head_dim
        self.kv_lora_rank, self.v_head_dim = arch.kv_lora_rank, arch.v_head_dim
        q_out = self.num_heads * (self.nope_dim + self.rope_dim)
        self.q_proj: nn.Linear | None = None
        self.q_a_proj: nn.Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: nn.Linear | None = None
        if arch.q_lora_rank:
            self.q_a_proj = nn.Linear(h, arch.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(arch.q_lora_rank, eps=LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(arch.q_lora_rank, q_out, bias=False)
        else:
            self.q_proj = nn.Linear(h, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(
            self.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, h, bias=arch.o_proj_bias)
        self.rotary_emb = rotary_emb
        self.scale = softmax_scale(arch)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, attn: AttentionBatch) -> torch.Tensor:
        n = x.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(n, self.num_heads, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = cast(torch.Tensor, self.kv_a_layernorm(latent.contiguous()))
        # The kernel path rotates in place: contiguous copies, never views of the projections.
        q_pe, k_pe = self.rotary_emb(
            positions, q_pe.contiguous(), k_pe.reshape(n, 1, self.rope_dim).contiguous()
        )
        rows = torch.cat([latent, k_pe.view(n, self.rope_dim)], dim=-1)
        w_uk, w_uv = split_kv_b(self.kv_b_proj.weight, self.num_heads, self.nope_dim)
        o = attn.mla(self.layer_idx, q_nope, q_pe, rows, self.scale, w_uk, w_uv)
        return self.o_proj(o.flatten(1))


class DeepseekDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)); the residual adds are deferred into the
    next norm, as the dense decoder's (models/llama.py)."""

    def __init__(
        self,
        arch: ModelArch,
        layer_idx: int,
        spec: LayerSpec,
        rotary_emb: RotaryEmbedding | None,
        make_mlp: MlpFactory,
    ) -> None:
        super().__init__()
        if rotary_emb is None:
            raise ValueError("latent attention needs RoPE on its rotated dims")
        self.self_attn = MLAttention(arch, layer_idx, rotary_emb)
        self.mlp = make_mlp(arch, layer_idx)
        self.input_layernorm = RMSNorm(arch.hidden_size, eps=arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, eps=arch.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, attn: AttentionBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, attn)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DeepseekV2TopkRouter(nn.Module):
    """mlp.gate of V2: softmax over float32 logits, the topk_group groups with the highest single
    probability (group_limited_greedy; greedy: one group), the top_k of their experts."""

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(arch.num_experts, arch.hidden_size, dtype=torch.float32))
        self.top_k, self.n_group, self.topk_group = arch.num_experts_per_tok, arch.n_group, arch.topk_group
        self.scaling = arch.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(x.float(), self.weight).softmax(dim=-1)
        if self.topk_group < self.n_group:
            grouped = scores.view(scores.shape[0], self.n_group, -1)
            best = grouped.amax(dim=-1).topk(self.topk_group, dim=-1).indices
            keep = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=x.device).scatter_(1, best, True)
            scores = grouped.masked_fill(~keep[:, :, None], 0.0).flatten(1)
        weights, ids = scores.topk(self.top_k, dim=-1)
        return weights * self.scaling, ids.to(torch.int32)


class DeepseekMoE(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        sigmoid = arch.router_scoring == "sigmoid"
        self.gate: nn.Module = Glm4MoeTopkRouter(arch) if sigmoid else DeepseekV2TopkRouter(arch)
        self.experts = Experts(arch.num_experts, arch.hidden_size, arch.moe_intermediate_size)
        shared = arch.shared_expert_intermediate_size
        self.shared_experts = SplitMLP(arch.hidden_size, shared) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        return out if self.shared_experts is None else out + self.shared_experts(x)


def deepseek_mlp(arch: ModelArch, layer_idx: int) -> nn.Module:
    return (
        DeepseekMoE(arch)
        if arch.is_moe_layer(layer_idx)
        else LlamaMLP(arch.hidden_size, arch.intermediate_size)
    )


class DeepseekForCausalLM(nn.Module):
    """DeepseekV2ForCausalLM, DeepseekV3ForCausalLM and Glm4MoeLiteForCausalLM: one class, the
    differences in ModelArch (models/hf_config.py's _deepseek_fields)."""

    packed_modules_mapping = PACKED_MODULES_MAPPING
    linear_input_producers: dict[str, str] = {"mlp.act_fn": "mlp.down_proj"}
    # The router is no nn.Linear and stays float32. kv_b_proj is read as a weight (W_UK / W_UV views,
    # attention/mla.py), never called: FP8 leaves it in the compute dtype.
    unquantized_linear: tuple[str, ...] = ("mlp.gate", "self_attn.kv_b_proj")
    dequantized_at_load: tuple[str, ...] = (
        EXPERT_TENSORS,
        "mlp.gate",
        "self_attn.kv_b_proj",
    )

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        if not arch.is_mla:
            raise ValueError("DeepseekForCausalLM needs a latent-attention ModelArch (kv_lora_rank > 0)")
        self.arch = arch
        self.checkpoint_kv_scales: dict[int, tuple[float, float]] = {}  # filled by load_weights
        self.model = LlamaModel(arch, make_mlp=deepseek_mlp, make_layer=DeepseekDecoderLayer)
        self.lm_head = make_lm_head(arch, self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBatch) -> torch.Tensor:
        return self.model(input_ids, positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def rename_checkpoint(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint without its multi-token-prediction layers (applied before FP8 conversion)."""
        return without_mtp_layers(weights, self.arch.num_hidden_layers)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_packed_weights(self, weights)
        # An FP8 latent cache's scales are (latent, rope) (attention/mla.py). A checkpoint's k_scale
        # covers the whole cached row, as vLLM applies it to MLA layers; its v_scale has no cache here.
        self.checkpoint_kv_scales = {layer: (k, k) for layer, (k, _) in self.checkpoint_kv_scales.items()}
