"""Cohere's LayerNorm: mean-centred over the last dim, scaled by a weight, no bias, computed in float32 and
cast back (transformers' CohereLayerNorm). Same call contract as layers/norm.RMSNorm, so the decoder's
deferred residual add works unchanged: norm(x), or with a residual (norm(x + residual), x + residual).
The weight may have more dims than the one normalized: Command R+'s q / k norms hold one row per head,
[heads, head_dim], over q [T, heads, head_dim]."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def layer_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x - mean) / sqrt(var + eps) over the last dim, in float32, cast to x's dtype. torch's
    layer_norm: one fused kernel on CUDA, the same statistics (biased variance) as transformers'."""
    if weight.dim() == 1:
        return F.layer_norm(x.float(), (x.shape[-1],), weight.float(), None, eps).to(x.dtype)
    return (F.layer_norm(x.float(), (x.shape[-1],), None, None, eps) * weight.float()).to(x.dtype)


class LayerNormNoBias(nn.Module):
    def __init__(self, shape: int | tuple[int, ...], eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(shape))
        self.variance_epsilon = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return layer_norm_ref(x, self.weight, self.variance_epsilon)
        added = x + residual
        return layer_norm_ref(added, self.weight, self.variance_epsilon), added

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"
