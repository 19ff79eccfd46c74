"""gpt-oss (gpt-oss-20b, gpt-oss-120b): a mixture-of-experts decoder with learned attention sinks.

Against the Llama decoder (models/llama.py), whose layer wiring, norms and fused q/k/v it keeps:
  - every projection of attention has a bias (q/k/v and o);
  - each attention head has a learned sink logit: one more term in its softmax's denominator, with no
    value (attention/spec.py), passed to the backend as `sinks`;
  - layers alternate a sliding window (128 tokens in the published configs) and full attention
    (ModelArch.layer_types);
  - RoPE with YaRN scaling;
  - every layer's MLP is sparse: a router with a bias picks the top k experts by logit and weighs them
    by the softmax over those k logits (= the full softmax renormalized over the k); each expert's
    gate/up and down projections have biases and its activation is the clamped SwiGLU of the
    reference implementation (layers/moe.py ExpertActivation "swiglu_oai").

Checkpoints keep the experts stacked as [E, in, out] tensors with gate and up columns interleaved
(gate = even columns, up = odd ones). load_weights transposes them to the [E, out, in] layout of
layers/moe.py's Experts and puts the gate rows before the up rows. MXFP4 checkpoints (the published
ones: 4-bit experts in blocks of 32 with one power-of-two scale each, quant/mxfp4.py) are recognised by
their *_blocks / *_scales tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from overnight.attention.metadata import AttentionBatch
from overnight.attention.spec import LayerAttention
from overnight.config import ModelArch
from overnight.layers.moe import ExpertActivation, Experts, select_experts
from overnight.layers.rotary import RotaryEmbedding
from overnight.models.llama import (
    PACKED_MODULES_MAPPING,
    Attention,
    LlamaModel,
    load_packed_weights,
    make_lm_head,
    split_qkv,
)


class GptOssAttention(Attention):
    """The Llama attention (biases on, from ModelArch) with a learned sink per head and the layer's
    window."""

    def __init__(self, arch: ModelArch, layer_idx: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__(arch, layer_idx, rotary_emb)
        self.sinks = nn.Parameter(torch.empty(arch.num_attention_heads))
        self.layer = LayerAttention(sliding_window=arch.layer_window(layer_idx))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, attn: AttentionBatch) -> torch.Tensor:
        q, k, v = split_qkv(self.qkv_proj(x), self.num_heads, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        # The backend reads sinks as float32; the parameter is in the compute dtype like every other.
        o = attn(self.layer_idx, q, k, v, self.scale, layer=self.layer, sinks=self.sinks.float())
        return self.o_proj(o.flatten(1))


class GptOssMoE(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.top_k = arch.num_experts_per_tok
        self.router = nn.Linear(arch.hidden_size, arch.num_experts, bias=True)
        activation = ExpertActivation("swiglu_oai", alpha=1.702, limit=arch.swiglu_limit)
        self.experts = Experts(
            arch.num_experts, arch.hidden_size, arch.moe_intermediate_size, bias=True, activation=activation
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = select_experts(self.router(x), self.top_k, True)
        return self.experts(x, topk_weights, topk_ids)


def gpt_oss_mlp(arch: ModelArch, layer_idx: int) -> nn.Module:
    return GptOssMoE(arch)


class GptOssForCausalLM(nn.Module):
    packed_modules_mapping = PACKED_MODULES_MAPPING
    # With FP8 weights the router stays in the compute dtype (its top-k decides which experts run).
    unquantized_linear: tuple[str, ...] = ("mlp.router",)

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.arch = arch
        self.checkpoint_kv_scales: dict[int, tuple[float, float]] = {}
        self.model = LlamaModel(arch, make_mlp=gpt_oss_mlp)
        # The Llama layers' attention swapped for this one (built on the meta device: nothing is
        # allocated twice); the rotary table stays the one all layers share.
        rotary = next(m for m in self.model.modules() if isinstance(m, RotaryEmbedding))
        for i, layer in enumerate(self.model.layers):
            layer.self_attn = GptOssAttention(arch, i, rotary)
        self.lm_head = make_lm_head(arch, self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBatch) -> torch.Tensor:
        return self.model(input_ids, positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_packed_weights(self, _to_stacked_layout(weights, self))


_EXPERT_TENSORS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def _to_stacked_layout(
    weights: Iterable[tuple[str, torch.Tensor]], model: GptOssForCausalLM
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's expert tensors in Experts' layout, one per expert and projection, named as
    load_packed_weights expects them (experts.{e}.gate_proj.weight, ...; biases as .bias); MXFP4 pairs
    (*_blocks, *_scales) dequantized first. Every other tensor passes through."""
    from overnight.quant.mxfp4 import dequantize_mxfp4

    pending: dict[str, torch.Tensor] = {}  # an MXFP4 tensor's half that arrived first
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".")
        if not prefix.endswith("mlp.experts"):
            yield name, tensor
            continue
        if leaf.endswith(("_blocks", "_scales")):
            base = leaf.rsplit("_", 1)[0]
            other = f"{prefix}.{base}_{'scales' if leaf.endswith('_blocks') else 'blocks'}"
            if other not in pending:
                pending[name] = tensor
                continue
            blocks, scales = (
                (tensor, pending.pop(other)) if leaf.endswith("_blocks") else (pending.pop(other), tensor)
            )
            dtype = model.model.embed_tokens.weight.dtype
            # [E, out, in] already (MXFP4 blocks run along the input dimension)
            yield from _per_expert(prefix, base, dequantize_mxfp4(blocks, scales, dtype), out_major=True)
            continue
        if leaf not in _EXPERT_TENSORS:
            yield name, tensor  # unexpected: load_packed_weights names it
            continue
        yield from _per_expert(prefix, leaf, tensor, out_major=False)
    if pending:
        from overnight.errors import ModelLoadError

        raise ModelLoadError(f"MXFP4 tensors without their other half: {', '.join(sorted(pending))}")


def _per_expert(
    prefix: str, leaf: str, tensor: torch.Tensor, out_major: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """Split one stacked checkpoint tensor into load_packed_weights' per-expert pieces. out_major: the
    weight is [E, out, in] (dequantized MXFP4), else [E, in, out] (the checkpoint's float layout).

    Weights become experts.{e}.{gate,up,down}_proj.weight (the names per-expert checkpoints use);
    biases, which have no per-expert checkpoint form, become the whole row of the stacked bias
    parameter, experts.{e}.{gate_up,down}_bias.weight ([gate | up] for the first)."""
    for e in range(tensor.shape[0]):
        if leaf == "gate_up_proj_bias":  # interleaved: gate even, up odd
            yield f"{prefix}.{e}.gate_up_bias.weight", torch.cat([tensor[e, 0::2], tensor[e, 1::2]])
        elif leaf == "down_proj_bias":
            yield f"{prefix}.{e}.down_bias.weight", tensor[e]
        else:
            t = tensor[e] if out_major else tensor[e].t()  # [out, in]
            if leaf == "gate_up_proj":
                yield f"{prefix}.{e}.gate_proj.weight", t[0::2]
                yield f"{prefix}.{e}.up_proj.weight", t[1::2]
            else:
                yield f"{prefix}.{e}.down_proj.weight", t
