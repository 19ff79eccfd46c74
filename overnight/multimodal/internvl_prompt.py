"""InternVL's image prompts: the tiles of transformers' GotOcr2ImageProcessorPil, and the placeholder
expansion of HF's InternVLProcessor in token space.

A prompt marks each image with one <IMG_CONTEXT> token, as InternVL's chat template writes it. The
image processor (called with crop_to_patches=True, as InternVLProcessor calls it) resizes the image to
the grid of size x size tiles whose aspect ratio is closest to the image's, between min_patches and
max_patches tiles, cuts it into those tiles and, when there is more than one, adds the whole image
resized to one tile (the thumbnail). For T tiles the <IMG_CONTEXT> becomes

    <img>  T x (side / m)^2 x <IMG_CONTEXT>  </img>        (side: patches per tile side, m = 1 / ratio)

(HF expands the text before tokenizing; as special tokens they never merge with their neighbours, so
expanding the ids gives the same ids). The ImageInput spans the <IMG_CONTEXT> tokens only; its grid is
(T, side, side). The <img> / </img> ids are the tokenizer's: config.json has only <IMG_CONTEXT>'s.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from overnight.arch import VisionArch
from overnight.errors import InvalidRequestError, ModelLoadError
from overnight.multimodal.inputs import MultiModalInputs, Pixels, expand_spans
from overnight.multimodal.pixtral_prompt import special_ids

START, END, CONTEXT = "<img>", "</img>", "<IMG_CONTEXT>"
# The published preprocessor_config.json (OpenGVLab/InternVL3-*-hf): ImageNet's mean and std, bicubic,
# 1 to 12 tiles of the tower's image_size.
IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]


def internvl_image_processor(vision: VisionArch, model_path: str | None) -> Any:
    """The checkpoint's GotOcr2ImageProcessorPil (preprocessor_config.json), else the published
    settings; refused when its tiles are not square or not whole merged patches."""
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    if model_path and os.path.isfile(os.path.join(model_path, "preprocessor_config.json")):
        hf = GotOcr2ImageProcessorPil.from_pretrained(model_path)
    else:
        hf = GotOcr2ImageProcessorPil(
            size={"height": vision.image_size, "width": vision.image_size},
            image_mean=IMAGENET_MEAN,
            image_std=IMAGENET_STD,
            min_patches=1,
            max_patches=12,
        )
    size = dict(hf.size or {})
    unit = vision.patch_size * vision.spatial_merge_size
    side = size.get("height")
    if not side or side != size.get("width") or side % unit:
        raise ModelLoadError(
            f"preprocessor_config.json must make square tiles of whole {unit}-pixel merged patches, "
            f"got size {size}"
        )
    if not 1 <= hf.min_patches <= hf.max_patches:
        raise ModelLoadError(
            f"preprocessor_config.json needs 1 <= min_patches <= max_patches, got {hf.min_patches}, "
            f"{hf.max_patches}"
        )
    return hf


def max_tiles(model_path: str | None, vision: VisionArch) -> tuple[int, int]:
    """(the most tiles one image makes, the tile side in pixels), for the start-up encoder run."""
    hf = internvl_image_processor(vision, model_path)
    tiles = hf.max_patches + 1 if hf.max_patches > 1 else 1  # the thumbnail after several tiles
    return tiles, int(hf.size["height"])


class InternVLPrompt:
    def __init__(self, vision: VisionArch, tokenizer_path: str | None) -> None:
        self.vision = vision
        self.ids = special_ids(tokenizer_path, (START, END))

    # What InternVLProcessor passes its image processor: an image becomes tiles plus a thumbnail.
    hf_kwargs: dict[str, Any] = {"crop_to_patches": True}

    def check_tokens(self) -> None:
        missing = [t for t in (START, END) if t not in self.ids]
        if missing:
            raise InvalidRequestError(
                f"the tokenizer (tokenizer.json) has no {' / '.join(missing)} token: cannot expand InternVL "
                "image placeholders"
            )

    def tile_rows(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """pixel_values [T, C, S, S] -> one row per tile [T, C * S * S], grid (T, S / p, S / p)."""
        tiles, c, h, w = pixel_values.shape
        unit = self.vision.patch_size * self.vision.spatial_merge_size
        if h != w or h % unit or c != self.vision.in_channels:
            raise InvalidRequestError(
                f"the image processor gave tiles {tuple(pixel_values.shape[1:])}, not square tiles of whole "
                f"{unit}-pixel merged patches (preprocessor_config.json)"
            )
        side = h // self.vision.patch_size
        return pixel_values.float().reshape(tiles, -1).contiguous(), (tiles, side, side)

    def expand(
        self, token_ids: list[int], slots: list[int], processed: list[Pixels]
    ) -> tuple[list[int], MultiModalInputs]:
        v = self.vision

        def span(grid: tuple[int, int, int]) -> list[int]:
            return [v.image_token_id] * v.num_tokens(grid)

        return expand_spans(token_ids, slots, processed, v, span, (self.ids[START], self.ids[END]))
