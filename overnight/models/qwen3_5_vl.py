"""Qwen3.5 / Qwen3.6 with images (Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration):
the hybrid decoder of models/qwen3_next.py with M-RoPE in its full-attention layers, and Qwen3-VL's
vision tower (models/vision/qwen_vit.py) without its deepstack mergers.

What differs from Qwen3-VL (transformers' qwen3_5 / qwen3_5_moe modeling files beside qwen3_vl's):
- the tower is Qwen3-VL's block for block (patch embedding with a bias, the learned position table
  resampled bilinearly, 2-D RoPE, LayerNorm blocks with a GELU MLP, the 2x2 merger), but has no
  deepstack: the image features enter the decoder only as the image tokens' input embeddings;
- M-RoPE turns only each head's partial rotary dims (hybrid_rotary_dim: 64 of 256 in the published
  sizes), always interleaved (transformers ignores mrope_interleaved here); mrope_section defaults to
  [11, 11, 10] as transformers' does, and need not fill the rotary dims (layers/mrope.py);
- an image's token positions and the rope delta of the text after it are Qwen3-VL's (built in
  multimodal/processor.py); MoE or dense is the text model's business (ModelArch.architecture).

Hybrid state and images: the linear layers' state after a block depends on the image embeddings in
it, so a prefix-cache hit (its KV blocks and the state snapshot at its end alike) must match the
images' content, not only their placeholder ids: a block's hash includes the content hashes of the
images it holds (engine/kv_cache_manager.py), and snapshots are keyed by those hashes
(engine/state_snapshots.py).

Checkpoint names: model.language_model.* -> model.*, model.visual.* -> visual.*; the multi-token
prediction head (mtp.*) is skipped.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Any, cast

import torch
from torch import nn

from overnight.arch import ModelArch
from overnight.attention.metadata import AttentionBatch
from overnight.errors import ModelLoadError
from overnight.models.llama import load_packed_weights, make_lm_head
from overnight.models.qwen3_next import PACKED_MODULES_MAPPING, HybridModel, Qwen3NextForCausalLM
from overnight.models.qwen_vl import VISION_TOWER, vl_checkpoint_names
from overnight.models.vision.config import text_config_of, vision_arch_from_hf
from overnight.models.vision.interface import VisionFeatures, VisionRows
from overnight.models.vision.qwen_vit import build_vision_tower, tower_features

log = logging.getLogger("overnight")

# transformers' Qwen3.5 text rotary default when rope_parameters has no mrope_section
DEFAULT_MROPE_SECTION = (11, 11, 10)


class Qwen3_5ForConditionalGeneration(nn.Module):
    """Qwen3.5 and Qwen3.5-MoE with their vision tower (arch.architecture picks the decoder's MLPs)."""

    packed_modules_mapping = PACKED_MODULES_MAPPING
    # Quantization leaves the tower in the compute dtype (models/qwen_vl.py says why), and ignore lists
    # may name modules in either checkpoint layout; FP8 also keeps the Gated DeltaNet's b / a
    # projections (qwen3_next.py says why).
    unquantized_linear = (*Qwen3NextForCausalLM.unquantized_linear, VISION_TOWER)
    fp8_unquantized_linear = Qwen3NextForCausalLM.fp8_unquantized_linear
    dequantized_at_load = (*Qwen3NextForCausalLM.dequantized_at_load, VISION_TOWER)
    linear_input_producers = Qwen3NextForCausalLM.linear_input_producers
    dense_input_readers = Qwen3NextForCausalLM.dense_input_readers
    checkpoint_names = staticmethod(vl_checkpoint_names)
    takes_images: bool  # models/vision/interface.py: False when built text-only (arch.text_only)
    uses_mrope = True

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        assert arch.vision is not None and arch.mrope_section, "an image model needs a tower and M-RoPE"
        self.arch = arch
        self.checkpoint_kv_scales: dict[int, tuple[float, float]] = {}
        self.model = HybridModel(arch)
        self.takes_images = not arch.text_only
        if self.takes_images:
            self.visual = build_vision_tower(arch.vision)
        self.lm_head = make_lm_head(arch, self.model.embed_tokens)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBatch,
        vision: VisionRows | None = None,
    ) -> torch.Tensor:
        return cast(torch.Tensor, self.model(input_ids, positions, attn, vision))

    def embed_images(
        self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]
    ) -> VisionFeatures:
        """The tower over one or more images (their patches concatenated): their token embeddings."""
        return tower_features(self.visual, pixel_values, grid_thw)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, self.lm_head(hidden))

    @staticmethod
    def rename_checkpoint(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Applied to the checkpoint stream before integer / FP8 conversion and tensor-parallel slicing
        (loader/model_loader.checkpoint_weights), which look tensors up by the model's names."""
        return _renamed(weights)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_packed_weights(self, _renamed(weights))  # renamed names pass unchanged


def _renamed(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    skipped = 0
    for name, tensor in weights:
        if name.startswith("mtp."):
            skipped += 1
            continue
        if name.startswith("model.language_model."):
            name = "model." + name.removeprefix("model.language_model.")
        elif name.startswith("model.visual."):
            name = name.removeprefix("model.")
        yield name, tensor
    if skipped:
        log.info("skipped %d tensors of the multi-token-prediction head", skipped)


def with_vision(cfg: dict[str, Any], arch: ModelArch) -> ModelArch:
    """A Qwen3.5 ConditionalGeneration config's hybrid ModelArch (models/qwen3_next.py hybrid_arch)
    with its M-RoPE sections and vision tower. Raises ModelLoadError naming the bad field."""
    text = text_config_of(cfg)
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    raw = rope.get("mrope_section") or DEFAULT_MROPE_SECTION
    try:
        section = tuple(int(s) for s in raw)
    except (TypeError, ValueError):
        section = ()
    if len(section) != 3 or min(section) < 0:
        raise ModelLoadError(f"rope_parameters.mrope_section must be three sizes >= 0, got {raw!r}")
    # Qwen3.5's tower is Qwen3-VL's without deepstack (transformers never reads the field for it).
    vision = replace(vision_arch_from_hf(cfg, "qwen3_vl"), deepstack_visual_indexes=())
    if vision.out_hidden_size != arch.hidden_size:
        raise ModelLoadError(
            f"vision_config.out_hidden_size ({vision.out_hidden_size}) must equal the text model's "
            f"hidden_size ({arch.hidden_size})"
        )
    return replace(arch, mrope_section=section, mrope_interleaved=True, vision=vision)
