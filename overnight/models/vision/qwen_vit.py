"""The vision towers of Qwen2-VL, Qwen2.5-VL and Qwen3-VL: a ViT over 14x14 (16x16) patches of 2 frames,
with 2-D RoPE inside attention, whose output merges each 2x2 block of patches into one token of the
language model's width. GLM-4.1V's tower (vision/glm4v_vit.py) is built from the same blocks.

Patches arrive in "merge-block order" (the image processor's layout): the merge x merge patches of one
output token are consecutive, so merging is a reshape.

    pixel_values [num_patches, C * temporal_patch * patch * patch]  ->  embeds [num_patches / merge**2, out]

Several images may go through one call: attention never crosses an image (cu_seqlens), and Qwen2.5-VL's
window blocks never cross a window. Attribute names follow the checkpoint keys (visual.*).

Qwen2-VL's tower is Qwen2.5-VL's without windows (every block attends over its whole image), with
LayerNorms (and biases) where 2.5 has RMSNorms: in the blocks and the merger's ln_q, and the plain
fc1 / quick_gelu / fc2 MLP instead of the gated one.

A tower takes (pixel_values, grid_thw) and returns VisionFeatures (models/vision/interface.py); other
families' towers plug in through build_vision_tower by returning the same.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from overnight.arch import VisionArch
from overnight.kernels.dispatch import use_kernels
from overnight.layers.activation import SiluAndMul
from overnight.layers.norm import rms_norm_ref
from overnight.models.vision.interface import VisionFeatures
from overnight.models.vision.segments import Segments, segment_attention, to_device


class QuickGELU(nn.Module):
    """x * sigmoid(1.702 x): CLIP's GELU approximation (Qwen2-VL's tower MLP, HF's "quick_gelu")."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


def _act(name: str) -> nn.Module:
    if name == "quick_gelu":
        return QuickGELU()
    if name == "silu":
        return nn.SiLU()
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return nn.GELU(approximate="tanh")
    if name == "gelu":
        return nn.GELU()
    raise ValueError(f"unsupported vision hidden_act {name!r}")


class VisionRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The decoder's RMSNorm arithmetic (layers/norm.py): one kernel instead of torch's six passes in
        # fp32, 2 of a block's ~20 elementwise passes over every patch.
        if use_kernels(x):
            from overnight.kernels.rmsnorm import rms_norm  # triton loads on first use

            return rms_norm(x, self.weight, self.eps)
        return rms_norm_ref(x, self.weight, self.eps)


class PatchEmbed(nn.Module):
    def __init__(self, v: VisionArch, bias: bool) -> None:
        super().__init__()
        self.hidden = v.hidden_size
        kernel = (v.temporal_patch_size, v.patch_size, v.patch_size)
        self.proj = nn.Conv3d(v.in_channels, v.hidden_size, kernel_size=kernel, stride=kernel, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The kernel covers the whole patch at stride = kernel, so the convolution is one GEMM of the
        # flattened patches: cuDNN ran it as a generic implicit-GEMM convolution, ~7.5 ms for a caption
        # step's 59,392 patches on an H100 (session U), the GEMM a fraction of that.
        weight = self.proj.weight.view(self.hidden, -1)
        return F.linear(x.view(-1, weight.shape[1]).to(weight.dtype), weight, self.proj.bias)


def rotary_angles(v: VisionArch, grid_thw: list[tuple[int, int, int]], device: torch.device) -> torch.Tensor:
    """[patches, head_dim / 2] angles of the axial 2-D RoPE: the first half of each head's frequencies
    turns with the patch's row, the second with its column (patches in merge-block order)."""
    head_dim = v.hidden_size // v.num_heads
    quarter = head_dim // 2
    inv_freq = 1.0 / (
        v.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float, device=device) / quarter)
    )
    r_all, c_all = (pos.float() for pos in patch_rows_cols(v, grid_thw, device))
    return torch.cat([r_all[:, None] * inv_freq, c_all[:, None] * inv_freq], dim=-1)


