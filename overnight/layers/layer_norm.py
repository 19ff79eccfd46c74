"""Cohere's LayerNorm: mean-centred, scaled by a weight, no bias, computed in float32 and cast back
(transformers' CohereLayerNorm). Same call contract as layers/norm.RMSNorm, so the decoder's deferred
residual add works unchanged: norm(x), or with a residual (norm(x + residual), x + residual)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def layer_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x - mean) / sqrt(var + eps) over the last dim, in float32, cast to x's dtype. torch's
    layer_norm: one fused kernel on CUDA, the same statistics (biased variance) as transformers'."""
    return F.layer_norm(x.float(), (x.shape[-1],), weight.float(), None, eps).to(x.dtype)


class LayerNormNoBias(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
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
