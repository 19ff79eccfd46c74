"""Idefics3 / SmolVLM's image prompts: the frames of transformers' Idefics3ImageProcessorPil, and the
placeholder expansion of HF's Idefics3Processor / SmolVLMProcessor.

A prompt marks each image with one <image> token, as the chat template writes it. The image processor
resizes the image to at most `size` on its longest edge, then (do_image_splitting) up to whole multiples
of max_image_size and cuts it into a rows x cols grid of max_image_size tiles, adding the whole image
resized to one tile (the global image); an image of one tile or less is that global image alone
(rows = cols = 0). Every frame is max_image_size square, which must be the tower's image_size. The
<image> becomes transformers' own prompt string for the grid (its get_image_prompt_string):

    per tile:  <fake_token_around_image> <row_r_col_c> image_seq_len x <image>   ("\\n" after each row)
    then:      "\\n" <fake_token_around_image> <global-img> image_seq_len x <image> <fake_token_around_image>

tokenized by the checkpoint's tokenizer (so its newlines are the ids HF's processor gives: the string
starts and ends with a special token, so it never merges with the prompt's text around it). Each run of
<image> tokens is one frame's ImageInput, grid (1, side, side), in the processor's frame order (tiles
row by row, then the global image).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch

from overnight.arch import VisionArch
from overnight.errors import InvalidRequestError, ModelLoadError
from overnight.multimodal.inputs import ImageInput, MultiModalInputs, Pixels

FAKE, GLOBAL, IMAGE = "<fake_token_around_image>", "<global-img>", "<image>"


def idefics3_image_processor(vision: VisionArch, model_path: str | None) -> Any:
    """The checkpoint's Idefics3ImageProcessorPil (preprocessor_config.json; SmolVLM's is the same
    processor), else the published settings (frames of the tower's image_size, images up to 4 frames a
    side, mean and std 0.5, Lanczos); refused when its frames are not the tower's image_size, or when
    processor_config.json's image_seq_len is not the model's tokens per frame."""
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    size = vision.image_size
    if model_path and os.path.isfile(os.path.join(model_path, "preprocessor_config.json")):
        hf = Idefics3ImageProcessorPil.from_pretrained(model_path)
    else:
        hf = Idefics3ImageProcessorPil(size={"longest_edge": 4 * size}, max_image_size={"longest_edge": size})
    frame = dict(hf.max_image_size or {}).get("longest_edge")
    if frame != size:
        raise ModelLoadError(
            f"preprocessor_config.json makes frames of max_image_size {hf.max_image_size}, the tower takes "
            f"{size}x{size}"
        )
    path = os.path.join(model_path, "processor_config.json") if model_path else None
    if path and os.path.isfile(path):
        with open(path) as f:
            seq_len = json.load(f).get("image_seq_len")
        if seq_len is not None and seq_len != vision.mm_tokens_per_image:
            raise ModelLoadError(
                f"processor_config.json's image_seq_len ({seq_len}) is not the model's tokens per frame "
                f"({vision.mm_tokens_per_image} = (image_size / patch_size / scale_factor)^2)"
            )
    return hf


class Idefics3Prompt:
    def __init__(self, vision: VisionArch, tokenizer_path: str | None) -> None:
        self.vision = vision
        self.tokenizer: Any = None
        file = os.path.join(tokenizer_path, "tokenizer.json") if tokenizer_path else None
        if file and os.path.isfile(file):
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_file(file)
        self._spans: dict[tuple[int, int], list[int]] = {}

    # What Idefics3Processor passes its image processor: the tile grid of each image comes back.
    hf_kwargs: dict[str, Any] = {"return_row_col_info": True}

    def check_tokens(self) -> None:
        tok = self.tokenizer
        missing = [t for t in (FAKE, GLOBAL) if tok is None or tok.token_to_id(t) is None]
        if missing:
            raise InvalidRequestError(
                f"the tokenizer (tokenizer.json) has no {' / '.join(missing)} token: cannot expand "
                "Idefics3 / SmolVLM image placeholders"
            )

    def frame_rows(self, out: Any) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """The processor's output for one image -> one pixel row per frame [F, C * S * S] and
        (F, tile rows, tile cols): the grid the expansion needs (each frame's own is (1, side, side))."""
        pixels = out["pixel_values"][0]  # [F, C, S, S]
        rows, cols = int(out["rows"][0][0]), int(out["cols"][0][0])
        frames, c, h, w = pixels.shape
        s = self.vision.image_size
        if (c, h, w) != (self.vision.in_channels, s, s) or frames != (rows * cols + 1 if rows else 1):
            raise InvalidRequestError(
                f"the image processor gave {frames} frames of {(c, h, w)} for a {rows} x {cols} grid, not "
                f"{s}x{s} frames (preprocessor_config.json)"
            )
        return pixels.float().reshape(frames, -1).contiguous(), (frames, rows, cols)

    def span(self, rows: int, cols: int) -> list[int]:
        """The token ids an image of a rows x cols grid becomes (transformers' prompt string, tokenized)."""
        key = (rows, cols)
        if key not in self._spans:
            from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

            text = get_image_prompt_string(rows, cols, self.vision.mm_tokens_per_image, FAKE, IMAGE, GLOBAL)
            self._spans[key] = list(self.tokenizer.encode(text, add_special_tokens=False).ids)
        return self._spans[key]

    def expand(
        self, token_ids: list[int], slots: list[int], processed: list[Pixels]
    ) -> tuple[list[int], MultiModalInputs]:
        v = self.vision
        per_frame = v.mm_tokens_per_image
        side = v.image_size // v.patch_size
        ids: list[int] = []
        images: list[ImageInput] = []
        prev = 0
        for slot, (pixels, (frames, rows, cols), digest) in zip(slots, processed):
            ids.extend(token_ids[prev:slot])
            span = self.span(rows, cols)
            starts = [
                i
                for i, t in enumerate(span)
                if t == v.image_token_id and (i == 0 or span[i - 1] != v.image_token_id)
            ]
            if len(starts) != frames or span.count(v.image_token_id) != frames * per_frame:
                raise InvalidRequestError(
                    f"the tokenizer splits the image prompt into {len(starts)} runs of <image> tokens for "
                    f"{frames} frames of {per_frame} tokens (tokenizer.json)"
                )
            for k, start in enumerate(starts):
                hash_k = f"{digest}:{k}"  # a frame's own encoder-cache / prefix-cache key
                images.append(
                    ImageInput(len(ids) + start, per_frame, hash_k, pixels[k : k + 1], (1, side, side))
                )
            ids.extend(span)
            prev = slot + 1
        ids.extend(token_ids[prev:])
        return ids, MultiModalInputs(tuple(images), np.zeros((3, 0), dtype=np.int64), 0)
