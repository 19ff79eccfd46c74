"""Mistral 3's vision side: Pixtral's tower, the patch merger and the projector into the language model
(as HF's modeling_pixtral.py and modeling_mistral3.py compute them).

Images keep their own size (the processor resizes them to multiples of patch x merge, the longest edge
at most image_size), so a call's images have different patch grids:

    pixel rows [patches of every image, C * patch * patch]  (each image's patches row by row)
      -> patch_conv (a conv of kernel = stride = patch, no bias), ln_pre (RMSNorm)
      -> depth pre-norm blocks:  x += o_proj(attention(attention_norm(x)))   (2-D RoPE, within one image)
                                 x += down(act(gate(ffn_norm(x))) * up(ffn_norm(x)))
      -> the hidden state vision_feature_layer (0 is ln_pre's output, -1 the last block's)
    projector: RMSNorm, then per image each merge x merge block of patches (a row of blocks at a time)
      becomes one row of merge^2 x hidden features (channel-major within the block, as torch's unfold
      orders them), merging_layer, linear_1, act, linear_2  -> one embedding per [IMG] token.

2-D RoPE: of each head's head_dim / 2 frequencies, the even-numbered ones turn with the patch's row and
the odd-numbered ones with its column; attention never crosses an image (HF's block-diagonal mask).

Checkpoint names (after the wrapper prefixes are taken off, models/mistral3_vl.py):
`vision_tower.{patch_conv,ln_pre,transformer.layers.N.{attention_norm,attention.*_proj,ffn_norm,
feed_forward.*_proj}}` and `multi_modal_projector.{norm,patch_merger.merging_layer,linear_1,linear_2}`.
"""

from __future__ import annotations

import torch
from torch import nn

from overnight.arch import VisionArch
from overnight.models.vision.qwen_vit import VisionRMSNorm, _act, cu_seqlens_of
from overnight.models.vision.segments import Segments, segment_attention

Grid = tuple[int, int, int]  # (1, patch rows, patch columns)
_EPS = 1e-5  # Pixtral's RMSNorms


def rotary_cos_sin(v: VisionArch, grid_thw: list[Grid], device: torch.device) -> tuple[torch.Tensor, ...]:
    """cos, sin [patches, 1, head_dim] of Pixtral's axial RoPE for the images' patches (row by row)."""
    head_dim = v.hidden_size // v.num_heads
    inv_freq = 1.0 / (
        v.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=device) / head_dim)
    )
    rows, cols = [], []
    for _, h, w in grid_thw:
        rows.append(torch.arange(h, device=device).repeat_interleave(w))
        cols.append(torch.arange(w, device=device).repeat(h))
    r, c = torch.cat(rows).float(), torch.cat(cols).float()
    half = torch.cat([r[:, None] * inv_freq[0::2], c[:, None] * inv_freq[1::2]], dim=-1)
    emb = torch.cat([half, half], dim=-1)[:, None, :]
    return emb.cos(), emb.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat((-x2, x1), dim=-1) * sin.to(x.dtype)


