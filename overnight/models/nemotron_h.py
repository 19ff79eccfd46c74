"""NVIDIA Nemotron-H hybrids (`NemotronHForCausalLM`: Nemotron-H-8B / 47B / 56B, NVIDIA-Nemotron-Nano-9B-v2
and -12B-v2, Nemotron 3's NVIDIA-Nemotron-3-Nano-30B-A3B): a stack of blocks, each a single mixer behind
its own RMSNorm and residual, the kind of each one character of config.json's `hybrid_override_pattern`
(transformers 5 saves it as `layers_block_type`):

    "M" Mamba2 (models/mamba2_mixer.py; its gated RMSNorm per group of B/C: mamba_norm_groups = n_groups)
    "*" attention without any position encoding (Llama's attention, NoPE, no bias)
    "-" MLP: up_proj -> relu(x)^2 -> down_proj, no gate (models/nemotron_h_mlp.py)
    "E" mixture of experts (Nemotron 3): grouped sigmoid router, ungated relu^2 experts and a shared
        expert (models/nemotron_h_mlp.py)

    block = x + mixer(norm(x));  model = norm_f(blocks(embeddings(ids)));  lm_head (never tied, as in
    transformers, whose NemotronHForCausalLM ignores tie_word_embeddings)

Only the Mamba2 and attention blocks are layers of the ModelArch (layer_types "linear_attention" /
"full_attention": the state cache and the KV cache are indexed by them); the MLP and MoE blocks sit
between them and count in ModelArch.mlp_blocks / moe_blocks. Checkpoint names are transformers'
(model.layers.N.mixer.*, N the block's index in the pattern); the published checkpoints' `backbone.`
prefix is read as `model.`, and their multi-token-prediction tensors (`mtp.*`, which generation does
not use) are skipped.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from overnight.arch import ModelArch
from overnight.attention.metadata import AttentionBatch
from overnight.errors import ModelLoadError
from overnight.layers.norm import RMSNorm
from overnight.models.checkpoint import load_packed_weights
from overnight.models.granite_hybrid import PACKED_MODULES_MAPPING, json_float  # q/k/v -> qkv_proj
from overnight.models.layer_spec import layer_specs
from overnight.models.llama import Attention, make_lm_head
from overnight.models.mamba2_mixer import Mamba2Mixer
from overnight.models.nemotron_h_mlp import (
    EXPERT_PACKING,
    EXPERT_TENSORS,
    NemotronHMLP,
    NemotronHMoE,
    nemotron_h_moe_fields,
)

logger = logging.getLogger(__name__)

# pattern character -> block kind (transformers' layers_block_type names)
_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


class NemotronHBlock(nn.Module):
    """One block of the pattern: norm -> mixer, its residual add deferred into the next block's fused
    add + norm (as LlamaDecoderLayer does)."""

    def __init__(self, kind: str, mixer: nn.Module, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.kind = kind  # fixed at build: the branch below is the same in capture and replay
        self.norm = RMSNorm(hidden_size, eps=eps)
        self.mixer = mixer

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, attn: AttentionBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            x = self.norm(x)
        else:
            x, residual = self.norm(x, residual)
        if self.kind == "linear_attention":
            return self.mixer(x, attn), residual
        if self.kind == "full_attention":
            return self.mixer(positions, x, attn), residual
        return self.mixer(x), residual


class NemotronHModel(nn.Module):
    def __init__(self, arch: ModelArch, kinds: tuple[str, ...]) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(arch.vocab_size, arch.hidden_size)
        specs = layer_specs(arch)
        blocks: list[NemotronHBlock] = []
        layer = 0  # the ModelArch layer (KV cache / state cache index) of the next mixer block
        for kind in kinds:
            mixer: nn.Module
            if kind == "linear_attention":
                mixer = Mamba2Mixer(arch, sum(arch.is_linear_layer(i) for i in range(layer)))
                layer += 1
            elif kind == "full_attention":
                mixer = Attention(arch, layer, specs[layer], None)
                layer += 1
            elif kind == "moe":
                mixer = NemotronHMoE(arch)
            else:
                mixer = NemotronHMLP(arch.hidden_size, arch.intermediate_size)
            blocks.append(NemotronHBlock(kind, mixer, arch.hidden_size, arch.rms_norm_eps))
        self.layers = nn.ModuleList(blocks)
        self.norm_f = RMSNorm(arch.hidden_size, eps=arch.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBatch) -> torch.Tensor:
        x = self.embeddings(input_ids)
        residual = None
        for block in self.layers:
            x, residual = block(positions, x, residual, attn)
        x, _ = self.norm_f(x, residual)
        return x


class NemotronHForCausalLM(nn.Module):
    packed_modules_mapping = {**PACKED_MODULES_MAPPING, **EXPERT_PACKING}
    # The router (mixer.gate) is no nn.Linear: it stays float32 under any quantization.
    dequantized_at_load: tuple[str, ...] = (EXPERT_TENSORS, "mixer.gate")

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        if not arch.block_pattern or not arch.is_mamba2:
            raise ModelLoadError("a Nemotron-H architecture needs its block pattern and Mamba2 sizes")
        self.arch = arch
        self.checkpoint_kv_scales: dict[int, tuple[float, float]] = {}
        self.model = NemotronHModel(arch, block_kinds_of(arch))
        self.lm_head = make_lm_head(arch, self.model.embeddings)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBatch) -> torch.Tensor:
        return self.model(input_ids, positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @staticmethod
    def rename_checkpoint(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Applied to the checkpoint stream before FP8 conversion (loader/model_loader.checkpoint_weights),
        which looks tensors up by the model's names."""
        return _nemotron_names(weights)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_packed_weights(self, _nemotron_names(weights))  # renamed names pass unchanged


