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
ones: 4-bit experts in blocks of 32 with one power-of-two scale each, quant/mxfp4.py; config.json's
quantization_config says quant_method "mxfp4") keep their experts packed by default: the fused GEMMs
decode them in registers on the GPU, the CPU path dequantizes the experts a step runs. With
ModelArch.experts_mxfp4_dense (the mxfp4_experts option) each expert is dequantized to the compute dtype as
its blocks and scales arrive (_dequantized_experts: one expert's rows at a time, after any tensor-parallel
slicing, so each rank dequantizes only its share) and runs through the 16-bit fused MoE. With
experts_mxfp4_fp8 as well (mxfp4_experts fp8) the experts are e4m3 from the build on (Experts.store_fp8_):
each expert's rows are dequantized to float32 (exact, whatever the compute dtype's range) and quantized per
row as they arrive (Experts.load_fp8_rows_, through models/checkpoint.copy_weight), so no layer's experts
are ever held in a float dtype; they run through the FP8 fused MoE with the biases (compute dtype) and the
clamped SwiGLU in its epilogues. The row scales are powers of two (quant/fp8.pow2_row_scales): an e2m1
value times its block's power of two 2^j then lands on an e4m3 value exactly unless 2^j is below 2^-15
of its row's largest magnitude (e4m3's subnormal floor), so the e4m3 experts hold the dense form's
weights, bit for bit, in all but such rows (tests/test_mxfp4_fp8_experts.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from overnight.arch import ModelArch
from overnight.attention.metadata import AttentionBatch
from overnight.errors import ModelLoadError
from overnight.layers.moe import ExpertActivation, Experts, select_experts
from overnight.layers.rotary import RotaryEmbedding
from overnight.models.layer_spec import LayerSpec
from overnight.models.llama import (
    PACKED_MODULES_MAPPING,
    Attention,
    LlamaDecoderLayer,
    LlamaModel,
    MlpFactory,
    load_packed_weights,
    make_lm_head,
    split_qkv,
)


class GptOssAttention(Attention):
    """The Llama attention (biases on, from ModelArch; the layer's window from its LayerSpec) with a
    learned sink per head."""

    def __init__(
        self, arch: ModelArch, layer_idx: int, spec: LayerSpec, rotary_emb: RotaryEmbedding | None
    ) -> None:
        super().__init__(arch, layer_idx, spec, rotary_emb)
        self.sinks = nn.Parameter(torch.empty(arch.num_attention_heads))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, attn: AttentionBatch) -> torch.Tensor:
        q, k, v = split_qkv(self.qkv_proj(x), self.num_heads, self.num_kv_heads, self.head_dim)
        assert self.rotary_emb is not None  # every gpt-oss layer has RoPE
        q, k = self.rotary_emb(positions, q, k)
        # The kernels read sinks as float32; the parameter is in the compute dtype like every other.
        o = attn(self.layer_idx, q, k, v, self.scale, layer=self.layer_attention, sinks=self.sinks.float())
        return self.o_proj(o.flatten(1))


def gpt_oss_layer(
    arch: ModelArch, layer_idx: int, spec: LayerSpec, rotary_emb: RotaryEmbedding | None, make_mlp: MlpFactory
) -> nn.Module:
    layer = LlamaDecoderLayer(arch, layer_idx, spec, rotary_emb, make_mlp)
    layer.self_attn = GptOssAttention(arch, layer_idx, spec, rotary_emb)  # built on the meta device
    return layer


