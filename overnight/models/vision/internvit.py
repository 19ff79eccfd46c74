"""InternVL's vision side: the InternViT tower, pixel shuffle and the MLP projector into the language model
(as HF's modeling_internvl.py computes them).

Every tile is image_size x image_size pixels (the processor cuts an image into tiles and adds a
thumbnail: multimodal/internvl_prompt.py), so the tower runs on a plain batch of tiles:

    pixel rows [tiles, C * S * S]  -> [tiles, C, S, S]
      -> embeddings.patch_embeddings.projection (conv of kernel = stride = patch, with bias), the CLS
         token in front, learned position embeddings (bicubic-resized when the tile's patch grid is not
         the checkpoint's)
      -> depth blocks:  x += lambda_1 * projection_layer(attention(layernorm_before(x)))
                        x += lambda_2 * fc2(act(fc1(layernorm_after(x))))
         (full attention within a tile; optional RMSNorm of the whole q and k before the heads split)
      -> the hidden state vision_feature_layer (0: the embeddings, i: after block i; -1 also passes the
         final LayerNorm when the checkpoint has one), CLS dropped
    pixel shuffle: per tile, each m x m block of patches (m = 1 / downsample_ratio) becomes one row of
      m^2 x hidden features, ordered (row in block, column in block, channel)
    projector: layer_norm, linear_1, act, linear_2  -> one embedding per <IMG_CONTEXT> token, tiles in
      order, each tile's tokens row by row.

Checkpoint names (after the wrapper prefixes are taken off, models/internvl.py):
`vision_tower.{embeddings.{cls_token,position_embeddings,patch_embeddings.projection},
encoder.layer.N.{attention.{q,k,v}_proj,attention.{q,k}_norm,attention.projection_layer,layernorm_before,
layernorm_after,mlp.fc1,mlp.fc2,lambda_1,lambda_2},layernorm}` and
`multi_modal_projector.{layer_norm,linear_1,linear_2}`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from overnight.arch import VisionArch
from overnight.models.vision.qwen_vit import VisionMLP, VisionRMSNorm, _act

Grid = tuple[int, int, int]  # (tiles, patches per tile side, patches per tile side)


def _norm(v: VisionArch, dim: int) -> nn.Module:
    if v.norm_type == "rms_norm":
        return VisionRMSNorm(dim, eps=v.layer_norm_eps)
    return nn.LayerNorm(dim, eps=v.layer_norm_eps)


class InternVLVisionPatchEmbeddings(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.projection = nn.Conv2d(v.in_channels, v.hidden_size, v.patch_size, stride=v.patch_size)


class InternVLVisionEmbeddings(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.side = v.image_size // v.patch_size  # the checkpoint's position grid
        self.cls_token = nn.Parameter(torch.zeros(1, 1, v.hidden_size))
        self.patch_embeddings = InternVLVisionPatchEmbeddings(v)
        self.position_embeddings = (
            nn.Parameter(torch.zeros(1, self.side**2 + 1, v.hidden_size)) if v.position_embeddings else None
        )

    def positions(self, rows: int, cols: int) -> torch.Tensor:
        """[1, 1 + rows * cols, hidden]: the table as it is, or its patch part resized bicubically."""
        table = self.position_embeddings
        assert table is not None
        if (rows, cols) == (self.side, self.side):
            return table
        grid = table[:, 1:].reshape(1, self.side, self.side, -1).permute(0, 3, 1, 2)
        grid = F.interpolate(grid, size=(rows, cols), mode="bicubic", align_corners=False)
        return torch.cat([table[:, :1], grid.permute(0, 2, 3, 1).reshape(1, rows * cols, -1)], dim=1)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embeddings.projection(pixels.to(self.cls_token.dtype))  # [N, hidden, rows, cols]
        rows, cols = x.shape[-2:]
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x.flatten(2).transpose(1, 2)], dim=1)
        if self.position_embeddings is not None:
            x = x + self.positions(rows, cols)
        return x


class InternVLVisionAttention(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        h = v.hidden_size
        self.num_heads = v.num_heads
        self.q_proj = nn.Linear(h, h, bias=v.attention_bias)
        self.k_proj = nn.Linear(h, h, bias=v.attention_bias)
        self.v_proj = nn.Linear(h, h, bias=v.attention_bias)
        self.projection_layer = nn.Linear(h, h)
        # HF builds these with RMSNorm's default eps, not the config's layer_norm_eps
        self.q_norm = VisionRMSNorm(h) if v.qk_norm else nn.Identity()
        self.k_norm = VisionRMSNorm(h) if v.qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, length, _ = x.shape
        q, k = self.q_norm(self.q_proj(x)), self.k_norm(self.k_proj(x))
        q, k, val = (t.view(n, length, self.num_heads, -1).transpose(1, 2) for t in (q, k, self.v_proj(x)))
        out = F.scaled_dot_product_attention(q, k, val)
        return self.projection_layer(out.transpose(1, 2).reshape(n, length, -1))


class InternVLVisionLayer(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.layernorm_before = _norm(v, v.hidden_size)
        self.attention = InternVLVisionAttention(v)
        self.lambda_1 = nn.Parameter(torch.ones(v.hidden_size))  # layer scale
        self.layernorm_after = _norm(v, v.hidden_size)
        self.mlp = VisionMLP(v)
        self.lambda_2 = nn.Parameter(torch.ones(v.hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.lambda_1 * self.attention(self.layernorm_before(x))
        return x + self.lambda_2 * self.mlp(self.layernorm_after(x))


class InternVLVisionEncoder(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.layer = nn.ModuleList(InternVLVisionLayer(v) for _ in range(v.depth))


class InternVLVisionModel(nn.Module):
    """The `vision_tower` of an InternVL checkpoint: tiles [N, C, S, S] -> patch features
    [N, patches, hidden] (CLS dropped)."""

    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.embeddings = InternVLVisionEmbeddings(v)
        self.encoder = InternVLVisionEncoder(v)
        self.layernorm = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps) if v.final_norm else None
        # blocks that run: the hidden state read is the embeddings' (0) or block i's (i)
        self.blocks_run = v.vision_feature_layer % (v.depth + 1)
        self.last = v.vision_feature_layer == -1  # HF's last_hidden_state: the final LayerNorm applies

    def forward(self, tiles: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(tiles)
        for layer in self.encoder.layer[: self.blocks_run]:
            x = layer(x)
        if self.last and self.layernorm is not None:
            x = self.layernorm(x)
        return x[:, 1:]


def pixel_shuffle(features: torch.Tensor, m: int) -> torch.Tensor:
    """[N, side * side, d] -> [N, (side / m)^2, m * m * d]: out[i, j] holds patches (m*i + r, m*j + c)
    for r, then c, in 0..m-1 (HF's pixel_shuffle order)."""
    n, length, d = features.shape
    side = int(round(length**0.5))
    x = features.view(n, side // m, m, side // m, m, d).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(n, (side // m) ** 2, m * m * d)


class InternVLMultiModalProjector(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        wide = v.hidden_size * v.spatial_merge_size**2
        self.layer_norm = nn.LayerNorm(wide)  # (torch's default eps, as HF builds it)
        self.linear_1 = nn.Linear(wide, v.out_hidden_size)
        self.act = _act(v.projector_hidden_act)
        self.linear_2 = nn.Linear(v.out_hidden_size, v.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(self.layer_norm(x))))


def check_tiles(v: VisionArch, pixel_rows: torch.Tensor, grid_thw: list[Grid]) -> None:
    """Raise ValueError unless the rows are the grids' tiles, each one square tile of whole merge blocks."""
    m = v.spatial_merge_size
    tiles = sum(t for t, _, _ in grid_thw)
    if pixel_rows.dim() != 2 or pixel_rows.shape[0] != tiles:
        raise ValueError(
            f"pixel rows {tuple(pixel_rows.shape)} are not the {tiles} tiles of grids {grid_thw}"
        )
    if any(h != w for _, h, w in grid_thw) or len({h for _, h, _ in grid_thw}) != 1:
        raise ValueError(f"InternVL grids are (tiles, side, side) of one tile size, got {grid_thw}")
    side = grid_thw[0][1]
    if side % m or pixel_rows.shape[1] != v.in_channels * (side * v.patch_size) ** 2:
        raise ValueError(f"pixel rows of width {pixel_rows.shape[1]} are not {side}x{side}-patch tiles")
