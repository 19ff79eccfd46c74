"""InternVL 3 / 3.5 with images (InternVLForConditionalGeneration, the OpenGVLab/InternVL3-*-hf and
InternVL3_5-*-HF checkpoints): the InternViT tower, pixel shuffle and projector of
models/vision/internvit.py, whose embeddings replace the <IMG_CONTEXT> tokens' input embeddings, and a
Qwen2 / Qwen3 / Llama decoder of models/llama.py with its 1-D RoPE (or Qwen3-MoE's sparse MLPs on it).

An image's tokens in the prompt (multimodal/internvl_prompt.py) are <img>, 256 <IMG_CONTEXT> per tile
(at the published sizes: 448-pixel tiles, 14-pixel patches, 2 x 2 pixel shuffle) and </img>; the
ImageInput spans the <IMG_CONTEXT> tokens only, so embed_images returns a row per context token and
the runner places them as any image's (a prefill chunk may end inside an image). Attention over image
tokens is causal, as for text. Decode steps and text-only prompts run exactly as the text model.

Quantization: only the language model; the tower and projector stay in the compute dtype (as published
quantized InternVL checkpoints leave them), and one that quantized them anyway is dequantized at load.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from overnight.arch import ModelArch
from overnight.attention.metadata import AttentionBatch
from overnight.models.checkpoint import EXPERT_TENSORS, load_packed_weights
from overnight.models.llama import LINEAR_INPUT_PRODUCERS, PACKED_MODULES_MAPPING, LlamaModel, make_lm_head
from overnight.models.qwen3_moe import qwen3_moe_mlp
from overnight.models.vision.checkpoint import rename_tower_checkpoint, tower_checkpoint_names
from overnight.models.vision.interface import VisionFeatures, VisionRows, merge_image_rows
from overnight.models.vision.internvit import (
    InternVLMultiModalProjector,
    InternVLVisionModel,
    check_tiles,
    pixel_shuffle,
)

_TOWER = ("vision_tower.", "multi_modal_projector.")
_TOWER_MODULES = (r"re:vision_tower\.", r"re:multi_modal_projector\.")


class InternVLForConditionalGeneration(nn.Module):
    packed_modules_mapping = PACKED_MODULES_MAPPING
    linear_input_producers = LINEAR_INPUT_PRODUCERS
    unquantized_linear: tuple[str, ...] = _TOWER_MODULES
    dequantized_at_load: tuple[str, ...] = _TOWER_MODULES
    takes_images: bool  # models/vision/interface.py: False when built text-only (arch.text_only)
    uses_mrope = False

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        assert arch.vision is not None and arch.vision.kind == "internvl"
        self.arch = arch
        self.checkpoint_kv_scales: dict[int, tuple[float, float]] = {}
        self.model = LlamaModel(arch, make_mlp=qwen3_moe_mlp) if arch.num_experts else LlamaModel(arch)
        self.takes_images = not arch.text_only
        if self.takes_images:
            self.vision_tower = InternVLVisionModel(arch.vision)
            self.multi_modal_projector = InternVLMultiModalProjector(arch.vision)
        self.lm_head = make_lm_head(arch, self.model.embed_tokens)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBatch,
        vision: VisionRows | None = None,
    ) -> torch.Tensor:
        x = merge_image_rows(self.model.embed_tokens(input_ids), vision)
        return self.model.decode(x, positions, attn)

    def embed_images(
        self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]
    ) -> VisionFeatures:
        """The tower over one or more images' tiles (one pixel row per tile, images concatenated): per
        image, its tiles' tokens in order, (side / m)^2 rows a tile."""
        v = self.arch.vision
        assert v is not None
        check_tiles(v, pixel_values, grid_thw)
        side = grid_thw[0][1] * v.patch_size
        dtype = self.multi_modal_projector.linear_1.weight.dtype
        tiles = pixel_values.to(dtype).view(-1, v.in_channels, side, side)
        features = pixel_shuffle(self.vision_tower(tiles), v.spatial_merge_size)
        return VisionFeatures(embeds=self.multi_modal_projector(features).flatten(0, 1), deepstack=[])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def rename_checkpoint(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's names made the model's (models/vision/checkpoint.py lists the layouts)."""
        return rename_tower_checkpoint(weights, _TOWER)

    @staticmethod
    def checkpoint_names(module: str) -> tuple[str, ...]:
        """The names a module of this model may carry in a checkpoint (and its ignore list)."""
        return tower_checkpoint_names(module, _TOWER)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_packed_weights(self, self.rename_checkpoint(weights))


class InternVLMoeForConditionalGeneration(InternVLForConditionalGeneration):
    """InternVL 3.5's MoE checkpoints (a Qwen3-MoE decoder, e.g. InternVL3_5-30B-A3B-HF): the router and
    experts are quantized as Qwen3-MoE's (models/qwen3_moe.py says how)."""

    unquantized_linear = (*_TOWER_MODULES, "mlp.gate")
    dequantized_at_load = (*_TOWER_MODULES, EXPERT_TENSORS, "mlp.gate")
