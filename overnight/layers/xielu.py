"""xIELU (Apertus' MLP activation, arXiv 2411.13010), as transformers' XIELUActivation computes it:

    alpha_p = softplus(a_p)          alpha_n = beta + softplus(a_n)
    x > 0:  alpha_p * x^2 + beta * x
    x <= 0: (expm1(min(x, eps)) - x) * alpha_n + beta * x

with a_p, a_n learned per layer (one value each, the checkpoint's mlp.act_fn.alpha_p / alpha_n) and
beta = 0.5, eps = -1e-6 fixed: transformers builds every Apertus layer with these and the checkpoints'
beta / eps buffers hold them (models/apertus.py checks that and drops them). Both branches are computed
and one is selected per element, so the op has no data-dependent control flow (CUDA graphs capture it);
on the GPU one Triton pass does it all (kernels/xielu.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from overnight.kernels.dispatch import use_kernels

XIELU_BETA = 0.5
XIELU_EPS = -1e-6


def xielu_ref(
    x: torch.Tensor, alpha_p: torch.Tensor, alpha_n: torch.Tensor, beta: float, eps: float
) -> torch.Tensor:
    """The activation in x's dtype, alpha_p / alpha_n the raw (pre-softplus) parameters."""
    a_p = F.softplus(alpha_p)
    a_n = beta + F.softplus(alpha_n)
    negative = (torch.expm1(torch.clamp(x, max=eps)) - x) * a_n + beta * x
    return torch.where(x > 0, a_p * x * x + beta * x, negative)


class XIELU(nn.Module):
    def __init__(self, beta: float = XIELU_BETA, eps: float = XIELU_EPS) -> None:
        super().__init__()
        # transformers' initial values (0.8, 0.8) as raw parameters; the checkpoint overwrites them.
        self.alpha_p = nn.Parameter(torch.log(torch.expm1(torch.tensor([0.8]))))
        self.alpha_n = nn.Parameter(torch.log(torch.expm1(torch.tensor([0.8 - beta]))))
        self.beta = beta
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_kernels(x) and x.is_contiguous():
            from overnight.kernels.xielu import xielu  # triton loads on first use

            return xielu(x, self.alpha_p, self.alpha_n, self.beta, self.eps)
        return xielu_ref(x, self.alpha_p, self.alpha_n, self.beta, self.eps)

    def extra_repr(self) -> str:
        return f"beta={self.beta}, eps={self.eps}"