def _nemotron_names(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    skipped = 0
    for name, tensor in weights:
        if name.startswith("mtp."):  # multi-token prediction (speculative decoding): not used here
            skipped += 1
            continue
        if name.startswith("backbone."):  # the published checkpoints' prefix (transformers renames it too)
            name = "model." + name.removeprefix("backbone.")
        if name.endswith(".mixer.experts.up_proj"):  # transformers 5's stack [E, I, H]: the up rows
            name = name.removesuffix("up_proj") + "gate_up_proj"
        yield name, tensor
    if skipped:
        logger.info(
            "skipped %d multi-token-prediction tensors (mtp.*): generation does not use them", skipped
        )


def block_kinds_of(arch: ModelArch) -> tuple[str, ...]:
    """Every block's kind, in order, from arch.block_pattern."""
    return tuple(_PATTERN[c] for c in arch.block_pattern)


# ---------------------------------------------------------------------------------------------------
# config.json -> ModelArch


def _block_kinds(cfg: dict[str, Any]) -> list[str]:
    """Each block's kind from config.json: layers_block_type (transformers 5) or hybrid_override_pattern
    (the published configs)."""
    types = cfg.get("layers_block_type") or cfg.get("layer_types")
    if types is None:
        pattern = cfg.get("hybrid_override_pattern")
        if not isinstance(pattern, str) or not pattern:
            raise ModelLoadError("config.json has neither hybrid_override_pattern nor layers_block_type")
        bad = sorted(set(pattern) - set(_PATTERN))
        if bad:
            raise ModelLoadError(
                f"hybrid_override_pattern holds {bad}: each character must be one of M * - E"
            )
        types = [_PATTERN[c] for c in pattern]
    legacy = {"mamba": "linear_attention", "attention": "full_attention"}
    types = [legacy.get(t, t) for t in types]
    unknown = sorted(set(types) - set(_PATTERN.values()))
    if unknown:
        raise ModelLoadError(
            f"layers_block_type holds {unknown}: each must be one of {sorted(_PATTERN.values())}"
        )
    return types


def nemotron_h_arch(cfg: dict[str, Any]) -> ModelArch:
    """ModelArch of a NemotronH config. Raises ModelLoadError naming what is missing or unsupported."""
    try:
        return _nemotron_h_arch(cfg)
    except KeyError as e:
        raise ModelLoadError(f"config.json lacks required field {e.args[0]!r}") from None


def _first(cfg: dict[str, Any], names: tuple[str, ...], default: Any) -> Any:
    """The first of `names` config.json has (transformers 5 renamed several Mamba fields on save)."""
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    return default


def _nemotron_h_arch(cfg: dict[str, Any]) -> ModelArch:
    kinds = _block_kinds(cfg)
    moe = nemotron_h_moe_fields(cfg) if "moe" in kinds else {}
    for field, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if cfg.get(field, want) != want:
            raise ModelLoadError(f"unsupported {field} {cfg[field]!r} (only {want})")
    if cfg.get("mlp_bias"):
        raise ModelLoadError("mlp_bias true is not supported yet for Nemotron-H")
    mixers = tuple(k for k in kinds if k not in ("mlp", "moe"))
    if "full_attention" not in mixers:
        raise ModelLoadError("a Nemotron-H pattern without attention blocks ('*') is not supported")
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    # Defaults are transformers' NemotronHConfig's (its configs always write these fields).
    m_heads, d_head = int(cfg.get("mamba_num_heads", 128)), int(cfg.get("mamba_head_dim", 64))
    groups = int(_first(cfg, ("n_groups", "mamba_n_groups"), 8))
    if m_heads <= 0 or d_head <= 0 or groups <= 0 or m_heads % groups:
        raise ModelLoadError(
            f"Mamba2 sizes do not fit: mamba_num_heads {m_heads} must be a positive multiple of n_groups "
            f"{groups}, mamba_head_dim {d_head} positive"
        )
    conv = int(_first(cfg, ("conv_kernel", "mamba_d_conv"), 4))
    if conv < 2:
        raise ModelLoadError(f"conv_kernel must be at least 2, got {conv}")
    # dt's clamp is time_step_limit, as NVIDIA's own modeling code and vLLM take it ((0, inf) in the
    # published configs: none). transformers 5 clamps at time_step_min instead, in its chunked prefill
    # only (not its decode step); the two differ only where softplus(dt + dt_bias) < time_step_min.
    limit = _first(cfg, ("time_step_limit", "mamba_dt_limit"), (0.0, float("inf")))
    return ModelArch(
        architecture="nemotron_h",
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),  # the MLP blocks'
        num_hidden_layers=len(mixers),
        num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads", 8) or heads),
        # head_dim (NVIDIA's own configs: attention_head_dim) is 128 when absent, not hidden / heads
        # (Nano-9B-v2: 4,480 / 40 = 112, its heads 128 wide)
        head_dim=int(_first(cfg, ("head_dim", "attention_head_dim"), 128)),
        rms_norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        # transformers' NemotronHForCausalLM ties nothing (_tied_weights_keys is empty), whatever
        # tie_word_embeddings says: its checkpoints hold lm_head.weight (every published config: false)
        tie_word_embeddings=False,
        layer_types=mixers,
        no_rope_layers=tuple(range(len(mixers))),  # attention without position encoding
        block_pattern="".join({v: k for k, v in _PATTERN.items()}[k] for k in kinds),
        mamba_n_heads=m_heads,
        mamba_d_head=d_head,
        mamba_d_state=int(_first(cfg, ("ssm_state_size", "mamba_d_state"), 128)),
        mamba_n_groups=groups,
        mamba_norm_groups=groups,  # Zamba2RMSNormGated with group_size = width / n_groups
        mamba_d_conv=conv,
        mamba_conv_bias=bool(_first(cfg, ("use_conv_bias", "mamba_conv_bias"), True)),
        mamba_proj_bias=bool(cfg.get("use_bias", False)),  # in_proj and out_proj
        mamba_dt_limit=(json_float(limit[0]), json_float(limit[1])),
        **moe,
    )
