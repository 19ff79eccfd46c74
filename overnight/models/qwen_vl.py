"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL (and GLM-4.1V / 4.5V, on GLM-4's decoders): a vision tower
(models/vision/qwen_vit.py, vision/glm4v_vit.py) whose image embeddings replace the image-pad tokens'
input embeddings, and the Qwen2 / Qwen3 / GLM-4 decoder of models/llama.py with M-RoPE
(layers/mrope.py) instead of RoPE. Qwen3-VL also adds "deepstack" features of the tower's early blocks
to the image tokens' hidden states after each of the first decoder layers.

The runner hands the step's image rows in as VisionRows: the rows of the flattened batch that hold image
tokens and their embeddings (a prefill chunk may hold only part of an image: the rows it covers). Decode
steps and text-only prompts pass none and run exactly as the text model (CUDA graphs included).

Checkpoint names: Qwen2-VL and Qwen2.5-VL ship `model.layers.*` / `visual.*`, Qwen3-VL
`model.language_model.*` / `model.visual.*` (and transformers 5 saves either in the second layout); both
load into `model.*` / `visual.*` here. The renaming happens in rename_checkpoint, before quantized checkpoints' tensors are
converted (they are looked up by the model's names), and a quantization_config's ignore list may name
modules in either layout (checkpoint_names).

Quantization: only the language model. The vision tower stays in the compute dtype whatever the
scheme (every published quantized checkpoint lists it as ignored, and online FP8 leaves it too); a
checkpoint that quantizes it anyway has its tower tensors dequantized as they load.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import cast

import torch
from torch import nn

from overnight.arch import ModelArch, VisionArch
from overnight.attention.metadata import AttentionBatch
from overnight.layers.mrope import MRotaryEmbedding
from overnight.layers.norm import RMSNorm
from overnight.layers.rotary import RotaryEmbedding
from overnight.models.checkpoint import EXPERT_TENSORS
from overnight.models.glm4_moe import glm4_moe_mlp, without_mtp_layers
from overnight.models.layer_spec import layer_specs
from overnight.models.llama import (
    LINEAR_INPUT_PRODUCERS,
    PACKED_MODULES_MAPPING,
    LlamaDecoderLayer,
    MlpFactory,
    dense_mlp,
    load_packed_weights,
    make_lm_head,
)
from overnight.models.vision.glm4v_vit import Glm4vVisionModel
from overnight.models.vision.interface import VisionFeatures, VisionRows, merge_image_rows
from overnight.models.vision.qwen_vit import build_vision_tower, tower_features


class QwenVLTextModel(nn.Module):
    def __init__(self, arch: ModelArch, make_mlp: MlpFactory = dense_mlp) -> None:
        super().__init__()
        section = arch.mrope_section
        assert len(section) == 3, "an M-RoPE model needs a 3-part mrope_section"
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        rotary = MRotaryEmbedding(
            arch.head_dim,
            arch.max_position_embeddings,
            arch.rope_theta,
            (section[0], section[1], section[2]),
            interleaved=arch.mrope_interleaved,
            rotary_dim=arch.rotary_dim,
            pair_interleaved=arch.rope_interleaved,
        )
        # The decoder layers take a RotaryEmbedding; M-RoPE has its call signature.
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(arch, i, spec, cast(RotaryEmbedding, rotary), make_mlp)
            for i, spec in enumerate(layer_specs(arch))
        )
        self.norm = RMSNorm(arch.hidden_size, eps=arch.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBatch,
        vision: VisionRows | None = None,
    ) -> torch.Tensor:
        x = merge_image_rows(self.embed_tokens(input_ids), vision)
        deepstack = vision.deepstack if vision is not None else []
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(positions, x, residual, attn)
            if i < len(deepstack):
                assert vision is not None and residual is not None
                # The layer's output is x + residual; the features join that sum (HF's order of adds).
                x = (x + residual).index_add(0, vision.rows, deepstack[i].to(x.dtype))
                residual = None
        if residual is None:
            return self.norm(x)
        x, _ = self.norm(x, residual)
        return x


