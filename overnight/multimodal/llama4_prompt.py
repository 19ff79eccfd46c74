"""Llama 4's image prompts: the tiles of transformers' Llama4ImageProcessor, computed here with torch
alone, and the placeholder expansion of HF's Llama4Processor in token space.

Pixels. transformers' processor for Llama 4 exists only on its torchvision backend (not a dependency
here); Llama4Tiles computes the same tensors with the same torch operations (test_llama4_vision.py
compares the two where torchvision is installed):

  1. the canvas: among the (rows x cols) grids of at most max_patches tiles of size x size pixels, the
     one needing the least upscaling of the image (no distortion: the smaller of the two scales), else
     the least downscaling; ties to the smallest area, then to the first in transformers' order (tile
     counts from max_patches down, grouped by aspect ratio as first met);
  2. the image resized, keeping its aspect ratio, to fit that canvas (upscaled at most to `size` on a
     side unless resize_to_max_canvas), bilinear with antialiasing on uint8 (as torchvision does on
     CPUs with AVX2), then zero-padded right and bottom to the canvas;
  3. rescaled and normalized in bfloat16 (x * rescale_factor, then (x - mean) / std: the original
     implementation's rounding), cut into the canvas's tiles row by row; past one tile, the whole image
     resized (distorted) to one tile follows.

Tokens. A prompt marks each image with one <|image|> token, as Llama 4's chat template writes it. For a
canvas of R x C tiles, P = (size / patch / m)^2 tokens a tile (m = 1 / pixel_shuffle_ratio), it becomes

    <|image_start|>  [ R rows of: C times (P x <|patch|>, then <|tile_x_separator|> between tiles,
                     <|tile_y_separator|> after the row's last) ]   <|image|>  P x <|patch|>  <|image_end|>

(the bracketed part only when R x C > 1). The ImageInput spans everything between <|image_start|> and
<|image_end|>; its grid is (tiles, R x patches per tile side, C x patches per tile side), tiles counting
the whole-image one (VisionArch.num_tokens gives the span's length). <|patch|> is the config's
image_token_index, start / end its boi / eoi; the separators and <|image|> are the tokenizer's.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from overnight.arch import VisionArch
from overnight.errors import InvalidRequestError, ModelLoadError
from overnight.multimodal.inputs import MultiModalInputs, Pixels, expand_spans
from overnight.multimodal.pixtral_prompt import special_ids

IMAGE, X_SEP, Y_SEP = "<|image|>", "<|tile_x_separator|>", "<|tile_y_separator|>"
_BILINEAR = 2  # PIL's Resampling.BILINEAR, as preprocessor_config.json writes `resample`


@dataclass(frozen=True)
class Llama4Tiles:
    """The settings of a Llama4ImageProcessor(Fast) preprocessor_config.json (the published ones are
    the defaults, but for size, which is the tower's image_size) and the pixels they make."""

    size: int
    max_patches: int = 16
    resize_to_max_canvas: bool = False
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255

    def __call__(self, images: list[Any], **_: Any) -> dict[str, Any]:
        """{"pixel_values": [tiles, C, size, size] float32, "aspect_ratios": [(R, C)]} of one image (a
        PIL RGB image), as the HF processor's (its bfloat16 values, widened)."""
        (image,) = images
        raw = torch.from_numpy(np.array(image, dtype=np.uint8)).permute(2, 0, 1)[None]  # [1, C, H, W]
        height, width = raw.shape[-2:]
        canvas = self.canvas(height, width)
        fit_h, fit_w = (
            (canvas[0], canvas[1])
            if self.resize_to_max_canvas
            else (
                min(max(height, self.size), canvas[0]),
                min(max(width, self.size), canvas[1]),
            )
        )
        new_h, new_w = _fit_without_distortion(height, width, fit_h, fit_w)
        resized = _resize(raw, max(new_h, 1), max(new_w, 1))
        ch, cw = int(canvas[0]), int(canvas[1])
        padded = F.pad(resized, (0, cw - resized.shape[-1], 0, ch - resized.shape[-2]))
        rows, cols = ch // self.size, cw // self.size
        tiles = self._normalize(padded).view(raw.shape[1], rows, self.size, cols, self.size)
        tiles = tiles.permute(1, 3, 0, 2, 4).reshape(rows * cols, raw.shape[1], self.size, self.size)
        if rows * cols > 1:
            whole = self._normalize(_resize(raw, self.size, self.size))
            tiles = torch.cat([tiles, whole[None]])
        return {"pixel_values": tiles.float(), "aspect_ratios": [(rows, cols)]}

    def canvas(self, height: int, width: int) -> torch.Tensor:
        """[2] (height, width) in pixels of the canvas chosen for an image (step 1 of the docstring)."""
        sizes = _canvases(self.max_patches) * self.size
        scale_h, scale_w = sizes[:, 0] / height, sizes[:, 1] / width  # float32, as transformers compares
        scales = torch.where(scale_h > scale_w, scale_w, scale_h)
        up = scales[scales >= 1]
        if len(up):
            chosen = up.max() if self.resize_to_max_canvas else up.min()
        else:
            chosen = scales[scales < 1].max()
        fits = sizes[scales == chosen]
        return fits[torch.argmin(fits[:, 0] * fits[:, 1])] if len(fits) > 1 else fits[0]

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.bfloat16) * self.rescale_factor
        mean = torch.tensor(self.image_mean, dtype=x.dtype).view(-1, 1, 1)
        std = torch.tensor(self.image_std, dtype=x.dtype).view(-1, 1, 1)
        return ((x - mean) / std)[0]


