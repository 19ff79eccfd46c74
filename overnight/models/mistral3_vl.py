"""Mistral 3 with images (Mistral3ForConditionalGeneration: Mistral Small 3.1 / 3.2): Pixtral's tower, the
patch merger and the projector of models/vision/pixtral.py, whose embeddings replace the [IMG] tokens'
input embeddings, and the Mistral / Ministral 3 decoder of models/llama.py with its 1-D RoPE.

An image's tokens in the prompt (multimodal/pixtral_prompt.py) are, per row of merged patches, that
row's [IMG] tokens and one [IMG_BREAK] ([IMG_END] after the last row). embed_images returns a row per
token of that whole span, so the runner places spans as it places any image's tokens (a prefill chunk
may end inside one); the [IMG_BREAK] / [IMG_END] rows keep their own token embeddings (forward picks
the tower's rows only where the token is [IMG], as HF scatters at image_token_id). Attention over image
tokens is causal, as for text. Decode steps and text-only prompts run exactly as the text model.

Quantization: only the language model; the tower and projector stay in the compute dtype (published
quantized Mistral 3 checkpoints list them as ignored), and one that quantized them anyway is
dequantized at load.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from overnight.arch import ModelArch
from overnight.attention.metadata import AttentionBatch
from overnight.models.checkpoint import load_packed_weights
from overnight.models.llama import LINEAR_INPUT_PRODUCERS, PACKED_MODULES_MAPPING, LlamaModel, make_lm_head
from overnight.models.vision.checkpoint import rename_tower_checkpoint, tower_checkpoint_names
from overnight.models.vision.interface import VisionFeatures, VisionRows, merge_image_token_rows
from overnight.models.vision.pixtral import (
    Mistral3MultiModalProjector,
    PixtralVisionModel,
    check_grids,
)

_TOWER = ("vision_tower.", "multi_modal_projector.")
_TOWER_MODULES = (r"re:vision_tower\.", r"re:multi_modal_projector\.")


class Mistral3VLForConditionalGeneration(nn.Module):
    packed_modules_mapping = PACKED_MODULES_MAPPING
    linear_input_producers = LINEAR_INPUT_PRODUCERS
    unquantized_linear = _TOWER_MODULES
    dequantized_at_load = _TOWER_MODULES
    takes_images: bool  # models/vision/interface.py: False when built text-only (arch.text_only)
    uses_mrope = False

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        assert arch.vision is not None and arch.vision.kind == "pixtral"
        self.arch = arch
        self.image_token_id = arch.vision.image_token_id
        self.checkpoint_kv_scales: dict[int, tuple[float, float]] = {}
        self.model = LlamaModel(arch)
        self.takes_images = not arch.text_only
        if self.takes_images:
            self.vision_tower = PixtralVisionModel(arch.vision)
            self.multi_modal_projector = Mistral3MultiModalProjector(arch.vision)
        self.lm_head = make_lm_head(arch, self.model.embed_tokens)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBatch,
        vision: VisionRows | None = None,
    ) -> torch.Tensor:
        # the spans' rows: the tower's embedding at [IMG], the token's own elsewhere
        x = merge_image_token_rows(self.model.embed_tokens(input_ids), input_ids, vision, self.image_token_id)
        return self.model.decode(x, positions, attn)

    def embed_images(
        self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]
    ) -> VisionFeatures:
        """The tower over one or more images (their patch rows concatenated): per image, a row per token
        of its span, rows of merged patches each followed by a zero row at its [IMG_BREAK] / [IMG_END]."""
        v = self.arch.vision
        assert v is not None
        check_grids(v, pixel_values, grid_thw)
        dtype = self.multi_modal_projector.linear_1.weight.dtype
        merged = self.multi_modal_projector(self.vision_tower(pixel_values.to(dtype), grid_thw), grid_thw)
        m = v.spatial_merge_size
        spans = []  # each VisionArch.num_tokens(grid) rows
        for x, (_, h, w) in zip(merged.split([h * w // m**2 for _, h, w in grid_thw]), grid_thw):
            spans.append(F.pad(x.view(h // m, w // m, -1), (0, 0, 0, 1)).flatten(0, 1))
        return VisionFeatures(embeds=torch.cat(spans), deepstack=[])

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
