"""Mistral 3's image prompts: the pixels of transformers' PixtralImageProcessorPil, and the placeholder
expansion of HF's PixtralProcessor (the processor of Mistral3ForConditionalGeneration) in token space.

A prompt marks each image with one [IMG] token, as Mistral's chat template writes it. The image is
resized (aspect kept, the longest edge at most size["longest_edge"]) to whole multiples of
patch x spatial_merge_size pixels: the processor passes that product as the image processor's
patch_size, and so does this file. For a grid of R x C merged patches the [IMG] becomes

    R rows of ( C x [IMG], [IMG_BREAK] ), the last row's [IMG_BREAK] replaced by [IMG_END]

(HF expands the text "[IMG]" to those special tokens before tokenizing; as special tokens they never
merge with their neighbours, so expanding the ids gives the same ids). The ImageInput spans all
R x (C + 1) tokens: the model's embed_images returns a row per token of the span
(models/mistral3_vl.py). The [IMG_BREAK] / [IMG_END] ids are the tokenizer's: config.json has only
[IMG]'s (image_token_index).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from overnight.arch import VisionArch
from overnight.errors import InvalidRequestError, ModelLoadError
from overnight.multimodal.inputs import MultiModalInputs, Pixels, expand_spans
from overnight.multimodal.qwen_pixels import CLIP_MEAN, CLIP_STD

BREAK, END = "[IMG_BREAK]", "[IMG_END]"


def pixtral_image_processor(vision: VisionArch, model_path: str | None) -> Any:
    """The checkpoint's PixtralImageProcessorPil (preprocessor_config.json), else the published
    checkpoints' settings (CLIP's mean and std, bicubic, the longest edge at most the tower's
    image_size)."""
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    if model_path and os.path.isfile(os.path.join(model_path, "preprocessor_config.json")):
        hf = PixtralImageProcessorPil.from_pretrained(model_path)
    else:
        hf = PixtralImageProcessorPil(
            size={"longest_edge": vision.image_size}, image_mean=CLIP_MEAN, image_std=CLIP_STD
        )
    if not (hf.size or {}).get("longest_edge"):
        raise ModelLoadError(
            f"preprocessor_config.json must bound images by size.longest_edge, got {hf.size}"
        )
    return hf


def longest_edge(model_path: str | None, vision: VisionArch) -> int:
    """The largest image side the processor makes (for the start-up encoder run)."""
    return int(pixtral_image_processor(vision, model_path).size["longest_edge"])


def special_ids(tokenizer_path: str | None, tokens: tuple[str, ...] = (BREAK, END)) -> dict[str, int]:
    """{token: id} of `tokens` in the tokenizer (those it has): its tokenizer.json, else whatever
    transformers' AutoTokenizer reads there (as the HF processors look them up)."""
    if not tokenizer_path:
        return {}
    file = os.path.join(tokenizer_path, "tokenizer.json")
    if os.path.isfile(file):
        from tokenizers import Tokenizer

        found = {t: Tokenizer.from_file(file).token_to_id(t) for t in tokens}
        return {t: i for t, i in found.items() if i is not None}
    try:
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
    except Exception:  # no tokenizer here: the prompt code refuses image prompts, naming the tokens
        return {}
    ids = {t: hf.convert_tokens_to_ids(t) for t in tokens}
    return {t: i for t, i in ids.items() if isinstance(i, int) and i != hf.unk_token_id}


class PixtralPrompt:
    def __init__(self, vision: VisionArch, tokenizer_path: str | None) -> None:
        self.vision = vision
        self.unit = vision.patch_size * vision.spatial_merge_size  # pixels per merged patch side
        self.ids = special_ids(tokenizer_path)

    @property
    def hf_kwargs(self) -> dict[str, Any]:
        """What PixtralProcessor passes its image processor: sizes in whole merged patches."""
        return {"patch_size": {"height": self.unit, "width": self.unit}}

    def check_tokens(self) -> None:
        missing = [t for t in (BREAK, END) if t not in self.ids]
        if missing:
            raise InvalidRequestError(
                f"the tokenizer (tokenizer.json) has no {' / '.join(missing)} token: cannot expand "
                "Mistral 3 image placeholders"
            )

    def patch_rows(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """pixel_values [1, C, H, W] -> patch rows [H / p * W / p, C * p * p] (row by row), grid."""
        _, c, h, w = pixel_values.shape
        if h % self.unit or w % self.unit:
            raise InvalidRequestError(
                f"the image processor gave {h}x{w} pixels, not whole {self.unit}-pixel merged patches "
                "(preprocessor_config.json)"
            )
        p = self.vision.patch_size
        gh, gw = h // p, w // p
        patches = pixel_values[0].float().view(c, gh, p, gw, p).permute(1, 3, 0, 2, 4)
        return patches.reshape(gh * gw, c * p * p).contiguous(), (1, gh, gw)

    def expand(
        self, token_ids: list[int], slots: list[int], processed: list[Pixels]
    ) -> tuple[list[int], MultiModalInputs]:
        m = self.vision.spatial_merge_size
        img, brk, end = self.vision.image_token_id, self.ids[BREAK], self.ids[END]

        def span(grid: tuple[int, int, int]) -> list[int]:
            _, h, w = grid
            tokens = ([img] * (w // m) + [brk]) * (h // m)
            tokens[-1] = end
            return tokens

        return expand_spans(token_ids, slots, processed, self.vision, span)