def _canvases(max_tiles: int) -> torch.Tensor:
    """[K, 2] (rows, cols) of every tile grid of at most max_tiles tiles, in transformers' order."""
    by_ratio: dict[float, list[tuple[int, int]]] = {}
    for n in range(max_tiles, 0, -1):
        for rows in (d for d in range(1, n + 1) if n % d == 0):
            by_ratio.setdefault(rows / (n // rows), []).append((rows, n // rows))
    return torch.tensor([grid for grids in by_ratio.values() for grid in grids])


def _fit_without_distortion(height: int, width: int, fit_h: Any, fit_w: Any) -> tuple[int, int]:
    """The largest (h, w) of the image's aspect ratio inside (fit_h, fit_w). The bounds may be 0-d
    tensors (then the scales are float32, as in transformers), so the arithmetic is kept as it is."""
    scale_h, scale_w = fit_h / height, fit_w / width
    if scale_w < scale_h:
        return int(min(math.floor(height * scale_w), fit_h)), int(fit_w)
    return int(fit_h), int(min(math.floor(width * scale_h), fit_w))


def _resize(x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 [1, C, H, W] resized bilinearly with antialiasing: torch's native uint8 kernel where
    torchvision uses it (x86 with AVX2 / AVX-512, ARM), else in float32, rounded."""
    if tuple(x.shape[-2:]) == (height, width):
        return x
    native = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") or os.uname().machine in (
        "aarch64",
        "arm64",
    )
    if native:
        return F.interpolate(x, size=[height, width], mode="bilinear", align_corners=False, antialias=True)
    out = F.interpolate(x.float(), size=[height, width], mode="bilinear", align_corners=False, antialias=True)
    return out.round_().to(torch.uint8)


def llama4_image_processor(vision: VisionArch, model_path: str | None) -> Llama4Tiles:
    """The checkpoint's preprocessor_config.json, else the published settings at the tower's
    image_size; refused when its tiles are not the tower's image_size or it asks for what the
    published processor never does."""
    cfg: dict[str, Any] = {}
    path = os.path.join(model_path, "preprocessor_config.json") if model_path else None
    if path and os.path.isfile(path):
        with open(path) as f:
            cfg = json.load(f)
    size = cfg.get("size") or {"height": vision.image_size, "width": vision.image_size}
    if size.get("height") != size.get("width") or size.get("height") != vision.image_size:
        raise ModelLoadError(
            f"preprocessor_config.json must make square tiles of the tower's image_size {vision.image_size} "
            f"(its position embeddings and RoPE are of that size), got size {size}"
        )
    for flag in ("do_resize", "do_rescale", "do_normalize"):
        if cfg.get(flag, True) is not True:
            raise ModelLoadError(f"unsupported preprocessor_config.json {flag}={cfg[flag]!r} for Llama 4")
    if cfg.get("resample", _BILINEAR) != _BILINEAR:
        raise ModelLoadError(f"unsupported Llama 4 resample {cfg['resample']!r} (only 2: bilinear)")
    tiles = Llama4Tiles(
        size=int(size["height"]),
        max_patches=int(cfg.get("max_patches", 16)),
        resize_to_max_canvas=bool(cfg.get("resize_to_max_canvas", False)),
        image_mean=tuple(float(x) for x in cfg.get("image_mean", (0.5, 0.5, 0.5))),
        image_std=tuple(float(x) for x in cfg.get("image_std", (0.5, 0.5, 0.5))),
        rescale_factor=float(cfg.get("rescale_factor", 1 / 255)),
    )
    if tiles.max_patches < 1 or len(tiles.image_mean) != vision.in_channels != len(tiles.image_std):
        raise ModelLoadError(
            f"preprocessor_config.json needs max_patches >= 1 and a mean / std per channel, got "
            f"{tiles.max_patches}, {tiles.image_mean}, {tiles.image_std}"
        )
    return tiles


def largest_grid(model_path: str | None, vision: VisionArch) -> tuple[int, int, int]:
    """The grid of an image with the most tiles and tokens (a canvas of one row of max_patches
    tiles, and the whole-image tile), for the start-up encoder run."""
    n = llama4_image_processor(vision, model_path).max_patches
    side = vision.image_size // vision.patch_size
    return (n + 1 if n > 1 else 1), side, n * side


class Llama4Prompt:
    def __init__(self, vision: VisionArch, tokenizer_path: str | None) -> None:
        self.vision = vision
        self.ids = special_ids(tokenizer_path, (IMAGE, X_SEP, Y_SEP))

    hf_kwargs: dict[str, Any] = {}

    @property
    def placeholder(self) -> int:
        """<|image|>'s id (-1 without one: check_tokens refuses the prompt)."""
        return self.ids.get(IMAGE, -1)

    def check_tokens(self) -> None:
        missing = [t for t in (IMAGE, X_SEP, Y_SEP) if t not in self.ids]
        if missing:
            raise InvalidRequestError(
                f"the tokenizer (tokenizer.json) has no {' / '.join(missing)} token: cannot expand Llama 4 "
                "image placeholders"
            )

    def tile_rows(self, out: dict[str, Any]) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """The processor's tiles as one row each [T, C * S * S] and the image's grid."""
        pixels = out["pixel_values"]
        rows, cols = out["aspect_ratios"][0]
        side = self.vision.image_size // self.vision.patch_size
        grid = (pixels.shape[0], int(rows) * side, int(cols) * side)
        return pixels.float().reshape(pixels.shape[0], -1).contiguous(), grid

    def span(self, grid: tuple[int, int, int]) -> list[int]:
        """The tokens between <|image_start|> and <|image_end|> of an image of this grid."""
        v, patch = self.vision, self.vision.image_token_id
        side = v.image_size // v.patch_size
        per_tile = (side // v.spatial_merge_size) ** 2
        rows, cols = grid[1] // side, grid[2] // side
        ids: list[int] = []
        if rows * cols > 1:
            for _ in range(rows):
                for x in range(cols):
                    ids += [patch] * per_tile + [self.ids[X_SEP] if x < cols - 1 else self.ids[Y_SEP]]
        return ids + [self.ids[IMAGE]] + [patch] * per_tile

    def expand(
        self, token_ids: list[int], slots: list[int], processed: list[Pixels]
    ) -> tuple[list[int], MultiModalInputs]:
        start, end = self.vision.vision_start_token_id, self.vision.vision_end_token_id
        assert start is not None and end is not None
        return expand_spans(token_ids, slots, processed, self.vision, self.span, (start, end))
