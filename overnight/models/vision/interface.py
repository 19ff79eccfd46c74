"""What the runner uses of a model that takes images (beside models/interface.py's CausalLM).

A vision-language model has a tower that turns preprocessed pixels into one embedding per image token,
and a forward that takes the step's image rows. Qwen2.5-VL and Qwen3-VL implement it
(models/qwen_vl.py), as does Qwen3.5 (models/qwen3_5_vl.py); Gemma 3's SigLIP (models/gemma_vl.py),
Mistral 3's Pixtral (models/mistral3_vl.py), InternVL's InternViT (models/internvl.py) and Llama 4's ViT
(models/llama4_vl.py) plug in by
implementing the same:

    embed_images(pixel_values, grid_thw) -> VisionFeatures   (one row per image token, images concatenated)
    forward(input_ids, positions, attn, vision=VisionRows | None)

uses_mrope says whether positions are M-RoPE's (3 per prompt token, runner/vision.py builds them);
a model without it gets the usual 1-D positions.

Text-only (ModelArch.text_only, limit_mm_per_prompt image 0): the same class is built without its tower
and projector and says takes_images = False, so the runner treats it as a text model (no image rows, no
encoder profiling, 1-D positions: M-RoPE with three equal axes is plain RoPE) and embed_images is never
called; the checkpoint's tower tensors (TOWER_CHECKPOINT_PREFIXES) are not read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from overnight.arch import ModelArch
from overnight.attention.metadata import AttentionBatch

# Where every supported image model's checkpoint keeps its tower and projector, in each layout the
# models' rename_checkpoint reads (Qwen's visual.*, Llama 4's vision_model.*, the others' vision_tower.*;
# multi_modal_projector.* or Idefics3's connector.*; transformers 5 adding model.).
TOWER_CHECKPOINT_PREFIXES = (
    "visual.",
    "model.visual.",
    "vision_tower.",
    "model.vision_tower.",
    "vision_model.",
    "model.vision_model.",
    "multi_modal_projector.",
    "model.multi_modal_projector.",
    "connector.",
    "model.connector.",
)


@dataclass
class VisionFeatures:
    embeds: torch.Tensor  # [tokens, text hidden]: one row per image token, images concatenated
    deepstack: list[torch.Tensor]  # Qwen3-VL: per early decoder layer, rows added to the image tokens


@dataclass
class VisionRows:
    """The image tokens of one step: rows [R] of the flattened batch, their input embeddings [R, hidden]
    and, for Qwen3-VL, one [R, hidden] tensor per deepstack layer."""

    rows: torch.Tensor
    embeds: torch.Tensor
    deepstack: list[torch.Tensor]


def merge_image_rows(x: torch.Tensor, vision: VisionRows | None) -> torch.Tensor:
    """The step's input embeddings [T, hidden] with its image tokens' rows replaced by the tower's
    embeddings (a new tensor; x itself when the step has no images). Every image model's decoder
    merges this way, before its first layer."""
    if vision is None:
        return x
    return x.index_copy(0, vision.rows, vision.embeds.to(x.dtype))


def merge_image_token_rows(
    x: torch.Tensor, input_ids: torch.Tensor, vision: VisionRows | None, image_token_id: int
) -> torch.Tensor:
    """merge_image_rows for models whose image span also holds marker tokens (Pixtral's [IMG_BREAK] /
    [IMG_END], Llama 4's tile separators and <|image|>): of the spans' rows, those whose token is
    image_token_id take the tower's embedding, the others keep their own token embedding (as
    transformers scatters at image_token_id); the tower gives a row per span token, markers included."""
    if vision is None:
        return x
    own = x.index_select(0, vision.rows)
    is_image = (input_ids.index_select(0, vision.rows) == image_token_id)[:, None]
    return x.index_copy(0, vision.rows, torch.where(is_image, vision.embeds.to(x.dtype), own))


class ImageModel(Protocol):
    arch: ModelArch
    takes_images: bool
    uses_mrope: bool

    def embed_images(
        self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]
    ) -> VisionFeatures: ...

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBatch,
        vision: VisionRows | None = None,
    ) -> torch.Tensor: ...
