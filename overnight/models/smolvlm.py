"""Idefics3 / SmolVLM with images (Idefics3ForConditionalGeneration: SmolVLM-256M / 500M-Instruct;
SmolVLMForConditionalGeneration: SmolVLM2): the SigLIP tower of models/vision/siglip.py on every frame
of an image, the pixel-shuffle connector, whose embeddings replace the <image> tokens' input embeddings,
and the Llama decoder (SmolLM2) of models/llama.py with its 1-D RoPE.

An image's prompt (multimodal/idefics3_prompt.py) is, per tile of its grid,
<fake_token_around_image> <row_r_col_c> and mm_tokens_per_image <image> tokens, a newline after each row
of tiles, then the whole image as <fake_token_around_image> <global-img>, its <image> tokens and
<fake_token_around_image> (an image no larger than one frame: that global part alone). Each frame's
<image> run is an ImageInput of its own (grid (1, side, side), side = patches per frame side), so
embed_images returns mm_tokens_per_image rows per frame and the runner places them as any image's; the
markers are text. Attention over image tokens is causal, as for text. Decode steps and text-only prompts
run exactly as the text model.

Quantization: only the language model; the tower and connector stay in the compute dtype, and one that
quantized them anyway is dequantized at load.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from overnight.arch import ModelArch
from overnight.attention.metadata import AttentionBatch
from overnight.errors import ModelLoadError
from overnight.models.checkpoint import load_packed_weights
from overnight.models.llama import LINEAR_INPUT_PRODUCERS, PACKED_MODULES_MAPPING, LlamaModel, make_lm_head
from overnight.models.vision.config import idefics3_vision_arch
from overnight.models.vision.interface import VisionFeatures, VisionRows, merge_image_rows
from overnight.models.vision.siglip import Idefics3Connector, SiglipVisionModel

_TOWER = ("vision_model.", "connector.")
_TOWER_MODULES = (r"re:vision_model\.", r"re:connector\.")
# checkpoint prefix -> the model's (transformers 4 and 5 save the same layout)
_RENAMES = (
    ("model.text_model.", "model."),
    ("model.vision_model.", "vision_model."),
    ("model.connector.", "connector."),
)


class Idefics3ForConditionalGeneration(nn.Module):
    packed_modules_mapping = PACKED_MODULES_MAPPING
    linear_input_producers = LINEAR_INPUT_PRODUCERS
    unquantized_linear: tuple[str, ...] = _TOWER_MODULES
    dequantized_at_load: tuple[str, ...] = _TOWER_MODULES
    takes_images: bool  # models/vision/interface.py: False when built text-only (arch.text_only)
    uses_mrope = False

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        assert arch.vision is not None and arch.vision.kind == "idefics3"
        self.arch = arch
        self.checkpoint_kv_scales: dict[int, tuple[float, float]] = {}
        self.model = LlamaModel(arch)
        self.takes_images = not arch.text_only
        if self.takes_images:
            self.vision_model = SiglipVisionModel(arch.vision)
            self.connector = Idefics3Connector(arch.vision)
        self.lm_head = make_lm_head(arch, self.model.embed_tokens)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBatch,
        vision: VisionRows | None = None,
    ) -> torch.Tensor:
        x = merge_image_rows(self.model.embed_tokens(input_ids), vision)
        return self.model.decode(x, positions, attn)

    def embed_images(
        self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]
    ) -> VisionFeatures:
        """The tower over one or more frames (one pixel row [C * S * S] each, S = image_size):
        mm_tokens_per_image rows per frame, frames concatenated."""
        v = self.arch.vision
        assert v is not None
        side = v.image_size // v.patch_size
        if pixel_values.dim() != 2 or pixel_values.shape[1] != v.in_channels * v.image_size**2:
            raise ValueError(
                f"pixel rows {tuple(pixel_values.shape)} are not [frames, {v.in_channels}*{v.image_size}^2]"
            )
        if len(grid_thw) != pixel_values.shape[0] or any(g != (1, side, side) for g in grid_thw):
            raise ValueError(f"Idefics3 frames are one (1, {side}, {side}) grid each, got {grid_thw}")
        dtype = self.connector.modality_projection.proj.weight.dtype
        frames = pixel_values.to(dtype).view(-1, v.in_channels, v.image_size, v.image_size)
        out = self.connector(self.vision_model(frames))
        return VisionFeatures(embeds=out.flatten(0, 1), deepstack=[])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def rename_checkpoint(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's names made the model's (model.text_model.* -> model.*, model.vision_model.* ->
        vision_model.*, model.connector.* -> connector.*), before integer / FP8 conversion and
        tensor-parallel slicing look tensors up by those names. Names only: the model's pass unchanged."""
        for name, tensor in weights:
            for old, new in _RENAMES:
                if name.startswith(old):
                    name = new + name[len(old) :]
                    break
            yield name, tensor

    @staticmethod
    def checkpoint_names(module: str) -> tuple[str, ...]:
        """The names a module of this model may carry in a checkpoint (and its ignore list)."""
        for old, new in _RENAMES:
            if module.startswith(new):
                return module, old + module[len(new) :]
        return (module,)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_packed_weights(self, self.rename_checkpoint(weights))


def idefics3_arch(
    cfg: dict[str, Any], family: str, text_arch: Callable[[dict[str, Any]], ModelArch]
) -> ModelArch:
    """Idefics3 / SmolVLM: text_config's Llama decoder (read by `text_arch`, the registry's reader of a
    text family's config.json) and the SigLIP tower. The LM head is tied when the top level says so,
    else as the text model says."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ModelLoadError("config.json lacks required field 'text_config'")
    if text.get("model_type", "llama") != "llama":
        raise ModelLoadError(
            f"unsupported text model {text['model_type']!r} in an Idefics3 / SmolVLM checkpoint (llama)"
        )
    tie = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    base = text_arch({**text, "architectures": [], "model_type": "llama"})
    return replace(
        base,
        architecture=family,
        tie_word_embeddings=bool(tie),
        vision=idefics3_vision_arch(cfg, base.hidden_size),
    )
