"""A prompt's images as the engine carries them: where each image's tokens sit in the prompt, its
preprocessed pixels, a hash of those pixels, and the prompt's M-RoPE positions.

The hash is what the prefix cache and the encoder cache key on: two prompts whose placeholder tokens are
equal but whose images differ never share KV blocks (each block's hash includes the hashes of the images
whose tokens it holds, kv_cache_manager.py), and a repeated image is encoded once while its embeddings
stay cached (runner/vision.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from overnight.arch import VisionArch

# Engines that do not carry images yet (the encoder-only engine).
IMAGES_UNSUPPORTED_HERE = "images are not supported on encoder models yet"

Pixels = tuple[torch.Tensor, tuple[int, int, int], str]  # pixel_values, grid (t, h, w), content hash


@dataclass(frozen=True, slots=True, eq=False)
class ImageInput:
    offset: int  # index of the image's first token in the prompt
    num_tokens: int  # its tokens (merged patches): prompt[offset : offset + num_tokens]
    content_hash: str  # sha256 of the decoded image (mode, size, pixels): processor.py
    pixel_values: torch.Tensor  # [patches, C * temporal_patch * patch * patch] float32, on the host
    grid_thw: tuple[int, int, int]  # patch grid (frames, rows, columns)

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


@dataclass(frozen=True, slots=True, eq=False)
class MultiModalInputs:
    images: tuple[ImageInput, ...]
    # [3, prompt length] (temporal, height, width) positions; tokens after the prompt have position
    # p + mrope_delta on every axis (the images' grids take fewer positions than tokens).
    mrope_positions: np.ndarray  # [3, 0] for a model with 1-D positions (Gemma 3)
    mrope_delta: int
    # Each image's tokens attend to each other both ways (Gemma 3): an image is computed within one
    # prefill chunk, so a chunk or a prefix-cache hit never ends strictly inside one (scheduler.py,
    # kv_cache_manager.py), and the attention gets per-row key limits (runner/vision.py).
    whole_images: bool = False

    def split_point(self, end: int) -> int:
        """`end` moved back to the start of the whole image it would cut (unchanged if none)."""
        if self.whole_images and self.images and end < self.images[-1].end:  # (decodes: past every image)
            for im in self.images:
                if im.offset < end < im.end:
                    return im.offset
        return end

    def hashes_in(self, start: int, end: int) -> tuple[str, ...]:
        """Hashes of the images with tokens in prompt[start:end] (a KV block's extra hash key)."""
        return tuple(im.content_hash for im in self.images if im.offset < end and im.end > start)


def expand_spans(
    token_ids: list[int],
    slots: list[int],
    processed: list[Pixels],
    vision: VisionArch,
    span: Callable[[tuple[int, int, int]], list[int]],
    markers: tuple[int, int] | None = None,
) -> tuple[list[int], MultiModalInputs]:
    """Each placeholder at `slots` becomes its image's span(grid) (VisionArch.num_tokens of it: a row of
    the tower's output each), between the `markers` (start, end) tokens where the model has them (text
    rows, outside the ImageInput); 1-D positions. The prompt form of InternVL, Mistral 3 and Llama 4."""
    ids: list[int] = []
    images: list[ImageInput] = []
    prev = 0
    for slot, (pixels, grid, digest) in zip(slots, processed):
        ids.extend(token_ids[prev:slot])
        if markers is not None:
            ids.append(markers[0])
        tokens = span(grid)
        assert len(tokens) == vision.num_tokens(grid)
        images.append(ImageInput(len(ids), len(tokens), digest, pixels, grid))
        ids.extend(tokens)
        if markers is not None:
            ids.append(markers[1])
        prev = slot + 1
    ids.extend(token_ids[prev:])
    return ids, MultiModalInputs(tuple(images), np.zeros((3, 0), dtype=np.int64), 0)
