"""GLM-4.1V's vision tower (GLM-4.5V / 4.6V share it): Qwen2-VL's 3-D conv patch embed over
temporal_patch_size frames, an RMSNorm after it, a learned position table resampled to each image's
patch grid, RMSNorm'd blocks with the axial 2-D RoPE of the Qwen towers (vision/qwen_vit.py's blocks),
then a strided conv that merges each merge x merge block of patches into one token and a SwiGLU
projector (the "merger") into the language model's width.

    pixel_values [patches, C * T * p * p]
      -> patch_embed, post_conv_layernorm            [patches, hidden]
      -> + position table at each patch's grid point  (bicubic, below)
      -> blocks (attention within each frame)        [patches, hidden]
      -> post_layernorm, downsample (m x m conv)     [patches / m^2, out_hidden]
      -> merger                                      [patches / m^2, out_hidden]

Patches arrive in merge-block order (the image processor's layout), so the m x m patches the conv
merges are consecutive rows. The position table is side x side (side = image_size / patch_size) and
is sampled, as transformers' Glm4vVisionEmbeddings does, with grid_sample's bicubic mode at the centre
of each patch of an h x w grid (x = (col + 0.5) / w, y = (row + 0.5) / h on [0, 1], corners not
aligned, border padding), in float32, then cast to the table's dtype. Attribute names follow the
checkpoint keys (visual.*).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from overnight.arch import VisionArch
from overnight.models.vision.interface import VisionFeatures
from overnight.models.vision.qwen_vit import (
    PatchEmbed,
    PatchRope,
    VisionBlock,
    VisionRMSNorm,
    _act,
    cu_seqlens_of,
    patch_rows_cols,
    rotary_angles,
)
from overnight.models.vision.segments import Segments


class Glm4vVisionEmbeddings(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.side = v.image_size // v.patch_size
        self.position_embedding = nn.Embedding(self.side**2, v.hidden_size)

    def forward(
        self, x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, sizes: torch.Tensor
    ) -> torch.Tensor:
        """x [patches, hidden]; rows / cols: each patch's grid point; sizes [patches, 2]: its image's
        patch grid (h, w)."""
        table = self.position_embedding.weight
        grid2d = table.float().view(self.side, self.side, -1).permute(2, 0, 1)[None]  # [1, C, side, side]
        sizes = sizes.float()
        y = (rows.float() + 0.5) / sizes[:, 0] * 2 - 1
        xs = (cols.float() + 0.5) / sizes[:, 1] * 2 - 1
        grid = torch.stack((xs, y), dim=-1)[None, :, None, :]  # [1, patches, 1, 2] (x, y)
        pos = F.grid_sample(grid2d, grid, mode="bicubic", align_corners=False, padding_mode="border")
        return x + pos[0, :, :, 0].t().to(table.dtype)


class Glm4vPatchMerger(nn.Module):
    """proj, LayerNorm, exact GELU, then a SwiGLU of intermediate_size (hidden_act), all without biases
    but the norm's."""

    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        dim, width = v.out_hidden_size, v.intermediate_size
        self.proj = nn.Linear(dim, dim, bias=False)
        self.post_projection_norm = nn.LayerNorm(dim)
        self.act1 = nn.GELU()
        self.gate_proj = nn.Linear(dim, width, bias=False)
        self.up_proj = nn.Linear(dim, width, bias=False)
        self.down_proj = nn.Linear(width, dim, bias=False)
        self.act_fn = _act(v.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act1(self.post_projection_norm(self.proj(x)))
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Glm4vVisionModel(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.v = v
        m = v.spatial_merge_size
        self.embeddings = Glm4vVisionEmbeddings(v)
        self.patch_embed = PatchEmbed(v, bias=True)
        self.blocks = nn.ModuleList(VisionBlock(v) for _ in range(v.depth))
        self.merger = Glm4vPatchMerger(v)
        self.post_conv_layernorm = VisionRMSNorm(v.hidden_size, v.layer_norm_eps)
        self.downsample = nn.Conv2d(v.hidden_size, v.out_hidden_size, kernel_size=m, stride=m)
        self.post_layernorm = VisionRMSNorm(v.hidden_size, v.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> VisionFeatures:
        v = self.v
        m = v.spatial_merge_size
        x = self.post_conv_layernorm(self.patch_embed(pixel_values))
        rows, cols = patch_rows_cols(v, grid_thw, x.device)
        frames = [(h, w) for t, h, w in grid_thw for _ in range(t)]
        per_frame = torch.tensor([h * w for h, w in frames], device=x.device)
        sizes = torch.tensor(frames, device=x.device).repeat_interleave(per_frame, dim=0)
        x = self.embeddings(x, rows, cols, sizes)
        rope = PatchRope.of(rotary_angles(v, grid_thw, x.device))
        per_frame_segments = Segments.of(cu_seqlens_of([h * w for h, w in frames]), x.device)
        for block in self.blocks:  # attention per frame
            x = block(x, per_frame_segments, rope)
        x = self.post_layernorm(x).view(-1, m, m, v.hidden_size).permute(0, 3, 1, 2)
        x = self.downsample(x).view(-1, v.out_hidden_size)
        return VisionFeatures(embeds=self.merger(x), deepstack=[])