class GptOssMoE(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.top_k = arch.num_experts_per_tok
        self.router = nn.Linear(arch.hidden_size, arch.num_experts, bias=True)
        activation = ExpertActivation("swiglu_oai", alpha=1.702, limit=arch.swiglu_limit)
        self.experts = Experts(
            arch.num_experts,
            arch.hidden_size,
            arch.moe_intermediate_size,
            bias=True,
            activation=activation,
            mxfp4=arch.holds_mxfp4_experts,
        )
        if arch.experts_mxfp4_fp8:  # mxfp4_experts fp8: requantized per row as they load (module docstring)
            self.experts.store_fp8_(pow2_scales=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = select_experts(self.router(x), self.top_k, True)
        return self.experts(x, topk_weights, topk_ids)


def gpt_oss_mlp(arch: ModelArch, layer_idx: int) -> nn.Module:
    return GptOssMoE(arch)


class GptOssForCausalLM(nn.Module):
    packed_modules_mapping = PACKED_MODULES_MAPPING
    # With FP8 weights the router stays in the compute dtype (its top-k decides which experts run).
    unquantized_linear: tuple[str, ...] = ("mlp.router",)
    # The one family whose FP8 experts load in the compute dtype and are quantized once loaded
    # (quant/apply.quantize_experts) rather than e4m3 from the build on: its published experts are
    # MXFP4, which stay packed either way, and its dense-expert forms (mxfp4_experts dense, a bf16
    # checkpoint) load through _to_stacked_layout / _dequantized_experts, which no test runs into e4m3
    # stacks (the fit check counts their load in the compute dtype accordingly, loader/fit.py). The
    # mxfp4_experts fp8 form is the exception, decided by the arch rather than by quantization: its
    # experts are e4m3 from the build on (GptOssMoE), whatever the quantization option says.
    experts_fp8_at_load = False

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.arch = arch
        self.checkpoint_kv_scales: dict[int, tuple[float, float]] = {}
        self.model = LlamaModel(arch, make_mlp=gpt_oss_mlp, make_layer=gpt_oss_layer)
        self.lm_head = make_lm_head(arch, self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBatch) -> torch.Tensor:
        return self.model(input_ids, positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        stream = _to_stacked_layout(weights, self)
        if self.arch.experts_mxfp4_dense:
            experts = next(m for m in self.modules() if isinstance(m, Experts))
            # e4m3 experts take float32 rows (quantized per row as they are copied in); dense ones the
            # compute dtype (exact for every e2m1 value times a power of two in bf16 and fp32)
            dtype = torch.float32 if experts.stores_fp8 else experts.gate_up_proj.dtype
            stream = _dequantized_experts(stream, dtype)
        load_packed_weights(self, stream)

    def checkpoint_layout(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors under the per-expert names load_weights takes (gate and up
        de-interleaved), for tensor parallelism to slice before loading (parallel/tp_load.py). load_weights
        passes tensors already in this layout through unchanged."""
        return _to_stacked_layout(weights, self)


_EXPERT_TENSORS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def _to_stacked_layout(
    weights: Iterable[tuple[str, torch.Tensor]], model: GptOssForCausalLM
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's expert tensors in Experts' layout, one per expert and projection, named as
    load_packed_weights expects them; every other tensor passes through.

    Weights become experts.{e}.{gate,up,down}_proj.weight (the names per-expert checkpoints use; MXFP4
    blocks [E, out, in/32, 16] as rows of in/2 bytes). Biases and MXFP4 scales, which have no per-expert
    checkpoint form, become the whole row of their stacked parameter, experts.{e}.{gate_up,down}_bias.weight
    and experts.{e}.{gate_up,down}_scales.weight ([gate | up] for gate/up)."""
    mxfp4_halves: dict[str, set[str]] = {}  # prefix.proj -> which of _blocks / _scales came
    for name, tensor in _checked_pairs(weights, mxfp4_halves):
        prefix, _, leaf = name.rpartition(".")
        if not prefix.endswith("mlp.experts"):
            yield name, tensor
            continue
        proj = leaf.removesuffix("_blocks").removesuffix("_scales").removesuffix("_bias")
        kind = leaf[len(proj) :]
        if proj not in ("gate_up_proj", "down_proj") or kind not in ("", "_bias", "_blocks", "_scales"):
            yield name, tensor  # unexpected: load_packed_weights names it
            continue
        for e in range(tensor.shape[0]):
            t = tensor[e]
            if kind == "":  # float weights: [in, out] in the checkpoint
                t = t.t()
            elif kind == "_blocks":
                t = t.flatten(-2)  # [out, in/32, 16] -> [out, in/2]
            if kind in ("", "_blocks"):
                if proj == "gate_up_proj":  # interleaved rows: gate even, up odd
                    yield f"{prefix}.{e}.gate_proj.weight", t[0::2]
                    yield f"{prefix}.{e}.up_proj.weight", t[1::2]
                else:
                    yield f"{prefix}.{e}.down_proj.weight", t
            else:
                stacked = proj.removesuffix("_proj") + ("_bias" if kind == "_bias" else "_scales")
                if proj == "gate_up_proj":
                    t = torch.cat([t[0::2], t[1::2]])
                yield f"{prefix}.{e}.{stacked}.weight", t


def _checked_pairs(
    weights: Iterable[tuple[str, torch.Tensor]], halves: dict[str, set[str]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream unchanged; at its end, an MXFP4 tensor that came without its other half is named."""
    for name, tensor in weights:
        for kind in ("_blocks", "_scales"):
            if name.endswith(kind):
                halves.setdefault(name.removesuffix(kind), set()).add(kind)
        yield name, tensor
    lonely = [
        base + ("_scales" if kinds == {"_blocks"} else "_blocks")
        for base, kinds in halves.items()
        if len(kinds) == 1
    ]
    if lonely:
        raise ModelLoadError(
            f"MXFP4 checkpoint lacks {', '.join(sorted(lonely))} (blocks and scales come in pairs)"
        )


# One expert's MXFP4 tensors as _to_stacked_layout names them: "<prefix>.<e>.<part>.weight" -> the pair
# they belong to and their role in it. Gate and up rows share the gate_up scales ([gate | up] rows).
_MXFP4_PARTS = {
    "gate_proj": ("gate_up", "gate"),
    "up_proj": ("gate_up", "up"),
    "gate_up_scales": ("gate_up", "scales"),
    "down_proj": ("down", "down"),
    "down_scales": ("down", "scales"),
}
_MXFP4_NEEDS = {"gate_up": {"gate", "up", "scales"}, "down": {"down", "scales"}}


def _dequantized_experts(
    weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """The per-expert stream of _to_stacked_layout (possibly sliced for a tensor-parallel rank) with every
    expert's MXFP4 rows replaced by their values in dtype, under the names of an unquantized checkpoint's
    experts; other tensors pass through. An expert's blocks wait for its scales (or the reverse): at most
    one checkpoint tensor's worth of packed rows is held, and each expert is dequantized on its own."""
    pending: dict[str, dict[str, torch.Tensor]] = {}  # "<prefix>.<e>.<gate_up|down>" -> roles so far
    for name, tensor in weights:
        stem, _, leaf = name.rpartition(".")
        owner, _, part = stem.rpartition(".")
        role = _MXFP4_PARTS.get(part)
        if leaf != "weight" or role is None or tensor.dtype != torch.uint8:
            yield name, tensor  # float experts, biases and everything else
            continue
        pair, what = role
        key = f"{owner}.{pair}"
        held = pending.setdefault(key, {})
        held[what] = tensor
        if held.keys() != _MXFP4_NEEDS[pair]:
            continue
        del pending[key]
        scales = held["scales"]
        if pair == "down":
            yield f"{owner}.down_proj.weight", _rows(held["down"], scales, dtype, name)
            continue
        n = held["gate"].shape[0]
        yield f"{owner}.gate_proj.weight", _rows(held["gate"], scales[:n], dtype, name)
        yield f"{owner}.up_proj.weight", _rows(held["up"], scales[n:], dtype, name)
    if pending:
        missing = {k: sorted(_MXFP4_NEEDS[k.rpartition(".")[2]] - v.keys()) for k, v in pending.items()}
        raise ModelLoadError(
            "MXFP4 experts incomplete at the end of the checkpoint: "
            + "; ".join(f"{k} lacks {', '.join(m)}" for k, m in sorted(missing.items()))
        )


def _rows(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, name: str) -> torch.Tensor:
    """Packed rows [N, K/2] with their scales [N, K/32] -> [N, K] in dtype."""
    if blocks.shape[-1] % 16 or blocks.shape[:-1] != scales.shape[:-1]:
        raise ModelLoadError(
            f"MXFP4 rows of {tuple(blocks.shape)} do not match their scales {tuple(scales.shape)} ({name})"
        )
    from overnight.quant.mxfp4 import dequantize_mxfp4

    try:
        return dequantize_mxfp4(blocks.unflatten(-1, (-1, 16)), scales, dtype)
    except ValueError as e:
        raise ModelLoadError(f"{name}: {e}") from None
