"""The dense decoder of Llama (3.x, SmolLM2), Qwen2 and Qwen3, with fused qkv and gate/up projections.

Attribute names follow the HF checkpoint keys, except the two fused projections; load_weights maps the
checkpoint's separate q/k/v and gate/up tensors into them through packed_modules_mapping. The families
differ only in flags of ModelArch (attention_bias, o_proj_bias, qk_norm).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

import torch
from torch import nn

from overnight.attention.metadata import AttentionBatch
from overnight.config import ModelArch
from overnight.errors import ModelLoadError
from overnight.layers.activation import SiluAndMul
from overnight.layers.norm import RMSNorm
from overnight.layers.rotary import RotaryEmbedding

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
    q/k/v (Qwen2, some Llamas), a bias on o_proj (Llama's attention_bias covers it), and an RMSNorm over
    each head of q and k before RoPE (Qwen3)."""

    def __init__(self, arch: ModelArch, layer_idx: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        # Head counts are attributes (not re-derived from arch) so tensor parallelism can shrink them.
        self.num_heads = arch.num_attention_heads
        self.num_kv_heads = arch.num_key_value_heads
        self.head_dim = arch.head_dim
        self.scale = arch.head_dim**-0.5
        self.qkv_proj = nn.Linear(arch.hidden_size, arch.q_size + 2 * arch.kv_size, bias=arch.attention_bias)
        self.o_proj = nn.Linear(arch.q_size, arch.hidden_size, bias=arch.o_proj_bias)
        # Over head_dim only, so the weights are shared by all heads and survive head sharding.
        self.q_norm = RMSNorm(arch.head_dim, eps=arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(arch.head_dim, eps=arch.rms_norm_eps) if arch.qk_norm else None
        self.rotary_emb = rotary_emb

    def forward(self, positions: torch.Tensor, x: torch.Tensor, attn: AttentionBatch) -> torch.Tensor:
        q, k, v = split_qkv(self.qkv_proj(x), self.num_heads, self.num_kv_heads, self.head_dim)
        # The norms run inside the rotary layer, so the GPU path fuses norm + rotation into one kernel.
        q, k = self.rotary_emb(positions, q, k, q_norm=self.q_norm, k_norm=self.k_norm)
        o = attn(self.layer_idx, q, k, v, self.scale)
        return self.o_proj(o.flatten(1))


def split_qkv(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[T, (Hq + 2 Hkv) * D] -> q [T, Hq, D], k and v [T, Hkv, D] (views; v is not contiguous)."""
    n = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return q.view(n, -1, head_dim), k.view(n, -1, head_dim), v.view(n, -1, head_dim)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, arch: ModelArch, layer_idx: int, rotary_emb: RotaryEmbedding, make_mlp: MlpFactory = dense_mlp
    ) -> None:
        super().__init__()
        self.self_attn = Attention(arch, layer_idx, rotary_emb)
        self.mlp = make_mlp(arch, layer_idx)
        self.input_layernorm = RMSNorm(arch.hidden_size, eps=arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, eps=arch.rms_norm_eps)

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
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, arch: ModelArch, make_mlp: MlpFactory = dense_mlp) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        # One table shared by every layer (it is registered under each, but stored once).
        rotary_emb = RotaryEmbedding(
            arch.head_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling_dict()
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(arch, i, rotary_emb, make_mlp) for i in range(arch.num_hidden_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, eps=arch.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBatch) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, attn)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    """The decoder plus LM head: Llama, Qwen2 and Qwen3 (the architecture's flags say which)."""

    packed_modules_mapping = PACKED_MODULES_MAPPING
    linear_input_producers = LINEAR_INPUT_PRODUCERS

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.arch = arch
        self.checkpoint_kv_scales: dict[int, tuple[float, float]] = {}  # filled by load_weights
        self.model = LlamaModel(arch)
        self.lm_head = make_lm_head(arch, self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBatch) -> torch.Tensor:
        return self.model(input_ids, positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_packed_weights(self, weights)


def make_lm_head(arch: ModelArch, embed_tokens: nn.Embedding) -> nn.Linear:
    if not arch.tie_word_embeddings:
        return nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
    # Tied: allocate nothing (meta) and point the weight at the embedding table.
    head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False, device="meta")
    head.weight = embed_tokens.weight
    return head


# ---------------------------------------------------------------------------------------------------
# Checkpoint loading, shared by every family built from these blocks.


def _shard_range(arch: ModelArch, shard: str | int, in_expert: bool) -> tuple[int, int]:
    """(row offset, rows) of one checkpoint projection inside its fused parameter (full, unsharded)."""
    if shard == "q":
        return 0, arch.q_size
    if shard == "k":
        return arch.q_size, arch.kv_size
    if shard == "v":
        return arch.q_size + arch.kv_size, arch.kv_size
    inter = arch.moe_intermediate_size if in_expert else arch.intermediate_size
    return int(shard) * inter, inter


# Where one checkpoint tensor goes: (parameter name, expert, shard id). Stacked expert parameters
# ([E, ...], module "experts") take one checkpoint tensor per expert (expert is None elsewhere); the
# shard id names a projection's rows inside a fused parameter (None: all of it).
Target = tuple[str, int | None, str | int | None]


def _checkpoint_names(
    pname: str, num_rows: int, mapping: dict[str, tuple[str, str | int]]
) -> dict[str, Target]:
    """The checkpoint tensors that fill parameter `pname` (num_rows: its first dimension)."""
    parts = pname.split(".")
    if len(parts) >= 2 and parts[-2] == "experts":  # experts.gate_up_proj <- experts.{e}.gate_proj.weight
        prefix, leaf = ".".join(parts[:-1]), parts[-1]
        sources: list[tuple[str, str | int | None]] = [
            (src, shard) for src, (fused, shard) in mapping.items() if fused == leaf
        ] or [(leaf, None)]
        return {
            f"{prefix}.{e}.{src}.weight": (pname, e, shard) for e in range(num_rows) for src, shard in sources
        }
    for i, part in enumerate(parts):
        sources = [(src, shard) for src, (fused, shard) in mapping.items() if fused == part]
        if sources:
            return {
                ".".join(parts[:i] + [src] + parts[i + 1 :]): (pname, None, shard) for src, shard in sources
            }
    return {pname: (pname, None, None)}


_KV_SCALE_NAME = re.compile(r"model\.layers\.(\d+)\.self_attn\.([kv])_scale")


def _kv_scale_of(name: str) -> tuple[int, int] | None:
    """(layer, 0 for k / 1 for v) when `name` is an FP8 checkpoint's per-layer KV-cache scale."""
    match = _KV_SCALE_NAME.fullmatch(name)
    return (int(match.group(1)), "kv".index(match.group(2))) if match else None


def _listing(names: Iterable[str], limit: int = 8) -> str:
    names = sorted(names)
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


class PackedModel(Protocol):
    """What load_packed_weights reads and writes of a model class (every family of these blocks)."""

    arch: ModelArch
    packed_modules_mapping: dict[str, tuple[str, str | int]]
    checkpoint_kv_scales: dict[int, tuple[float, float]]

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...


@torch.no_grad()
def load_packed_weights(model: PackedModel, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy HF-named tensors into `model`, fusing the separate q/k/v and gate/up tensors and stacking
    per-expert tensors (mlp.experts.N.*) into the experts' parameters. Raises ModelLoadError naming every
    missing or unexpected tensor, and the first shape mismatch.

    KV-cache scales (model.layers.N.self_attn.k_scale / v_scale, as FP8 checkpoints ship them) are not
    parameters: they are collected into model.checkpoint_kv_scales, {layer: (k_scale, v_scale)} with
    1.0 for a missing one, for the runner's FP8 cache."""
    arch = model.arch
    mapping = model.packed_modules_mapping
    params = dict(model.named_parameters())  # a tied lm_head.weight appears once, as the embedding
    # checkpoint name -> where it goes; the checkpoint must supply every one
    expected: dict[str, Target] = {}
    for pname, param in params.items():
        expected.update(_checkpoint_names(pname, param.shape[0], mapping))

    seen: set[str] = set()
    unexpected: list[str] = []
    kv_scales: dict[int, list[float]] = {}
    for name, tensor in weights:
        if "rotary_emb.inv_freq" in name:
            continue  # the rotary table is recomputed, never loaded
        kv_scale = _kv_scale_of(name)
        if kv_scale is not None:
            layer, which = kv_scale
            kv_scales.setdefault(layer, [1.0, 1.0])[which] = float(tensor.float().max())
            continue
        if name == "lm_head.weight" and arch.tie_word_embeddings:
            continue  # some tied checkpoints store a copy of the embedding
        if name not in expected:
            unexpected.append(name)
            continue
        pname, expert, shard = expected[name]
        target = params[pname].data
        if expert is not None:
            target = target[expert]
        if shard is not None:
            start, rows = _shard_range(arch, shard, in_expert=expert is not None)
            target = target.narrow(0, start, rows)
        if tuple(tensor.shape) != tuple(target.shape):
            raise ModelLoadError(
                f"shape mismatch for tensor {name}: checkpoint has {list(tensor.shape)}, "
                f"the model expects {list(target.shape)} (does config.json match the weights?)"
            )
        target.copy_(tensor)
        seen.add(name)

    model.checkpoint_kv_scales = {layer: (k, v) for layer, (k, v) in sorted(kv_scales.items())}
    problems = []
    missing = set(expected) - seen
    if missing:
        problems.append(f"missing tensors: {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_listing(unexpected)}")
    if problems:
        raise ModelLoadError(
            f"checkpoint does not match the {type(model).__name__} architecture: " + "; ".join(problems)
        )
