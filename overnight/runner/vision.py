"""The runner's side of image inputs (vision-language models): M-RoPE positions and the image rows of a
step, with an LRU cache of encoder outputs keyed by the images' content hashes.

Per step:
  - positions: a decode-only step keeps 1-D positions, each row shifted by its request's rope delta
    (three equal axes rotate as plain RoPE: models/qwen_vl.py, the CUDA graphs replay unchanged); a
    step with prompt rows of a request with images gets [3, T] positions (its prompt's grid positions).
  - vision rows: for each prompt chunk that covers image tokens (possibly part of an image: a chunk may
    end inside one), the rows of the flattened batch and the matching rows of the image's embeddings.
    Images not in the cache are encoded together, once, in one call of the tower.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np
import torch

from overnight.models.vision.interface import ImageModel, VisionFeatures, VisionRows
from overnight.models.vision.segments import to_device

if TYPE_CHECKING:
    from overnight.multimodal.inputs import ImageInput
    from overnight.runner.request_state import ScheduledRequest


def _nbytes(f: VisionFeatures) -> int:
    return sum(t.numel() * t.element_size() for t in [f.embeds, *f.deepstack])


class EncoderCache:
    """Encoder outputs by content hash, least recently used dropped first past max_bytes."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.items: OrderedDict[str, VisionFeatures] = OrderedDict()
        self.bytes = 0

    def get(self, key: str) -> VisionFeatures | None:
        f = self.items.get(key)
        if f is not None:
            self.items.move_to_end(key)
        return f

    def put(self, key: str, f: VisionFeatures) -> None:
        if key in self.items:
            return
        self.items[key] = f
        self.bytes += _nbytes(f)
        # The newest entry always stays: the step that asked for it still needs it.
        while self.bytes > self.max_bytes and len(self.items) > 1:
            _, old = self.items.popitem(last=False)
            self.bytes -= _nbytes(old)


