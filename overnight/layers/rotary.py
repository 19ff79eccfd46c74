"""Rotary position embedding (rotate-half convention), with Llama 3 frequency scaling.

The cos/sin table is computed once for every position up to max_position:

    cos_sin_cache[max_position, head_dim]  =  [ cos(p * f_0 .. p * f_{D/2-1}) | sin(same) ]

and looked up by each token's absolute position, so a step may mix tokens of any positions.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from overnight.kernels.dispatch import use_kernels
from overnight.layers.norm import RMSNorm


def _inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _llama3_scale(inv_freq: torch.Tensor, scaling: dict[str, float]) -> torch.Tensor:
    """Llama 3.1 long-context scaling: low frequencies (wavelength beyond the original context divided
    by low_freq_factor) are slowed by `factor`, high ones kept, and the band between interpolated."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    cos_sin_cache: torch.Tensor  # [max_position, head_dim] fp32: cos | sin (a buffer, never saved)

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        rope_scaling: dict[str, float] | None = None,
    ) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        self.head_dim = head_dim
        self.max_position = max_position
        self.theta = theta
        self.rope_scaling = rope_scaling
        self.register_buffer("cos_sin_cache", self._table(torch.get_default_device()), persistent=False)

    def _table(self, device: torch.device) -> torch.Tensor:
        if device.type == "meta":
            return torch.empty(self.max_position, self.head_dim, dtype=torch.float32, device=device)
        # Computed on the CPU in fp32 whatever the target, so every device gets the same numbers; kept in
        # fp32 and cast to q's dtype on use.
        with torch.device("cpu"):
            inv_freq = _inv_freq(self.head_dim, self.theta)
            if self.rope_scaling:
                inv_freq = _llama3_scale(inv_freq, self.rope_scaling)
            positions = torch.arange(self.max_position, dtype=torch.float32)
            freqs = torch.outer(positions, inv_freq)
            table = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        return table.to(device)

    def reset_table(self) -> None:
        """Recompute the table where it now lives (after a meta-built model is materialized)."""
        self.cos_sin_cache = self._table(self.cos_sin_cache.device)

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int64; q: [T, H, D]; k: [T, Hkv, D]. Returns the rotated q and k; with q_norm
        and k_norm (Qwen3), each head of q and k is RMS-normalized first.

        The kernel path (use_kernels) rotates q and k in place, norms included, in one launch (with
        q_norm's eps for both: Qwen3's two norms share one), and returns them; the PyTorch path returns
        new tensors and leaves q and k as they were."""
        if (q_norm is None) != (k_norm is None):
            raise ValueError("q_norm and k_norm come together")
        if use_kernels(q):
            from overnight.kernels.rotary import qk_norm_rotary_inplace, rotary_inplace  # triton on use

            if q_norm is None or k_norm is None:
                rotary_inplace(positions, q, k, self.cos_sin_cache)
            else:
                eps = q_norm.variance_epsilon
                qk_norm_rotary_inplace(positions, q, k, self.cos_sin_cache, q_norm.weight, k_norm.weight, eps)
            return q, k
        if q_norm is not None and k_norm is not None:
            q, k = q_norm(q), k_norm(k)
        return rotary_ref(positions, q, k, self.cos_sin_cache)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_position={self.max_position}"


def rotary_ref(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch path: rotated copies of q [T, H, D] and k [T, Hkv, D]; the table's cos/sin are cast to
    each one's dtype before use, as the HF reference does."""
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, D/2] each
    return _rotate(q, cos.to(q.dtype), sin.to(q.dtype)), _rotate(k, cos.to(k.dtype), sin.to(k.dtype))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Pairs element i with element i + D/2 (the rotate-half layout of HF checkpoints).
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