# The vision tower's modules (model names, after _renamed): kept in the compute dtype (quant/apply.py).
VISION_TOWER = r"re:visual\."


class QwenVLForConditionalGeneration(nn.Module):
    """Qwen2VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration and
    Qwen3VLForConditionalGeneration (arch.vision.kind says which tower; the decoder's flags come from
    the text config as for Qwen2 / Qwen3)."""

    packed_modules_mapping = PACKED_MODULES_MAPPING
    unquantized_linear: tuple[str, ...] = (VISION_TOWER,)
    dequantized_at_load: tuple[str, ...] = (VISION_TOWER,)  # FP8 tower tensors (quant/checkpoint.py)
    linear_input_producers = LINEAR_INPUT_PRODUCERS
    takes_images: bool  # models/vision/interface.py: False when built text-only (arch.text_only)
    uses_mrope = True

    def __init__(self, arch: ModelArch, make_mlp: MlpFactory = dense_mlp) -> None:
        super().__init__()
        assert arch.vision is not None
        self.arch = arch
        self.checkpoint_kv_scales: dict[int, tuple[float, float]] = {}
        self.model = QwenVLTextModel(arch, make_mlp)
        self.takes_images = not arch.text_only
        if self.takes_images:
            self.visual = self.build_tower(arch.vision)
        self.lm_head = make_lm_head(arch, self.model.embed_tokens)

    @staticmethod
    def build_tower(v: VisionArch) -> nn.Module:
        return build_vision_tower(v)

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
        """The tower over one or more images (their patches concatenated): their token embeddings."""
        return tower_features(self.visual, pixel_values, grid_thw)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def rename_checkpoint(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Applied to the checkpoint stream before integer / FP8 conversion and tensor-parallel slicing
        (loader/model_loader.checkpoint_weights), which look tensors up by the model's names."""
        return _per_expert(_renamed(weights), self.arch)

    @staticmethod
    def checkpoint_names(module: str) -> tuple[str, ...]:
        """The names a module of this model may carry in a checkpoint (and its ignore list)."""
        return vl_checkpoint_names(module)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        # renamed and split names pass unchanged (rename_checkpoint may have run already)
        load_packed_weights(self, self.rename_checkpoint(weights))


def qwen3_vl_moe_mlp(arch: ModelArch, layer_idx: int) -> nn.Module:
    """Qwen3-VL-MoE's sparse MLP: Qwen3-MoE's block (router + stacked experts, layers/moe.py)."""
    from overnight.models.qwen3_moe import qwen3_moe_mlp

    return qwen3_moe_mlp(arch, layer_idx)


class Qwen3VLMoeForConditionalGeneration(QwenVLForConditionalGeneration):
    """Qwen3-VL's tower and decoder with Qwen3-MoE's sparse MLPs (the fused MoE path on the GPU); the
    router and experts are quantized as Qwen3-MoE's (models/qwen3_moe.py says how)."""

    unquantized_linear = (VISION_TOWER, "mlp.gate")
    dequantized_at_load = (VISION_TOWER, EXPERT_TENSORS, "mlp.gate")

    def __init__(self, arch: ModelArch) -> None:
        super().__init__(arch, make_mlp=qwen3_vl_moe_mlp)


class Glm4vForConditionalGeneration(QwenVLForConditionalGeneration):
    """GLM-4.1V-Thinking: GLM-4's decoder (sandwich norms, fused gate_up_proj, partial RoPE in
    interleaved pairs: ModelArch flags of the glm4 family) with M-RoPE over its rotated dims, and
    GLM-4.1V's tower (models/vision/glm4v_vit.py). Its checkpoints use transformers 5's layout
    (model.language_model.*, model.visual.*), renamed as Qwen3-VL's; the decoder's fused
    mlp.gate_up_proj is split into gate_proj / up_proj in the same pass, so online FP8 and
    tensor-parallel slicing see the separate tensors (the tower's names never match)."""

    @staticmethod
    def build_tower(v: VisionArch) -> nn.Module:
        return Glm4vVisionModel(v)

    def rename_checkpoint(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        return _split_gate_up(super().rename_checkpoint(weights))


def _split_gate_up(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A decoder layer's fused mlp.gate_up_proj [2I, H] as gate_proj (the first I rows) and up_proj.
    Split in halves, never by arch's intermediate size: a tensor-parallel rank's model (its arch a
    share) renames the whole checkpoint tensors before slicing them."""
    for name, tensor in weights:
        if (
            name.startswith("model.layers.")
            and name.endswith("mlp.gate_up_proj.weight")
            and tensor.dim() == 2
        ):
            base = name.removesuffix("gate_up_proj.weight")
            gate, up = tensor.chunk(2, dim=0)
            yield f"{base}gate_proj.weight", gate
            yield f"{base}up_proj.weight", up
        else:
            yield name, tensor


def vl_checkpoint_names(module: str) -> tuple[str, ...]:
    """A module's own name (model.*, visual.*) and its name in transformers 5's layout
    (model.language_model.*, model.visual.*): the two names _renamed maps to it."""
    if module.startswith("model."):
        return module, "model.language_model." + module.removeprefix("model.")
    if module.startswith("visual."):
        return module, "model." + module
    return (module,)


def _renamed(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        if name.startswith("model.language_model."):
            name = "model." + name.removeprefix("model.language_model.")
        elif name.startswith("model.visual."):
            name = name.removeprefix("model.")
        yield name, tensor


def _per_expert(
    weights: Iterable[tuple[str, torch.Tensor]], arch: ModelArch
) -> Iterator[tuple[str, torch.Tensor]]:
    """Qwen3-VL-MoE stores each layer's experts fused (mlp.experts.gate_up_proj, mlp.experts.down_proj);
    split them into the per-expert tensors load_packed_weights stacks. Both layouts occur: transformers
    5's [E, 2I, H] / [E, H, I], and the published checkpoints' transposed [E, H, 2I] / [E, I, H] (told
    apart by shape, as transformers does; a square one is taken as transformers'). Told by the hidden
    size and split in halves, never by arch's intermediate size: a rank's model (`arch` its share)
    renames the whole checkpoint tensors before slicing them."""
    hidden = arch.hidden_size
    for name, tensor in weights:
        if name.endswith("mlp.experts.gate_up_proj"):
            if tensor.shape[2] != hidden:
                tensor = tensor.transpose(1, 2)
            prefix = name.removesuffix("gate_up_proj")
            inter = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                yield f"{prefix}{e}.gate_proj.weight", tensor[e, :inter]
                yield f"{prefix}{e}.up_proj.weight", tensor[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            if tensor.shape[1] != hidden:
                tensor = tensor.transpose(1, 2)
            prefix = name.removesuffix("down_proj")
            for e in range(tensor.shape[0]):
                yield f"{prefix}{e}.down_proj.weight", tensor[e]
        else:
            yield name, tensor


class Glm4vMoeForConditionalGeneration(Glm4vForConditionalGeneration):
    """GLM-4.5V / GLM-4.6V: GLM-4.1V's tower and GLM-4.5's decoder (pre-norm blocks, rotate-half partial
    RoPE under M-RoPE, the first first_k_dense_replace layers dense, the others Glm4MoeMoE: the grouped
    sigmoid router in float32, stacked routed experts, shared experts; models/glm4_moe.py says how they
    quantize). The checkpoint's multi-token-prediction layers are dropped as GLM-4.5's are."""

    unquantized_linear = (VISION_TOWER, "mlp.gate")
    dequantized_at_load = (VISION_TOWER, EXPERT_TENSORS, "mlp.gate")

    def __init__(self, arch: ModelArch) -> None:
        super().__init__(arch, make_mlp=glm4_moe_mlp)

    def rename_checkpoint(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        return without_mtp_layers(super().rename_checkpoint(weights), self.arch.num_hidden_layers)
