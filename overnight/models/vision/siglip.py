"""Gemma 3's vision tower: SigLIP's encoder over a fixed-size image, and Gemma 3's projector into the
language model (as HF's modeling_siglip.py and modeling_gemma3.py compute them); Idefics3 / SmolVLM run
the same tower on each image_size frame and their own connector (pixel shuffle + linear, below).

    pixels [N, C, S, S]  (every image resized to image_size S by the processor)
      -> patch_embedding: a conv of kernel = stride = patch, so P = (S / patch)^2 patches, + position_embedding[p]
      -> depth pre-LN blocks:  x += out_proj(attention(layer_norm1(x)))   (bidirectional, all P patches)
                               x += fc2(gelu_tanh(fc1(layer_norm2(x))))
      -> post_layernorm
    projector: the P patch features as a (S / patch)^2 grid, average-pooled to mm_tokens_per_image
      (k x k windows, k = VisionArch.spatial_merge_size), then (1 + w) RMSNorm (mm_soft_emb_norm,
      folded at load) and a matrix into the text model's width (mm_input_projection_weight).

The runner hands images in as ImageInput.pixel_values rows [C * S * S] (one row per image, flattened so
images concatenate like the Qwen towers' patches); grid_thw is (1, S / patch, S / patch).
Attention is torch's scaled_dot_product_attention: images have one fixed size, and there is no cache.

Checkpoint names (after the wrapper prefixes are taken off, models/gemma_vl.py):
`vision_tower.{embeddings,encoder.layers.N,post_layernorm}.*` (published checkpoints put `vision_model.`
after `vision_tower.`; SigLIP's attention-pooling `head`, which Gemma 3 never runs, is skipped) and
`multi_modal_projector.*`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from overnight.arch import VisionArch
from overnight.layers.norm import RMSNorm
from overnight.models.vision.qwen_vit import VisionMLP


class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(v.in_channels, v.hidden_size, v.patch_size, stride=v.patch_size)
        self.position_embedding = nn.Embedding((v.image_size // v.patch_size) ** 2, v.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels).flatten(2).transpose(1, 2)  # [N, P, hidden]
        return x + self.position_embedding.weight[None]


class SiglipAttention(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        h = v.hidden_size
        self.num_heads = v.num_heads
        self.q_proj = nn.Linear(h, h)
        self.k_proj = nn.Linear(h, h)
        self.v_proj = nn.Linear(h, h)
        self.out_proj = nn.Linear(h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, p, h = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(n, p, self.num_heads, -1).transpose(1, 2)

        o = F.scaled_dot_product_attention(
            heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        )
        return self.out_proj(o.transpose(1, 2).reshape(n, p, h))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)
        self.self_attn = SiglipAttention(v)
        self.layer_norm2 = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)
        self.mlp = VisionMLP(v)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(v) for _ in range(v.depth))


class SiglipVisionModel(nn.Module):
    """The `vision_tower` of a Gemma 3 checkpoint; the `vision_model` of an Idefics3 / SmolVLM one, whose
    NaViT position ids are the identity on the image_size frames its processor makes."""

    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.embeddings = SiglipVisionEmbeddings(v)
        self.encoder = SiglipEncoder(v)
        self.post_layernorm = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class Gemma3MultiModalProjector(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.per_side = v.image_size // v.patch_size
        self.kernel = v.spatial_merge_size
        # [vision hidden, text hidden]: applied as x @ w (HF stores it so, not as a Linear's [out, in]).
        self.mm_input_projection_weight = nn.Parameter(torch.empty(v.hidden_size, v.out_hidden_size))
        self.mm_soft_emb_norm = RMSNorm(v.hidden_size, eps=v.layer_norm_eps)  # weight holds 1 + w

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[N, P, vision hidden] -> [N, mm_tokens_per_image, text hidden]."""
        n, _, h = features.shape
        grid = features.transpose(1, 2).reshape(n, h, self.per_side, self.per_side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        return (self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight).to(features.dtype)


class Idefics3SimpleMLP(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.proj = nn.Linear(v.hidden_size * v.spatial_merge_size**2, v.out_hidden_size, bias=False)


class Idefics3Connector(nn.Module):
    """Idefics3 / SmolVLM's connector: the P patch features of a frame as a (side x side) grid, each
    k x k block (k = scale_factor = VisionArch.spatial_merge_size) concatenated into one row of
    k^2 * hidden (HF's pixel_shuffle order: the block's rows outer, its columns inner), then one linear
    (modality_projection.proj) into the text model's width."""

    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.scale = v.spatial_merge_size
        self.modality_projection = Idefics3SimpleMLP(v)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[N, P, vision hidden] -> [N, P / k^2, text hidden]."""
        n, p, h = features.shape
        k, side = self.scale, int(round(p**0.5))
        x = features.reshape(n, side, side // k, h * k).transpose(1, 2)  # [N, side / k, side, k * h]
        x = x.reshape(n, side // k, side // k, h * k * k).transpose(1, 2)
        return self.modality_projection.proj(x.reshape(n, p // (k * k), h * k * k))


def check_pixels(pixels: torch.Tensor, v: VisionArch, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
    """ImageInput rows [N, C * S * S] as [N, C, S, S]; one (1, S / patch, S / patch) grid per row."""
    side = v.image_size // v.patch_size
    if pixels.dim() != 2 or pixels.shape[1] != v.in_channels * v.image_size**2:
        raise ValueError(
            f"pixel rows {tuple(pixels.shape)} are not [images, {v.in_channels}*{v.image_size}^2]"
        )
    if len(grid_thw) != pixels.shape[0] or any(g != (1, side, side) for g in grid_thw):
        raise ValueError(f"Gemma 3 images are one ({1}, {side}, {side}) grid each, got {grid_thw}")
    return pixels.view(-1, v.in_channels, v.image_size, v.image_size)