def patch_rows_cols(
    v: VisionArch, grid_thw: list[tuple[int, int, int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """([patches] row, [patches] column) of each patch in its image's grid, patches in merge-block order
    (every frame of an image repeats its grid)."""
    m = v.spatial_merge_size

    def one(t: int, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        r = torch.arange(h, device=device)[:, None].expand(h, w)
        c = torch.arange(w, device=device)[None, :].expand(h, w)
        r, c = (pos.reshape(h // m, m, w // m, m).transpose(1, 2).flatten().repeat(t) for pos in (r, c))
        return r, c

    return per_grid(grid_thw, one)


def per_grid(
    grid_thw: list[tuple[int, int, int]],
    build: Callable[[int, int, int], tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """build(t, h, w)'s two tensors for each image, concatenated in image order; built once per distinct
    grid (a step's images are mostly one size, and each build is several small kernels)."""
    built = {g: build(*g) for g in dict.fromkeys(grid_thw)}
    return torch.cat([built[g][0] for g in grid_thw]), torch.cat([built[g][1] for g in grid_thw])


@dataclass(frozen=True)
class PatchRope:
    """The patches' 2-D RoPE, built once per tower call: cos_sin [patches, head_dim] fp32, row p
    [cos(angles_p) | sin(angles_p)] (the rotary kernel's table, one row a patch), and positions =
    arange(patches) into it."""

    cos_sin: torch.Tensor
    positions: torch.Tensor

    @staticmethod
    def of(angles: torch.Tensor) -> PatchRope:
        positions = torch.arange(angles.shape[0], device=angles.device)
        return PatchRope(torch.cat([angles.cos(), angles.sin()], dim=-1), positions)


def rotate_qk(q: torch.Tensor, k: torch.Tensor, rope: PatchRope) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [patches, heads, head_dim] rotated as the reference does it: in fp32, rotate-half over the
    whole head, the result rounded to their dtype. On the GPU in place, in one kernel (torch's version
    is ~10 elementwise passes over q and k in fp32)."""
    if use_kernels(q):
        from overnight.kernels.rotary import rotary_inplace  # triton loads on first use

        rotary_inplace(rope.positions, q, k, rope.cos_sin, wide=True)
        return q, k
    cos, sin = (half.repeat(1, 2)[:, None, :] for half in rope.cos_sin.chunk(2, dim=-1))
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x.float() * cos + rotated * sin).to(x.dtype)


class VisionAttention(nn.Module):
    """qkv_bias / proj_bias: the Qwen towers have both; GLM-4.1V's has vision_config.attention_bias on
    qkv and none on proj."""

    def __init__(self, v: VisionArch, qkv_bias: bool = True, proj_bias: bool = True) -> None:
        super().__init__()
        self.num_heads = v.num_heads
        self.head_dim = v.hidden_size // v.num_heads
        self.qkv = nn.Linear(v.hidden_size, 3 * v.hidden_size, bias=qkv_bias)
        self.proj = nn.Linear(v.hidden_size, v.hidden_size, bias=proj_bias)

    def forward(self, x: torch.Tensor, segments: Segments, rope: PatchRope) -> torch.Tensor:
        n = x.shape[0]
        q, k, val = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = rotate_qk(q, k, rope)
        # Bidirectional attention inside each segment (an image, or a window of one).
        return self.proj(segment_attention(q, k, val, segments).reshape(n, -1))


# The tower MLPs' width is padded to a multiple of this after loading (SwiGLU.after_load_). A GEMM
# whose inner or output dimension is not a multiple of 8 bf16 elements (16 bytes) misses the aligned
# Hopper kernels: cuBLAS falls back to sm80 ones. Qwen2.5-VL's 3420-wide MLP took two thirds of its
# caption run's GEMM time that way; on an H100 at 65,536 patches its down projection ran 2,838 us at
# width 3420 and 861 us at 3424 (session U, docs/performance.md).
WIDTH_MULTIPLE = 32


class SwiGLU(nn.Module):
    """Qwen2.5-VL's block MLP (with biases); GLM-4.1V's block MLP (no biases, out_hidden_size wide) and
    its merger's (dim out_hidden_size, width intermediate_size).

    Loaded as the checkpoint names it (gate_proj, up_proj, down_proj); after_load_ then fuses gate and
    up into one projection (gate_up: x read once, one GEMM) and pads the width with zeros to
    WIDTH_MULTIPLE. Exact: a zero gate row and up row give act(0) * 0 = 0 (act(0) is finite), and a zero
    down column adds nothing."""

    def __init__(self, v: VisionArch, dim: int = 0, width: int = 0, bias: bool = True) -> None:
        super().__init__()
        dim, width = dim or v.hidden_size, width or v.intermediate_size
        self.gate_proj = nn.Linear(dim, width, bias=bias)
        self.up_proj = nn.Linear(dim, width, bias=bias)
        self.down_proj = nn.Linear(width, dim, bias=bias)
        self.act_fn = _act(v.hidden_act)
        self.gate_up: nn.Linear | None = None  # after_load_

    def after_load_(self) -> None:
        if self.gate_up is not None:
            return
        gate, up, down = self.gate_proj, self.up_proj, self.down_proj
        width = gate.out_features
        pad = -width % WIDTH_MULTIPLE

        def rows(t: torch.Tensor) -> torch.Tensor:  # [width, ...] -> [width + pad, ...], zeros below
            return torch.cat([t, t.new_zeros(pad, *t.shape[1:])])

        fused = nn.Linear(gate.in_features, 2 * (width + pad), bias=gate.bias is not None, device="meta")
        fused.weight = nn.Parameter(torch.cat([rows(gate.weight), rows(up.weight)]), requires_grad=False)
        if gate.bias is not None and up.bias is not None:
            fused.bias = nn.Parameter(torch.cat([rows(gate.bias), rows(up.bias)]), requires_grad=False)
        padded_down = nn.Parameter(rows(down.weight.t()).t().contiguous(), requires_grad=False)
        down.weight, down.in_features = padded_down, width + pad
        self.gate_up = fused
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:  # as built (before after_load_)
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        gate_up = self.gate_up(x)
        if isinstance(self.act_fn, nn.SiLU):
            return self.down_proj(cast(torch.Tensor, _SILU_AND_MUL(gate_up)))
        g, u = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act_fn(g) * u)


_SILU_AND_MUL = SiluAndMul()  # a tower's own (no quantization pass sees it): its kernel on the GPU


class VisionMLP(nn.Module):
    """fc1, the tower's hidden_act, fc2 (both with bias): the block MLP of SigLIP (gelu_pytorch_tanh),
    InternViT and Llama 4's ViT (exact gelu) and Qwen2-VL's tower (quick_gelu), whose checkpoints name
    them fc1 / fc2."""

    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.fc1 = nn.Linear(v.hidden_size, v.intermediate_size)
        self.fc2 = nn.Linear(v.intermediate_size, v.hidden_size)
        self.act = _act(v.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class FcMLP(nn.Module):  # Qwen3-VL's block MLP
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(v.hidden_size, v.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(v.intermediate_size, v.hidden_size, bias=True)
        self.act_fn = _act(v.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


def _norm(v: VisionArch) -> nn.Module:
    """The blocks' and the merger's norm: RMSNorm in Qwen2.5-VL's and GLM-4.1V's towers (GLM's at its
    rms_norm_eps), LayerNorm in the others."""
    if v.kind == "glm4v":
        return VisionRMSNorm(v.hidden_size, v.layer_norm_eps)
    return VisionRMSNorm(v.hidden_size) if v.kind == "qwen2_5_vl" else nn.LayerNorm(v.hidden_size, eps=1e-6)


def _block_mlp(v: VisionArch) -> nn.Module:
    if v.kind == "qwen3_vl":
        return FcMLP(v)
    if v.kind == "qwen2_vl":
        return VisionMLP(v)
    if v.kind == "glm4v":  # a bias-free SwiGLU as wide as the tower's output
        return SwiGLU(v, width=v.out_hidden_size, bias=False)
    return SwiGLU(v)


class VisionBlock(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.norm1 = _norm(v)
        self.norm2 = _norm(v)
        # GLM-4.1V: a bias on qkv only (attention_bias), none on the output projection
        glm = v.kind == "glm4v"
        self.attn = (
            VisionAttention(v, qkv_bias=v.attention_bias, proj_bias=False) if glm else VisionAttention(v)
        )
        self.mlp = _block_mlp(v)

    def forward(self, x: torch.Tensor, segments: Segments, rope: PatchRope) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), segments, rope)
        return x + self.mlp(self.norm2(x))


class Qwen25PatchMerger(nn.Module):
    """Qwen2-VL's and Qwen2.5-VL's merger: ln_q over each patch, then an MLP over each merged group."""

    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.width = v.hidden_size * v.spatial_merge_size**2
        self.ln_q = _norm(v)
        self.mlp = nn.Sequential(
            nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, v.out_hidden_size)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class Qwen3PatchMerger(nn.Module):
    """postshuffle: the LayerNorm runs over the merged (4x wider) rows (the deepstack mergers)."""

    def __init__(self, v: VisionArch, postshuffle: bool) -> None:
        super().__init__()
        self.width = v.hidden_size * v.spatial_merge_size**2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.width if postshuffle else v.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.act_fn = nn.GELU()
        self.linear_fc2 = nn.Linear(self.width, v.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.width)) if self.postshuffle else self.norm(x).view(-1, self.width)
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


def cu_seqlens_of(sizes: list[int]) -> list[int]:
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return out


def window_order(v: VisionArch, grid_thw: list[tuple[int, int, int]]) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's windows: (the order of merged tokens that makes each window contiguous, the
    cumulative patch counts of the windows). A window is window_size / merge / patch merged tokens on a
    side; the image's last row and column of windows may be partial."""
    m = v.spatial_merge_size
    side = v.window_size // m // v.patch_size
    per_grid: dict[tuple[int, int, int], tuple[torch.Tensor, list[int]]] = {}
    for t, h, w in dict.fromkeys(grid_thw):  # once per distinct grid
        gh, gw = h // m, w // m
        idx = torch.arange(t * gh * gw).view(t, gh, gw)
        wins = [
            idx[f, r0 : r0 + side, c0 : c0 + side].flatten()
            for f in range(t)
            for r0 in range(0, gh, side)
            for c0 in range(0, gw, side)
        ]
        per_grid[(t, h, w)] = (torch.cat(wins), [win.numel() * m * m for win in wins])
    order: list[torch.Tensor] = []
    sizes: list[int] = []
    base = 0
    for t, h, w in grid_thw:
        local, local_sizes = per_grid[(t, h, w)]
        order.append(local + base)
        sizes += local_sizes
        base += t * (h // m) * (w // m)
    return torch.cat(order), cu_seqlens_of(sizes)


class Qwen25VisionTransformer(nn.Module):
    """Qwen2.5-VL's tower, and Qwen2-VL's (window_size 0: no windows, every block sees whole images)."""

    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.v = v
        self.patch_embed = PatchEmbed(v, bias=False)
        self.blocks = nn.ModuleList(VisionBlock(v) for _ in range(v.depth))
        self.merger = Qwen25PatchMerger(v)

    def forward(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> VisionFeatures:
        v = self.v
        unit = v.spatial_merge_size**2
        x = self.patch_embed(pixel_values)
        n = x.shape[0]
        angles = rotary_angles(v, grid_thw, x.device)
        cu_images = cu_seqlens_of([h * w for t, h, w in grid_thw for _ in range(t)])  # per frame
        order: torch.Tensor | None = None
        cu_window = cu_images
        if v.window_size:
            order, cu_window = window_order(v, grid_thw)
            order = to_device(order, x.device)
            # Blocks run with merged tokens grouped by window; full-attention blocks see whole images,
            # which the reordering keeps contiguous (windows never cross images).
            x = x.view(n // unit, unit, -1)[order].view(n, -1)
            angles = angles.view(n // unit, unit, -1)[order].view(n, -1)
        rope = PatchRope.of(angles)
        images = Segments.of(cu_images, x.device)
        windows = Segments.of(cu_window, x.device) if v.window_size else images
        for i, block in enumerate(self.blocks):
            x = block(x, images if i in v.fullatt_block_indexes else windows, rope)
        merged = self.merger(x)
        if order is not None:
            merged = merged[torch.argsort(order)]
        return VisionFeatures(embeds=merged, deepstack=[])


def interpolation_taps(
    v: VisionArch, grid_thw: list[tuple[int, int, int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-VL's learned position table (side x side) resampled bilinearly (corners aligned) to each
    image's patch grid: (indices [patches, 4] into the table, weights [patches, 4]), merge-block order."""
    side = int(v.num_position_embeddings**0.5)
    m = v.spatial_merge_size

    def axis(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        src = torch.arange(n, dtype=torch.float32, device=device) * (side - 1) / max(n - 1, 1)
        lo = src.floor()
        taps = torch.stack([lo, lo + 1], dim=-1).long().clamp(0, side - 1)
        frac = src - lo
        return taps, torch.stack([1 - frac, frac], dim=-1)

    def one(t: int, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        (ht, hw), (wt, ww) = axis(h), axis(w)
        idx = (ht[:, None, :, None] * side + wt[None, :, None, :]).reshape(h, w, 4)
        wgt = (hw[:, None, :, None] * ww[None, :, None, :]).reshape(h, w, 4)
        idx, wgt = (
            table.view(h // m, m, w // m, m, 4).transpose(1, 2).reshape(-1, 4).repeat(t, 1)
            for table in (idx, wgt)
        )
        return idx, wgt

    return per_grid(grid_thw, one)


class Qwen3VisionModel(nn.Module):
    def __init__(self, v: VisionArch) -> None:
        super().__init__()
        self.v = v
        self.patch_embed = PatchEmbed(v, bias=True)
        self.pos_embed = nn.Embedding(v.num_position_embeddings, v.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(v) for _ in range(v.depth))
        self.merger = Qwen3PatchMerger(v, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3PatchMerger(v, postshuffle=True) for _ in v.deepstack_visual_indexes
        )

    def forward(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> VisionFeatures:
        v = self.v
        x = self.patch_embed(pixel_values)
        idx, wgt = interpolation_taps(v, grid_thw, x.device)
        x = x + (self.pos_embed(idx) * wgt[:, :, None].to(x.dtype)).sum(1)
        rope = PatchRope.of(rotary_angles(v, grid_thw, x.device))
        frames = Segments.of(cu_seqlens_of([h * w for t, h, w in grid_thw for _ in range(t)]), x.device)
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, frames, rope)
            if i in v.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[v.deepstack_visual_indexes.index(i)](x))
        return VisionFeatures(embeds=self.merger(x), deepstack=deepstack)


def tower_features(
    tower: nn.Module, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]
) -> VisionFeatures:
    """A built tower over one or more images (their patches concatenated), the pixels in the tower's
    dtype: the image tokens' embeddings (ImageModel.embed_images of the models that use these towers)."""
    dtype = next(tower.parameters()).dtype
    return cast(VisionFeatures, tower(pixel_values.to(dtype), grid_thw))


def build_vision_tower(v: VisionArch) -> nn.Module:
    if v.kind in ("qwen2_vl", "qwen2_5_vl"):
        return Qwen25VisionTransformer(v)
    if v.kind == "qwen3_vl":
        return Qwen3VisionModel(v)
    raise ValueError(f"unsupported vision tower {v.kind!r}")
