"""Gemma 3 with images (Gemma3ForConditionalGeneration): the SigLIP tower and projector of
models/vision/siglip.py, whose mm_tokens_per_image embeddings per image replace the image tokens' input
embeddings (after Gemma's sqrt(hidden) scaling, as HF's masked_scatter does), and the Gemma 3 decoder of
models/gemma.py with 1-D RoPE positions.

An image's tokens attend to each other both ways (HF builds this from token_type_ids); the runner gives
the attention a per-row key limit for them (runner/vision.py, AttentionMetadata.key_limit) and the
scheduler keeps each image within one prefill chunk (VisionArch.bidirectional_images). Decode steps and
text-only prompts run exactly as the text model (CUDA graphs included).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from overnight.arch import ModelArch
from overnight.attention.metadata import AttentionBatch
from overnight.layers.gemma import fold_gemma_norms, softcap
from overnight.models.gemma import GemmaModel, gemma_checkpoint_names, text_weights
from overnight.models.llama import PACKED_MODULES_MAPPING, load_packed_weights, make_lm_head
from overnight.models.vision.interface import VisionFeatures, VisionRows
from overnight.models.vision.siglip import Gemma3MultiModalProjector, SiglipVisionModel, check_pixels

_TOWER = ("vision_tower.", "multi_modal_projector.")
# Quantization leaves the tower and projector in the compute dtype, as published quantized Gemma 3
# checkpoints do (their ignore lists name them); one that quantized them anyway is dequantized at load.
_TOWER_MODULES = (r"re:vision_tower\.", r"re:multi_modal_projector\.")


class Gemma3ForConditionalGeneration(nn.Module):
    packed_modules_mapping = PACKED_MODULES_MAPPING
    # an ignore list may name modules in any layout rename_checkpoint reads (quant/apply.ignored)
    checkpoint_names = staticmethod(gemma_checkpoint_names)
    unquantized_linear = _TOWER_MODULES
    dequantized_at_load = _TOWER_MODULES
    takes_images: bool  # models/vision/interface.py: False when built text-only (arch.text_only)
    uses_mrope = False

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        assert arch.vision is not None and arch.vision.kind == "gemma3"
        self.arch = arch
        self.checkpoint_kv_scales: dict[int, tuple[float, float]] = {}
        self.model = GemmaModel(arch)
        self.takes_images = not arch.text_only
        if self.takes_images:
            self.vision_tower = SiglipVisionModel(arch.vision)
            self.multi_modal_projector = Gemma3MultiModalProjector(arch.vision)
        self.lm_head = make_lm_head(arch, self.model.embed_tokens)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBatch,
        vision: VisionRows | None = None,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, attn, vision)

    def embed_images(
        self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]
    ) -> VisionFeatures:
        """The tower over one or more images (one pixel row each): mm_tokens_per_image rows per image."""
        assert self.arch.vision is not None
        dtype = self.multi_modal_projector.mm_input_projection_weight.dtype
        pixels = check_pixels(pixel_values.to(dtype), self.arch.vision, grid_thw)
        out = self.multi_modal_projector(self.vision_tower(pixels))
        return VisionFeatures(embeds=out.flatten(0, 1), deepstack=[])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return softcap(self.lm_head(hidden), self.arch.final_logit_softcapping)

    def rename_checkpoint(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's names made the model's (language_model.model.* / model.language_model.* ->
        model.*, [model.]vision_tower.vision_model.* -> vision_tower.*; SigLIP's pooling head dropped),
        before integer / FP8 conversion and tensor-parallel slicing (loader/model_loader.py) look
        tensors up by those names. Names only: the model's names pass unchanged."""
        for name, tensor in weights:
            bare = name.removeprefix("model.")
            if bare.startswith("vision_tower.head."):
                continue  # SigLIP's pooling head: Gemma 3 reads the patch features
            if bare.startswith(_TOWER):
                yield bare.replace("vision_tower.vision_model.", "vision_tower.", 1), tensor
            else:
                yield from text_weights(((name, tensor),))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def folded() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in self.rename_checkpoint(weights):
                if not name.startswith(_TOWER):
                    yield from fold_gemma_norms(((name, tensor),))
                elif name.endswith("mm_soft_emb_norm.weight"):  # the projector's norm is 1 + w
                    yield name, tensor.float() + 1.0
                else:  # SigLIP's LayerNorms keep their weights
                    yield name, tensor

        load_packed_weights(self, folded())
