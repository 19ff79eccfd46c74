"""The ops of a Mamba2 mixer (Granite 4.0 and Nemotron-H hybrids), in plain PyTorch: the CPU path and the
reference for the kernels (kernels/mamba2_scan.py, mamba2_chunked.py; the gated output norm's
kernels/mamba2_gated_norm.py, which MambaGatedRMSNorm takes on the GPU).

Per head h (H heads of P values; G groups of B/C, head h reads group h // (H / G)) the mixer keeps a
state S (P x N, N = d_state) that every token updates (the SSD form, arXiv 2405.21060):

    dt_t = clamp(softplus(dt_raw_t + dt_bias), dt_limit)     one step size per head and token
    S   <- exp(dt_t * A) * S + dt_t * x_t B_t^T               A = -exp(A_log) < 0: a decay in (0, 1)
    y_t  = S C_t + D * x_t

x, B and C come out of the causal conv (its state: the last K-1 inputs, layers/gated_delta.py's conv
ops with the mixer's conv bias). A sequence may be split anywhere: running the pieces one after another,
each from the states the previous one left, gives the whole sequence's outputs (up to rounding). States
are float32, and the references compute in float32 whatever they are given.

dt_limit (config.json's time_step_limit) applies to every token, prefill and decode alike: transformers
clamps in its chunked scan only, so the two differ on decode steps of a config with a finite limit; the
default (0, inf) makes the clamp a no-op in both (softplus is positive), and vLLM's Mamba2 ignores it.

The chunked form (prefill) does `chunk` tokens at a time with matrix products: within a chunk the
decay between positions j <= i is exp(G_i - G_j), G the cumulative sum of dt * A, so

    y_i = exp(G_i) S_0 C_i + sum_{j <= i} exp(G_i - G_j) dt_j (C_i . B_j) x_j + D x_i
    S_L = exp(G_L) S_0 + sum_j exp(G_L - G_j) dt_j x_j B_j^T                    (carried to the next chunk)

The recurrent form (decode) is the first formula, batched over sequences.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from overnight.kernels.dispatch import use_kernels
from overnight.layers.gated_delta import to_chunks


def mamba2_dt(dt: torch.Tensor, dt_bias: torch.Tensor, dt_limit: tuple[float, float]) -> torch.Tensor:
    """The step sizes [T, H] in float32 from the raw projection: softplus(dt + dt_bias), clamped."""
    out = F.softplus(dt.float() + dt_bias.float())
    lo, hi = dt_limit
    if lo > 0.0 or hi != float("inf"):
        out = out.clamp(lo, hi)
    return out


def _expand_groups(m: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[..., G, N] -> [..., H, N]: head h reads group h // (H / G)."""
    r = num_heads // m.shape[-2]
    return m.repeat_interleave(r, dim=-2) if r > 1 else m