class VisionStep:
    def __init__(
        self, model: ImageModel, device: torch.device, cache_bytes: int = 1 << 30, max_tokens: int = 0
    ) -> None:
        self.model = model
        self.mrope = model.uses_mrope
        assert model.arch.vision is not None
        self.bidirectional = model.arch.vision.bidirectional_images
        self.device = device
        self.max_tokens = max_tokens  # max_num_batched_tokens: the image tokens one step may hold
        self.cache = EncoderCache(cache_bytes)
        self.images_encoded = 0  # images run through the tower (a test counts them)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return to_device(t, self.device)  # without waiting for the steps queued ahead

    def positions(
        self, scheduled: list[ScheduledRequest], positions: torch.Tensor, decode_only: bool
    ) -> torch.Tensor:
        """The step's positions for an M-RoPE model (positions: the 1-D ones the buffers built)."""
        deltas = [
            s.state.multi_modal.mrope_delta if s.state.multi_modal is not None else 0 for s in scheduled
        ]
        if decode_only:
            if any(deltas):
                positions[: len(scheduled)] += self._to_device(torch.tensor(deltas, dtype=positions.dtype))
            return positions
        if not any(s.state.multi_modal is not None for s in scheduled):
            return positions
        pieces = []
        for s, delta in zip(scheduled, deltas):
            p = np.arange(s.start, s.start + s.num_tokens, dtype=np.int64)
            mm = s.state.multi_modal
            rows = np.broadcast_to(p + delta, (3, len(p))).copy()
            if mm is not None:
                inside = p < mm.mrope_positions.shape[1]
                rows[:, inside] = mm.mrope_positions[:, p[inside]]
            pieces.append(rows)
        host = np.concatenate(pieces, axis=1)
        pad = positions.shape[0] - host.shape[1]
        if pad > 0:
            host = np.concatenate([host, np.zeros((3, pad), dtype=np.int64)], axis=1)
        return self._to_device(torch.from_numpy(host))

    def key_limits(self, scheduled: list[ScheduledRequest], num_rows: int) -> torch.Tensor | None:
        """[num_rows] int32 last visible key per row (AttentionMetadata.key_limit) for a step with
        prompt chunks of a model whose image tokens attend both ways; None when no chunk holds one.
        A row's limit is its position, or inside an image its image's last position (the scheduler keeps
        an image within one chunk, so that key is written in this step)."""
        if not self.bidirectional:
            return None
        pieces: list[np.ndarray] = []
        found = False
        for s in scheduled:
            start, end = s.start, s.start + s.num_tokens
            p = np.arange(start, end, dtype=np.int32)
            mm = s.state.multi_modal
            if mm is not None:
                for im in mm.images:
                    lo, hi = max(start, im.offset), min(end, im.end)
                    if lo < hi:
                        assert lo == im.offset and hi == im.end, "an image split across prefill chunks"
                        p[lo - start : hi - start] = im.end - 1
                        found = True
            pieces.append(p)
        if not found:
            return None
        host = np.zeros(num_rows, dtype=np.int32)
        flat = np.concatenate(pieces)
        host[: len(flat)] = flat
        return self._to_device(torch.from_numpy(host))

    def rows(self, scheduled: list[ScheduledRequest]) -> VisionRows | None:
        """The image rows of a step with prompt chunks (None when no chunk covers an image token)."""
        wanted: list[tuple[int, ImageInput, int, int]] = []  # (batch row, image, first, last) token
        row = 0
        for s in scheduled:
            mm = s.state.multi_modal
            start, end = s.start, s.start + s.num_tokens
            if mm is not None:
                for im in mm.images:
                    lo, hi = max(start, im.offset), min(end, im.end)
                    if lo < hi:
                        wanted.append((row + lo - start, im, lo - im.offset, hi - im.offset))
            row += s.num_tokens
        if not wanted:
            return None
        feats = self._features([im for _, im, _, _ in wanted])
        rows, embeds = [], []
        deepstack: list[list[torch.Tensor]] = []
        for batch_row, im, a, b in wanted:
            f = feats[im.content_hash]
            rows.append(torch.arange(batch_row, batch_row + b - a))
            embeds.append(f.embeds[a:b])
            for i, d in enumerate(f.deepstack):
                if len(deepstack) <= i:
                    deepstack.append([])
                deepstack[i].append(d[a:b])
        return VisionRows(
            rows=self._to_device(torch.cat(rows)),
            embeds=torch.cat(embeds),
            deepstack=[torch.cat(d) for d in deepstack],
        )

    def run_largest_image(self, model_path: str | None) -> None:
        """Run the tower once on the largest image the checkpoint's image processor makes (its
        max_pixels, as a square), so the start-up peak-memory step counts the encoder's activations."""
        vision = self.model.arch.vision
        assert vision is not None
        if vision.kind == "idefics3":  # frames of one size: a step's budget of them, one more cut at each end
            side = vision.image_size // vision.patch_size
            n = self.max_tokens // vision.mm_tokens_per_image + 2
            pixels = torch.zeros(n, vision.in_channels * vision.image_size**2, device=self.device)
            self.model.embed_images(pixels, [(1, side, side)] * n)
            return
        if vision.kind == "gemma3":  # one size: the most one step encodes is every image in its budget
            side = vision.image_size // vision.patch_size
            n = max(1, self.max_tokens // max(1, vision.mm_tokens_per_image))
            pixels = torch.zeros(n, vision.in_channels * vision.image_size**2, device=self.device)
            self.model.embed_images(pixels, [(1, side, side)] * n)
            return
        if vision.kind == "pixtral":  # square images of the longest edge, as many as one step's budget holds
            from overnight.multimodal.pixtral_prompt import longest_edge

            m = vision.spatial_merge_size
            blocks = -(-longest_edge(model_path, vision) // (vision.patch_size * m))  # merged patches a side
            n = max(1, self.max_tokens // (blocks * (blocks + 1)))
            width = vision.in_channels * vision.patch_size**2
            pixels = torch.zeros(n * (blocks * m) ** 2, width, device=self.device)
            self.model.embed_images(pixels, [(1, blocks * m, blocks * m)] * n)
            return
        if vision.kind == "internvl":  # the most tiles an image makes, as many images as one step holds
            from overnight.multimodal.internvl_prompt import max_tiles

            tiles, size = max_tiles(model_path, vision)
            side = size // vision.patch_size
            n = max(1, self.max_tokens // vision.num_tokens((tiles, side, side)))
            pixels = torch.zeros(n * tiles, vision.in_channels * size * size, device=self.device)
            self.model.embed_images(pixels, [(tiles, side, side)] * n)
            return
        if vision.kind == "llama4":  # the image of the most tiles, as many as one step's budget holds
            from overnight.multimodal.llama4_prompt import largest_grid

            grid = largest_grid(model_path, vision)
            n = max(1, self.max_tokens // vision.num_tokens(grid))
            pixels = torch.zeros(n * grid[0], vision.in_channels * vision.image_size**2, device=self.device)
            self.model.embed_images(pixels, [grid] * n)
            return
        max_pixels = 28 * 28 * 1280  # the HF processor's default
        path = os.path.join(model_path, "preprocessor_config.json") if model_path else None
        if path and os.path.isfile(path):
            with open(path) as f:
                cfg = json.load(f)
            max_pixels = int(
                cfg.get("max_pixels") or (cfg.get("size") or {}).get("longest_edge") or max_pixels
            )
        if vision.kind == "glm4v":  # GLM-4.1V's processor bounds t x h x w, t an image's 2 frames
            max_pixels //= vision.temporal_patch_size
        unit = vision.patch_size * vision.spatial_merge_size
        side = max(1, int(max_pixels**0.5) // unit) * vision.spatial_merge_size  # patches on a side
        width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        pixels = torch.zeros(side * side, width, device=self.device)
        self.model.embed_images(pixels, [(1, side, side)])

    def _features(self, images: list[ImageInput]) -> dict[str, VisionFeatures]:
        found: dict[str, VisionFeatures] = {}
        missing: dict[str, ImageInput] = {}
        for im in images:
            f = self.cache.get(im.content_hash)
            if f is not None:
                found[im.content_hash] = f
            else:
                missing.setdefault(im.content_hash, im)
        if missing:
            todo = list(missing.values())
            pixels = self._to_device(torch.cat([im.pixel_values for im in todo]))
            out = self.model.embed_images(pixels, [im.grid_thw for im in todo])
            self.images_encoded += len(todo)
            sizes = [im.num_tokens for im in todo]
            embeds = out.embeds.split(sizes)
            deep = [d.split(sizes) for d in out.deepstack]
            for i, im in enumerate(todo):
                f = VisionFeatures(embeds=embeds[i], deepstack=[d[i] for d in deep])
                self.cache.put(im.content_hash, f)
                found[im.content_hash] = f
        return found
