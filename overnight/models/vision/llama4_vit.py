"""Llama 4's vision side: its ViT over fixed-size tiles, the pixel-shuffle adapter MLP and the projector
into the language model (as HF's modeling_llama4.py computes them).

Every tile is image_size x image_size pixels (the processor cuts an image into tiles and, past one
tile, adds the whole image resized to one: multimodal/llama4_prompt.py), so the tower runs on a plain
batch of tiles:

    tiles [N, C, S, S]
      -> patch_embedding: unfold into p x p patches (features ordered channel, row, column), a linear
         without bias; the class embedding appended *after* the patches; positional_embedding_vlm
         (one learned row per patch and one for the class token); layernorm_pre
      -> depth pre-norm blocks:  x += o_proj(attention(input_layernorm(x)))   (2-D RoPE, within a tile)
                                 x += fc2(gelu(fc1(post_attention_layernorm(x))))
      -> layernorm_post, the class token dropped
    vision_adapter: pixel shuffle (each m x m block of patches, m = 1 / pixel_shuffle_ratio, becomes one
      row ordered (row in block, column in block, channel)), then mlp.fc1, gelu, mlp.fc2, gelu
    multi_modal_projector.linear_1  -> one embedding per <|patch|> token, (side / m)^2 a tile.

2-D RoPE (interleaved pairs, as complex numbers): of each head's head_dim / 2 pairs, the first half
turn with the patch's column + 1 and the second half with its row + 1, at head_dim / 4 frequencies
theta^(-4j / head_dim); the class token does not turn. The LayerNorms take torch's default eps and
the MLPs exact GELU whatever the config says, as transformers builds them.

Checkpoint names (after the wrapper prefixes are taken off, models/llama4_vl.py):
`vision_model.{patch_embedding.linear,class_embedding,positional_embedding_vlm,layernorm_pre,
layernorm_post,model.layers.N.{self_attn.{q,k,v,o}_proj,mlp.fc1,mlp.fc2,input_layernorm,
post_attention_layernorm},vision_adapter.mlp.{fc1,fc2}}` and `multi_modal_projector.linear_1`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from overnight.arch import VisionArch
from overnight.models.vision.internvit import pixel_shuffle
from overnight.models.vision.qwen_vit import VisionMLP

Grid = tuple[int, int, int]  # (tiles, patch rows of the tile canvas, patch columns of the tile canvas)


def rotary_cos_sin(v: VisionArch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [side^2 + 1, 1, head_dim / 2]: one angle per interleaved pair, the patches row by row,
    then the class token (angle 0)."""
    side = v.image_size // v.patch_size
    head_dim = v.hidden_size // v.num_heads
    quarter = head_dim // 4
    inv_freq = 1.0 / (
        v.rope_theta ** (torch.arange(quarter, dtype=torch.float32, device=device) * 4 / head_dim)
    )
    idx = torch.arange(side * side, device=device)
    cols, rows = (idx % side + 1).float(), (idx // side + 1).float()
    angles = torch.cat([cols[:, None] * inv_freq, rows[:, None] * inv_freq], dim=-1)
    angles = torch.cat([angles, angles.new_zeros(1, angles.shape[1])])[:, None, :]
    return angles.cos(), angles.sin()


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, L, heads, head_dim] with pairs (2i, 2i + 1) turned by pair i's angle, in float32."""
    pairs = x.float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2).to(x.dtype)


class Llama4UnfoldConvolution(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.patch = v.patch_size
        self.linear = nn.Linear(v.in_channels * v.patch_size**2, v.hidden_size, bias=False)

    def forward(self, tiles: torch.Tensor) -> torch.Tensor:
        patches = F.unfold(tiles, kernel_size=self.patch, stride=self.patch)  # [N, C * p * p, L]
        return self.linear(patches.transpose(1, 2))


class Llama4VisionAttention(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        h = v.hidden_size
        self.num_heads = v.num_heads
        self.q_proj = nn.Linear(h, h)
        self.k_proj = nn.Linear(h, h)
        self.v_proj = nn.Linear(h, h)
        self.o_proj = nn.Linear(h, h)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n, length, _ = x.shape
        q, k, val = (
            p(x).view(n, length, self.num_heads, -1) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        q, k = _rotate_pairs(q, cos, sin), _rotate_pairs(k, cos, sin)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), val.transpose(1, 2))
        return self.o_proj(out.transpose(1, 2).reshape(n, length, -1))


class Llama4VisionEncoderLayer(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(v.hidden_size)
        self.self_attn = Llama4VisionAttention(v)
        self.post_attention_layernorm = nn.LayerNorm(v.hidden_size)
        self.mlp = VisionMLP(v)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama4VisionEncoder(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Llama4VisionEncoderLayer(v) for _ in range(v.depth))


class Llama4VisionMLP2(nn.Module):
    """The adapter's MLP over pixel-shuffled patches: fc1, gelu, fc2, gelu (both without bias)."""

    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        wide = v.hidden_size * v.spatial_merge_size**2  # = the checkpoint's vision intermediate_size
        self.fc1 = nn.Linear(wide, v.projector_hidden_size, bias=False)
        self.fc2 = nn.Linear(v.projector_hidden_size, v.projector_hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc2(F.gelu(self.fc1(x))))


class Llama4VisionPixelShuffleMLP(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.merge = v.spatial_merge_size
        self.mlp = Llama4VisionMLP2(v)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.mlp(pixel_shuffle(patches, self.merge))


class Llama4VisionModel(nn.Module):
    """The `vision_model` of a Llama 4 checkpoint: tiles [N, C, S, S] -> adapter outputs
    [N, (side / m)^2, projector_hidden_size]."""

    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.v = v
        patches = (v.image_size // v.patch_size) ** 2
        self.patch_embedding = Llama4UnfoldConvolution(v)
        self.class_embedding = nn.Parameter(torch.zeros(v.hidden_size))
        self.positional_embedding_vlm = nn.Parameter(torch.zeros(patches + 1, v.hidden_size))
        self.layernorm_pre = nn.LayerNorm(v.hidden_size)
        self.layernorm_post = nn.LayerNorm(v.hidden_size)
        self.model = Llama4VisionEncoder(v)
        self.vision_adapter = Llama4VisionPixelShuffleMLP(v)

    def forward(self, tiles: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(tiles.to(self.class_embedding.dtype))
        x = torch.cat([x, self.class_embedding.expand(x.shape[0], 1, -1)], dim=1)
        x = self.layernorm_pre(x + self.positional_embedding_vlm)
        cos, sin = rotary_cos_sin(self.v, x.device)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.vision_adapter(self.layernorm_post(x)[:, :-1])


class Llama4MultiModalProjector(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(v.projector_hidden_size, v.out_hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_1(x)


def check_tiles(v: VisionArch, pixel_rows: torch.Tensor, grid_thw: list[Grid]) -> None:
    """Raise ValueError unless the rows are the grids' tiles: each grid a canvas of whole image_size
    tiles, with one more (the whole image) past one tile."""
    side = v.image_size // v.patch_size
    for t, h, w in grid_thw:
        local = (h // side) * (w // side)
        if h % side or w % side or not local or t != (local + 1 if local > 1 else 1):
            raise ValueError(f"Llama 4 grid {(t, h, w)} is not a canvas of {side}-patch tiles")
    tiles = sum(t for t, _, _ in grid_thw)
    if pixel_rows.dim() != 2 or pixel_rows.shape != (tiles, v.in_channels * v.image_size**2):
        raise ValueError(
            f"pixel rows {tuple(pixel_rows.shape)} are not the {tiles} tiles of grids {grid_thw}"
        )