def ssd_chunk_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    state: torch.Tensor | None = None,
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, chunked. x [T, H, P]; dt [T, H] (mamba2_dt's); A, D [H]; B, C [T, G, N]; state
    [H, P, N] (None: zeros). Returns (y [T, H, P] in x's dtype, the final state [H, P, N] float32)."""
    dtype = x.dtype
    t, h, p = x.shape
    B, C = _expand_groups(B, h), _expand_groups(C, h)
    n_state = B.shape[-1]
    # [H, n, L, .] chunks in float32 (padding: dt = 0, so it neither decays nor writes)
    xs, Bs, Cs, dts = (to_chunks(m, chunk) for m in (x, B, C, dt))
    n = xs.shape[1]
    G = (dts * A.float()[:, None, None]).cumsum(-1)  # [H, n, L], non-increasing
    future = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).triu(1)
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(future, float("-inf")).exp()
    scores = (Cs @ Bs.transpose(-1, -2)) * decay * dts[..., None, :]  # [H, n, L, L]
    y_diag = scores @ xs
    to_end = ((G[..., -1:] - G).exp() * dts)[..., None]  # [H, n, L, 1]
    writes = (xs * to_end).transpose(-1, -2) @ Bs  # [H, n, P, N]: each chunk's own contribution
    chunk_decay = G[..., -1].exp()[..., None, None]  # [H, n, 1, 1]
    from_start = G.exp()[..., None]  # [H, n, L, 1]

    s = x.new_zeros(h, p, n_state, dtype=torch.float32) if state is None else state.float()
    y = torch.empty_like(xs)
    for i in range(n):  # the state carried across chunks
        y[:, i] = y_diag[:, i] + from_start[:, i] * (Cs[:, i] @ s.transpose(-1, -2))
        s = s * chunk_decay[:, i] + writes[:, i]
    y = y.reshape(h, n * chunk, p)[:, :t].transpose(0, 1) + D.float()[:, None] * x.float()
    return y.to(dtype), s


def ssd_step_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of N sequences. x [N, H, P]; dt [N, H] (mamba2_dt's); B, C [N, G, N_state];
    state [N, H, P, N_state]. Returns (y [N, H, P] in x's dtype, the new states float32)."""
    h = x.shape[1]
    B, C = _expand_groups(B, h).float(), _expand_groups(C, h).float()
    xf, dtf = x.float(), dt.float()
    decay = (dtf * A.float()).exp()[..., None, None]  # [N, H, 1, 1]
    s = state.float() * decay + (dtf[..., None] * xf)[..., None] * B[:, :, None, :]
    y = (s @ C[..., None])[..., 0] + D.float()[:, None] * xf
    return y.to(x.dtype), s


def mamba_gated_norm_ref(
    y: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    groups: int = 1,
    norm_before_gate: bool = False,
) -> torch.Tensor:
    """weight * rms_norm(y * silu(z)), the gate before the norm, the statistics taken over each of
    `groups` equal slices of the last dim on its own: groups 1 is transformers'
    GraniteMoeHybridRMSNormGated (one norm over the mixer's width, whatever n_groups), groups = n_groups
    its Zamba2RMSNormGated with group_size = width / n_groups (Nemotron-H). Statistics in float32, the
    weight applied in y's dtype. norm_before_gate (Falcon-H1's FalconH1RMSNormGated): the gate multiplies
    the normed, weighted y instead, all in float32 until the final cast (as transformers)."""
    dtype = y.dtype
    g = y.float() if norm_before_gate else y.float() * F.silu(z.float())
    if groups > 1:
        g = g.unflatten(-1, (groups, -1))
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    if groups > 1:
        g = g.flatten(-2)
    if norm_before_gate:
        return (weight.float() * g * F.silu(z.float())).to(dtype)
    return weight * g.to(dtype)


@dataclass(frozen=True)
class GatedNormShare:
    """Where a rank's width sits when each norm slice spans several ranks (tensor parallelism with fewer
    norm slices than ranks, parallel/tp_mamba2.py): rank `rank` of `world`, each slice the widths of
    `span` consecutive ranks (span = world: one norm over the whole width). reduce sums a tensor over
    the ranks in place (an all-reduce)."""

    rank: int
    world: int
    span: int
    reduce: Callable[[torch.Tensor], object]


def sharded_gated_norm(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, share: GatedNormShare
) -> torch.Tensor:
    """mamba_gated_norm_ref's one slice when y, z [T, W] and weight [W] are one rank's share of it.

    Each rank writes its per-token sum of squares into its own column of a [T, world] float32 tensor
    of zeros; one all-reduce gives every rank every rank's sums, and a rank adds the `span` columns of
    the ranks that share its slice. Every share has the same width, so the slice's mean is that sum
    over span * W. Rounding otherwise follows mamba_gated_norm_ref (fp32 statistics, cast back before
    the weight); only the order of the sum differs."""
    squares = y.new_zeros(y.shape[0], share.world, dtype=torch.float32)
    first = share.rank // share.span * share.span
    count = share.span * y.shape[-1]
    if use_kernels(y):  # two passes of kernels/mamba2_gated_norm.py around the all-reduce
        from overnight.kernels.mamba2_gated_norm import gated_sum_squares, mamba_gated_norm

        gated_sum_squares(y, z, squares[:, share.rank])
        share.reduce(squares)
        total = squares[:, first : first + share.span].sum(-1)
        return mamba_gated_norm(y, z, weight, eps, 1, sum_squares=total, count=count)
    dtype = y.dtype
    g = y.float() * F.silu(z.float())
    squares[:, share.rank] = g.pow(2).sum(-1)
    share.reduce(squares)
    total = squares[:, first : first + share.span].sum(-1, keepdim=True)
    g = g * torch.rsqrt(total / count + eps)
    return weight * g.to(dtype)


class MambaGatedRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, groups: int = 1, norm_before_gate: bool = False) -> None:
        super().__init__()
        if dim % groups:
            raise ValueError(f"the gated norm's width {dim} does not split into {groups} groups")
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps
        self.groups = groups
        # The gate after the norm (Falcon-H1): torch ops only, no kernel, no tensor-parallel share.
        self.norm_before_gate = norm_before_gate
        # Set by tensor parallelism when this rank holds a share of one norm slice (groups is then 1):
        # the statistics are summed over the ranks of the slice. Fixed at load: capture and replay
        # take the same branch.
        self.share: GatedNormShare | None = None

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """y [T, W] (the SSM's output), z [T, W] (the gate, a view into in_proj's output)."""
        if self.norm_before_gate:
            return mamba_gated_norm_ref(y, z, self.weight, self.variance_epsilon, self.groups, True)
        if self.share is not None:
            return sharded_gated_norm(y, z, self.weight, self.variance_epsilon, self.share)
        if use_kernels(y):  # one pass (kernels/mamba2_gated_norm.py) instead of several fp32 temporaries
            from overnight.kernels.mamba2_gated_norm import mamba_gated_norm  # triton loads on first use

            return mamba_gated_norm(y, z, self.weight, self.variance_epsilon, self.groups)
        return mamba_gated_norm_ref(y, z, self.weight, self.variance_epsilon, self.groups)
