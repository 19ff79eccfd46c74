"""Multimodal RoPE (M-RoPE) of the Qwen vision-language models: each token has three positions
(temporal, height, width), and the rotary frequencies of a head are split between the three axes.

    positions [3, T]:  text tokens  t = h = w = their 1-D position
                       image tokens t = start, h = start + row, w = start + column (grid of merged patches)

The head's D/2 frequencies take their angle from one axis each. Qwen2.5-VL's layout is sectioned
(mrope_section [s_t, s_h, s_w]: the first s_t frequencies from t, the next s_h from h, the rest from w);
Qwen3-VL's is interleaved (frequency j from h when j % 3 == 1 and j < 3 s_h, from w when j % 3 == 2
and j < 3 s_w, else from t). GLM-4.1V rotates only the first rotary_dim dims of a head (GLM-4's partial
RoPE), its R = rotary_dim / 2 frequencies sectioned, and in GLM-4's pairs (2i, 2i + 1) rather than
rotate-half's (i, i + R): `pair_interleaved` (layers/rotary.py draws both layouts).

A token whose three positions are equal rotates exactly as plain RoPE does, so 1-D positions [T] (decode
steps, text-only prompts: the runner passes position + the request's rope delta) go through the ordinary
RotaryEmbedding and its fused kernel; decode CUDA graphs see only that path.
"""

from __future__ import annotations

import torch
from torch import nn

from overnight.layers.norm import RMSNorm
from overnight.layers.rotary import RotaryEmbedding, rotate


class MRotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        mrope_section: tuple[int, int, int],
        interleaved: bool = False,
        *,
        rotary_dim: int | None = None,
        pair_interleaved: bool = False,
    ) -> None:
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        # Interleaved sections need not fill the head: Qwen3.5's layout takes h / w only for j < 3 s_h /
        # 3 s_w and t everywhere else (as transformers' recomposition does), so any three sizes are valid.
        if not interleaved and sum(mrope_section) != rotary_dim // 2:
            raise ValueError(
                f"mrope_section {list(mrope_section)} must sum to rotary_dim / 2 = {rotary_dim // 2}"
            )
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.pair_interleaved = pair_interleaved
        self.theta = theta
        self.mrope_section = mrope_section
        self.interleaved = interleaved
        self.rotary = RotaryEmbedding(
            head_dim, max_position, theta, rotary_dim=rotary_dim, interleaved=pair_interleaved
        )

    def axis_of_frequency(self, device: torch.device) -> torch.Tensor:
        """[R] int64: which of the three positions (0 t, 1 h, 2 w) drives each frequency."""
        half = self.rotary_dim // 2
        s_t, s_h, s_w = self.mrope_section
        if not self.interleaved:
            return torch.cat(
                [
                    torch.full((s,), axis, dtype=torch.int64, device=device)
                    for axis, s in enumerate((s_t, s_h, s_w))
                ]
            )
        axis = torch.zeros(half, dtype=torch.int64, device=device)
        j = torch.arange(half, device=device)
        axis[(j % 3 == 1) & (j < 3 * s_h)] = 1
        axis[(j % 3 == 2) & (j < 3 * s_w)] = 2
        return axis

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] (all three axes equal) or [3, T]; q [T, H, D], k [T, Hkv, D]."""
        if positions.dim() == 1:
            return self.rotary(positions, q, k, q_norm=q_norm, k_norm=k_norm)
        if q_norm is not None and k_norm is not None:
            q, k = q_norm(q), k_norm(k)
        device = positions.device
        dim = self.rotary_dim
        inv_freq = 1.0 / (
            self.theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim)
        )
        freqs = positions.float()[:, :, None] * inv_freq  # [3, T, R]
        axis = self.axis_of_frequency(device)
        angle = freqs.gather(0, axis.view(1, 1, -1).expand(1, freqs.shape[1], -1))[0]  # [T, R]
        cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
        return (
            rotate(q, cos.to(q.dtype), sin.to(q.dtype), self.pair_interleaved),
            rotate(k, cos.to(k.dtype), sin.to(k.dtype), self.pair_interleaved),
        )

    def extra_repr(self) -> str:
        extra = f", rotary_dim={self.rotary_dim}" if self.rotary_dim != self.head_dim else ""
        extra += ", pair_interleaved" if self.pair_interleaved else ""
        return (
            f"head_dim={self.head_dim}, mrope_section={list(self.mrope_section)}, "
            f"interleaved={self.interleaved}{extra}"
        )
