"""Gemma 3's image prompts: the pixels of transformers' Gemma3ImageProcessorPil (resized to the tower's
image_size, no pan-and-scan), and the placeholder expansion of HF's Gemma3Processor in token space.

A prompt marks each image with one `<start_of_image>` (boi) token, as Gemma's chat template writes it.
HF's processor replaces that text with "\\n\\n<boi>" + mm_tokens_per_image x "<image_soft_token>" +
"<eoi>\\n\\n" before tokenizing, so the "\\n\\n" joins any newlines the text has on either side into one
token of the longer run (Gemma's vocabulary holds a token per run of newlines). Here the prompt is
already token ids: the "\\n\\n" token is inserted and merged with a neighbouring newline-run token the
same way (vLLM's Gemma 3 processor does the same repair).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from overnight.arch import VisionArch
from overnight.errors import InvalidRequestError, ModelLoadError
from overnight.multimodal.inputs import ImageInput, MultiModalInputs, Pixels

_MAX_NEWLINES = 31  # Gemma's vocabulary has newline runs up to this length


def gemma3_image_processor(vision: VisionArch, model_path: str | None) -> Any:
    """The checkpoint's Gemma3ImageProcessorPil (preprocessor_config.json), else one for image_size;
    refused when it resizes to another size than the tower's or turns pan-and-scan on."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    size = vision.image_size
    if model_path and os.path.isfile(os.path.join(model_path, "preprocessor_config.json")):
        hf = Gemma3ImageProcessorPil.from_pretrained(model_path)
    else:
        hf = Gemma3ImageProcessorPil(size={"height": size, "width": size})
    got = dict(hf.size or {})
    if (got.get("height"), got.get("width")) != (size, size):
        raise ModelLoadError(
            f"preprocessor_config.json resizes images to {got}, the tower takes {size}x{size}"
        )
    if hf.do_pan_and_scan:
        raise ModelLoadError("preprocessor_config.json turns on do_pan_and_scan: not supported yet")
    return hf


def newline_ids(tokenizer_path: str | None) -> dict[int, int]:
    """{run length: token id} of the tokenizer's newline-run tokens (empty when it has no tokenizer.json)."""
    file = os.path.join(tokenizer_path, "tokenizer.json") if tokenizer_path else None
    if not file or not os.path.isfile(file):
        return {}
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(file)
    runs = {k: tok.token_to_id("\n" * k) for k in range(1, _MAX_NEWLINES + 1)}
    return {k: i for k, i in runs.items() if i is not None}


class GemmaPrompt:
    def __init__(self, vision: VisionArch, tokenizer_path: str | None) -> None:
        assert vision.vision_start_token_id is not None and vision.vision_end_token_id is not None
        self.vision = vision
        self.boi = vision.vision_start_token_id
        self.eoi = vision.vision_end_token_id
        self.run_id = newline_ids(tokenizer_path)
        self.run_len = {i: k for k, i in self.run_id.items()}

    def grid(self, shape: torch.Size) -> tuple[int, int, int]:
        """(1, patches per side, patches per side) of pixel_values [1, C, S, S]; S must be the tower's."""
        s = self.vision.image_size
        if tuple(shape[1:]) != (self.vision.in_channels, s, s):
            raise InvalidRequestError(
                f"the image processor gave pixels {tuple(shape)}, the tower takes {s}x{s}"
            )
        side = s // self.vision.patch_size
        return 1, side, side

    def check_newlines(self) -> None:
        if 2 not in self.run_id:
            raise InvalidRequestError(
                'the tokenizer has no "\\n\\n" token (tokenizer.json): cannot expand Gemma 3 image placeholders'
            )

    def _seam(self, left: int, right: int) -> list[int]:
        """Tokens `left`, `right` at a seam where "\\n\\n" was inserted: two newline runs become the
        token of their total run when the vocabulary has it (as tokenizing the joined text would)."""
        if left in self.run_len and right in self.run_len:
            total = self.run_len[left] + self.run_len[right]
            if total in self.run_id:
                return [self.run_id[total]]
        return [left, right]

    def expand(
        self, token_ids: list[int], slots: list[int], processed: list[Pixels]
    ) -> tuple[list[int], MultiModalInputs]:
        v = self.vision
        n = v.mm_tokens_per_image
        nl2 = self.run_id[2]
        ids: list[int] = []
        images: list[ImageInput] = []
        prev = 0
        for slot, (pixels, grid, digest) in zip(slots, processed):
            text = token_ids[prev:slot]
            if ids and text:  # the "\n\n" after the previous image meets this text
                ids[-1:] = self._seam(ids[-1], text[0])
                text = text[1:]
            ids.extend(text)
            if ids:
                ids[-1:] = self._seam(ids[-1], nl2)
            else:
                ids.append(nl2)
            ids.append(self.boi)
            images.append(ImageInput(len(ids), n, digest, pixels, grid))
            ids.extend([v.image_token_id] * n)
            ids.extend([self.eoi, nl2])
            prev = slot + 1
        tail = token_ids[prev:]
        if tail:
            ids[-1:] = self._seam(ids[-1], tail[0])
            ids.extend(tail[1:])
        return ids, MultiModalInputs(tuple(images), np.zeros((3, 0), dtype=np.int64), 0, whole_images=True)