class PixtralAttention(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        h = v.hidden_size
        self.num_heads = v.num_heads
        self.q_proj = nn.Linear(h, h, bias=False)
        self.k_proj = nn.Linear(h, h, bias=False)
        self.v_proj = nn.Linear(h, h, bias=False)
        self.o_proj = nn.Linear(h, h, bias=False)

    def forward(
        self, x: torch.Tensor, images: Segments, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, val = (p(x).view(n, self.num_heads, -1) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        return self.o_proj(segment_attention(q, k, val, images).reshape(n, -1))


class PixtralMLP(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(v.hidden_size, v.intermediate_size, bias=False)
        self.up_proj = nn.Linear(v.hidden_size, v.intermediate_size, bias=False)
        self.down_proj = nn.Linear(v.intermediate_size, v.hidden_size, bias=False)
        self.act_fn = _act(v.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class PixtralAttentionLayer(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.attention_norm = VisionRMSNorm(v.hidden_size, eps=_EPS)
        self.attention = PixtralAttention(v)
        self.ffn_norm = VisionRMSNorm(v.hidden_size, eps=_EPS)
        self.feed_forward = PixtralMLP(v)

    def forward(
        self, x: torch.Tensor, images: Segments, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), images, cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class PixtralTransformer(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.layers = nn.ModuleList(PixtralAttentionLayer(v) for _ in range(v.depth))


class PixtralVisionModel(nn.Module):
    """The `vision_tower` of a Mistral 3 checkpoint: pixel rows -> the projector's input features
    [patches, hidden]."""

    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.v = v
        self.patch_conv = nn.Conv2d(
            v.in_channels, v.hidden_size, v.patch_size, stride=v.patch_size, bias=False
        )
        self.ln_pre = VisionRMSNorm(v.hidden_size, eps=_EPS)
        self.transformer = PixtralTransformer(v)
        # blocks that run: the hidden state read is ln_pre's output (0) or block i's (i)
        self.blocks_run = v.vision_feature_layer % (v.depth + 1)

    def forward(self, pixel_rows: torch.Tensor, grid_thw: list[Grid]) -> torch.Tensor:
        v = self.v
        x = pixel_rows.view(-1, v.in_channels, v.patch_size, v.patch_size).to(self.patch_conv.weight.dtype)
        x = self.ln_pre(self.patch_conv(x).flatten(1))
        images = Segments.of(cu_seqlens_of([h * w for _, h, w in grid_thw]), x.device)
        cos, sin = rotary_cos_sin(v, grid_thw, x.device)
        for layer in self.transformer.layers[: self.blocks_run]:
            x = layer(x, images, cos, sin)
        return x


class Mistral3PatchMerger(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.merge = v.spatial_merge_size
        self.merging_layer = nn.Linear(v.hidden_size * self.merge**2, v.hidden_size, bias=False)

    def forward(self, features: torch.Tensor, grid_thw: list[Grid]) -> torch.Tensor:
        """[patches, d] -> [merged tokens, d]: per image, each merge x merge block's patches (a row of
        blocks after another) as one row of (channel, row in block, column in block) features."""
        m, d = self.merge, features.shape[-1]
        blocks = []
        for x, (_, h, w) in zip(features.split([h * w for _, h, w in grid_thw]), grid_thw):
            grid = x.view(h // m, m, w // m, m, d).permute(0, 2, 4, 1, 3)
            blocks.append(grid.reshape(-1, d * m * m))
        return self.merging_layer(torch.cat(blocks))


class Mistral3MultiModalProjector(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.norm = VisionRMSNorm(v.hidden_size, eps=v.layer_norm_eps)
        self.patch_merger = Mistral3PatchMerger(v)
        self.linear_1 = nn.Linear(v.hidden_size, v.out_hidden_size, bias=v.projector_bias)
        self.act = _act(v.projector_hidden_act)
        self.linear_2 = nn.Linear(v.out_hidden_size, v.out_hidden_size, bias=v.projector_bias)

    def forward(self, features: torch.Tensor, grid_thw: list[Grid]) -> torch.Tensor:
        x = self.patch_merger(self.norm(features), grid_thw)
        return self.linear_2(self.act(self.linear_1(x)))


def check_grids(v: VisionArch, pixel_rows: torch.Tensor, grid_thw: list[Grid]) -> None:
    """Raise ValueError unless the rows are the grids' patches and every grid is whole merge blocks."""
    m = v.spatial_merge_size
    width = v.in_channels * v.patch_size**2
    if pixel_rows.dim() != 2 or pixel_rows.shape[1] != width:
        raise ValueError(f"pixel rows {tuple(pixel_rows.shape)} are not [patches, {width}]")
    if sum(h * w for _, h, w in grid_thw) != pixel_rows.shape[0]:
        raise ValueError(f"{pixel_rows.shape[0]} patch rows for grids {grid_thw}")
    if any(t != 1 or h % m or w % m for t, h, w in grid_thw):
        raise ValueError(f"Pixtral grids are (1, rows, columns) of whole {m}x{m} blocks, got {grid_thw}")
