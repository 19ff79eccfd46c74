"""MXFP4: the OCP microscaling 4-bit float format gpt-oss's experts are published in.

A row of K weights is stored as K/32 blocks; each block is 16 bytes of 32 e2m1 values (two per byte,
the low nibble first) and one shared scale byte, an e8m0 exponent (the weight is value * 2^(scale - 127)):

    blocks [..., K/32, 16] uint8      scales [..., K/32] uint8

e2m1 (sign, 2 exponent bits, 1 mantissa bit) holds 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives. The
checkpoint names the pair <name>_blocks / <name>_scales; the rows are the projection's output rows.
"""

from __future__ import annotations

import torch

# e2m1 code -> value (codes 8..15 are the negatives of 0..7)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks [..., G, 16] uint8 and scales [..., G] uint8 -> weights [..., G * 32] in dtype (exact: every
    e2m1 value times a power of two is representable in bf16, fp16 within its range, and fp32)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks must be [..., G, 16] with scales [..., G]; got {tuple(blocks.shape)} and "
            f"{tuple(scales.shape)}"
        )
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    low, high = lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]
    values = torch.stack([low, high], dim=-1).flatten(-2)  # [..., G, 32]: low nibble first
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2).to(dtype)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., K] (K a multiple of 32) -> (blocks [..., K/32, 16], scales [..., K/32]) uint8: each block's
    scale is the power of two that maps its largest magnitude into e2m1's range (at most 6), values
    rounded to the nearest e2m1 value. For tests and for writing checkpoints in the published layout."""
    if w.shape[-1] % 32:
        raise ValueError(f"MXFP4 rows must be a multiple of 32 long, got {w.shape[-1]}")
    x = w.float().unflatten(-1, (-1, 32))  # [..., G, 32]
    amax = x.abs().amax(dim=-1).clamp(min=2.0**-126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = x / torch.exp2(exp)[..., None]
    lut = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32, device=w.device)
    code = (scaled.abs()[..., None] - lut).abs().argmin(dim=-1)  # nearest magnitude
    code = code + 8 * (scaled < 0).long()
    code = code.to(torch.uint8)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    return blocks, (exp + 127).to(torch.uint8)
