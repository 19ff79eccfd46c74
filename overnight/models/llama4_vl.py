"""Llama 4 with images (Llama4ForConditionalGeneration: Scout 17B-16E, Maverick 17B-128E): the ViT, the
pixel-shuffle adapter and the projector of models/vision/llama4_vit.py, whose embeddings replace the
<|patch|> tokens' input embeddings, and the text model of models/llama4.py (chunked / NoPE attention,
the input-scaled MoE) unchanged.

An image's tokens in the prompt (multimodal/llama4_prompt.py) are <|image_start|>, per tile its
<|patch|> tokens each followed by a separator (<|tile_x_separator|> within a row of tiles,
<|tile_y_separator|> at a row's end), then <|image|> and the whole image's <|patch|> tokens (one tile
alone: only <|image|> and its tokens), and <|image_end|>. The ImageInput spans everything between the
start and end markers, so embed_images returns a row per token of that span and the runner places
spans as any image's (a prefill chunk may end inside one); the separator and <|image|> rows keep their
own token embeddings (forward takes the tower's rows only where the token is <|patch|>, as transformers
scatters at image_token_index). Attention over image tokens is the text model's (causal, chunked on the
RoPE layers). Decode steps and text-only prompts run exactly as the text model.

Quantization: only the language model; the tower, adapter and projector stay in the compute dtype
(published FP8 Llama 4 checkpoints leave them unquantized), and one that quantized them anyway is
dequantized at load. Tensor parallelism keeps them whole on every rank (parallel/tp_shards.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F

from overnight.arch import ModelArch
from overnight.attention.metadata import AttentionBatch
from overnight.models.llama4 import Llama4ForCausalLM, llama4_names
from overnight.models.vision.interface import VisionFeatures, VisionRows, merge_image_token_rows
from overnight.models.vision.llama4_vit import Llama4MultiModalProjector, Llama4VisionModel, check_tiles

_TOWER = ("vision_model.", "multi_modal_projector.")
_TOWER_MODULES = (r"re:vision_model\.", r"re:multi_modal_projector\.")


class Llama4ForConditionalGeneration(Llama4ForCausalLM):
    unquantized_linear = (*Llama4ForCausalLM.unquantized_linear, *_TOWER_MODULES)
    dequantized_at_load = (*Llama4ForCausalLM.dequantized_at_load, *_TOWER_MODULES)
    takes_images: bool  # models/vision/interface.py: False when built text-only (arch.text_only)
    uses_mrope = False

    def __init__(self, arch: ModelArch) -> None:
        super().__init__(arch)
        assert arch.vision is not None and arch.vision.kind == "llama4"
        self.image_token_id = arch.vision.image_token_id
        self.takes_images = not arch.text_only
        if self.takes_images:
            self.vision_model = Llama4VisionModel(arch.vision)
            self.multi_modal_projector = Llama4MultiModalProjector(arch.vision)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBatch,
        vision: VisionRows | None = None,
    ) -> torch.Tensor:
        # the spans' rows: the tower's embedding at <|patch|>, the token's own elsewhere
        x = merge_image_token_rows(self.model.embed_tokens(input_ids), input_ids, vision, self.image_token_id)
        return self.model.decode(x, positions, attn)

    def embed_images(
        self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]
    ) -> VisionFeatures:
        """The tower over one or more images' tiles (one pixel row per tile, images concatenated, each
        image's canvas tiles row by row then its whole-image tile): per image, a row per token of its
        span, a zero row at each separator and at <|image|>."""
        v = self.arch.vision
        assert v is not None
        check_tiles(v, pixel_values, grid_thw)
        dtype = self.multi_modal_projector.linear_1.weight.dtype
        tiles = pixel_values.to(dtype).view(-1, v.in_channels, v.image_size, v.image_size)
        feats = self.multi_modal_projector(self.vision_model(tiles))  # [tiles, per tile, hidden]
        spans = []
        for image, (t, _, _) in zip(feats.split([t for t, _, _ in grid_thw]), grid_thw):
            whole = F.pad(image[-1], (0, 0, 1, 0))  # <|image|>, then the whole image's tokens
            if t > 1:  # each canvas tile's tokens, then its separator
                spans.append(F.pad(image[:-1], (0, 0, 0, 1)).flatten(0, 1))
            spans.append(whole)
        return VisionFeatures(embeds=torch.cat(spans), deepstack=[])

    def rename_checkpoint(  # type: ignore[override]
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The text model's names as models/llama4.py reads them; the tower's and projector's under
        vision_model.* / multi_modal_projector.* (a model.-prefixed layout too), dropped text-only."""
        return llama4_names(weights, keep_tower=self.takes_images)

    @staticmethod
    def checkpoint_names(module: str) -> tuple[str, ...]:
        """The names a module of this model may carry in a checkpoint (and its ignore list)."""
        if module.startswith(_TOWER):
            return module, "model." + module
        return Llama4ForCausalLM.checkpoint_names(module)  # feed_forward.*, language_model.* too
