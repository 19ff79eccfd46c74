"""RMSNorm, optionally fused with the residual add that precedes it in every decoder layer."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """weight * x / rms(x), normalising over the last dimension.

    The statistics are taken in fp32 and the result is cast back to the input dtype *before* the weight
    multiply; that order is what the HF reference does, so fp32 outputs match it bit for bit.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * x.to(input_dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); or, with a residual, (norm(x + residual), x + residual): the add is done in the
        activation dtype, as the reference does between layers, and its sum becomes the next residual."""
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"
