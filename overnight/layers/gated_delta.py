"""The ops of a Gated DeltaNet layer (Qwen3.5, Qwen3-Next), in plain PyTorch: the CPU path and the
reference for any kernel.

Per value head h the layer keeps a state S (dk x dv) that every token updates (arXiv 2412.06464):

    S <- exp(g_t) * S                      decay, g_t = -exp(A_log) * softplus(a_t + dt_bias) <= 0
    r  = v_t - S^T k_t                     what the state mispredicts (the delta rule)
    S <- S + beta_t * k_t r^T              beta_t = sigmoid(b_t), the write strength
    o_t = S^T q_t / sqrt(dk)               q, k L2-normalised per head first

Grouped heads: Hv value heads share Hk = Hv / r query/key heads (head h reads q/k head h // r).
Before it, a causal depthwise conv of width K (SiLU) runs over the concatenated q|k|v channels; its
state is the last K-1 inputs of the sequence (zeros before the first token). A sequence may be split
anywhere: running the pieces one after another, each from the states the previous one left, gives the
whole sequence's outputs (up to rounding). States are float32.

Shapes (one sequence): q, k [T, Hk, dk]; v [T, Hv, dv]; g, beta [T, Hv]; state [Hv, dk, dv].
The chunked form (prefill) processes blocks of `chunk` tokens with a triangular solve (the WY / UT
form), then one pass carries the state across blocks; the recurrent form (decode) is the loop above,
batched over sequences.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

L2_EPS = 1e-6  # the eps of the q/k L2 norm (fla's, which the HF reference copies)


def l2norm(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gdn_gates(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta) from the projections a, b [T, Hv]: g in log space (float32), beta = sigmoid(b)."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, b.sigmoid()


def causal_conv1d_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    state: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    silu: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence. x [T, C]; weight [C, K]; state [K-1, C] (the K-1 inputs before x; None: zeros);
    bias [C] or None (Mamba2's conv has one). Returns (silu(conv + bias) [T, C] in x's dtype (silu
    False: conv + bias, LFM2's short conv), the new state [K-1, C] float32: the last K-1 inputs)."""
    t, c = x.shape
    k = weight.shape[1]
    if state is None:
        state = x.new_zeros(k - 1, c, dtype=torch.float32)
    window = torch.cat([state.to(weight.dtype), x.to(weight.dtype)], dim=0)  # [K-1+T, C]
    out = F.conv1d(window.t().unsqueeze(0), weight.unsqueeze(1), bias, groups=c)[0].t()  # [T, C]
    return (F.silu(out) if silu else out).to(x.dtype), window[-(k - 1) :].float()


def causal_conv1d_step_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    state: torch.Tensor,
    bias: torch.Tensor | None = None,
    silu: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of N sequences. x [N, C]; state [N, K-1, C]; bias [C] or None. Returns
    (silu(conv + bias) [N, C] (silu False: conv + bias), the shifted state [N, K-1, C] float32)."""
    window = torch.cat([state.to(weight.dtype), x.to(weight.dtype).unsqueeze(1)], dim=1)  # [N, K, C]
    c = x.shape[1]
    out = F.conv1d(window.transpose(1, 2), weight.unsqueeze(1), bias, groups=c)[:, :, -1]
    return (F.silu(out) if silu else out).to(x.dtype), window[:, 1:].float()


def _expand_heads(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    r = num_v_heads // q.shape[-2]
    if r > 1:
        q, k = q.repeat_interleave(r, dim=-2), k.repeat_interleave(r, dim=-2)
    return q, k


def to_chunks(m: torch.Tensor, chunk: int) -> torch.Tensor:
    """One sequence's [T, H, ...] -> [H, n, chunk, ...] in float32, n = ceil(T / chunk), zeros past T:
    the chunked references' layout (here and layers/mamba2.py's ssd_chunk_ref)."""
    m = m.transpose(0, 1).float()
    pad = -m.shape[1] % chunk
    m = F.pad(m, (0, 0) * (m.dim() - 2) + (0, pad))
    return m.reshape(m.shape[0], -1, chunk, *m.shape[2:])


def chunk_gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, chunked; q and k are L2-normalised here. Returns (o [T, Hv, dv] in v's dtype, the
    final state [Hv, dk, dv] float32)."""
    dtype = v.dtype
    t, hv, dv = v.shape
    q, k = _expand_heads(q, k, hv)
    dk = q.shape[-1]
    # [Hv, n, L, d] chunks in float32 (padding: g = 0, beta = 0, so it changes nothing)
    q, k, v = (to_chunks(x, chunk) for x in (q, k, v))
    g, beta = to_chunks(g, chunk), to_chunks(beta, chunk)
    q, k = l2norm(q) * dk**-0.5, l2norm(k)  # per row: the zero padding stays zero
    n = q.shape[1]
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]

    # Within a chunk: decay between positions j <= i is exp(G_i - G_j), G the cumulative log decay.
    G = g.cumsum(-1)
    future = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(future, float("-inf")).exp()
    # (I + A) u = v_beta with A the strictly lower beta-weighted key products: the UT transform.
    system = (k_beta @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * G.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * G.exp()[..., None]
    k_to_end = k * (G[..., -1:] - G).exp()[..., None]
    chunk_decay = G[..., -1].exp()[..., None, None]

    s = torch.zeros(hv, dk, dv, dtype=torch.float32, device=q.device) if state is None else state.float()
    out = torch.empty_like(v)
    for i in range(n):  # the state carried across chunks
        v_new = u[:, i] - w[:, i] @ s
        out[:, i] = q_decayed[:, i] @ s + attn[:, i] @ v_new
        s = s * chunk_decay[:, i] + k_to_end[:, i].transpose(-1, -2) @ v_new
    o = out.reshape(hv, n * chunk, dv)[:, :t].transpose(0, 1)
    return o.to(dtype), s


def recurrent_gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token, batched over N sequences: q, k [N, T, Hk, dk]; v [N, T, Hv, dv]; g, beta
    [N, T, Hv]; state [N, Hv, dk, dv]. Returns (o [N, T, Hv, dv] in v's dtype, final states float32)."""
    dtype = v.dtype
    hv = v.shape[-2]
    q, k = _expand_heads(q, k, hv)
    dk = q.shape[-1]
    q, k, v = l2norm(q.float()) / dk**0.5, l2norm(k.float()), v.float()
    g, beta = g.float(), beta.float()
    s = state.float()
    out = torch.empty_like(v)
    for t in range(v.shape[1]):
        s = s * g[:, t].exp()[..., None, None]
        r = (v[:, t] - (s * k[:, t, :, :, None]).sum(-2)) * beta[:, t, :, None]
        s = s + k[:, t, :, :, None] * r[:, :, None, :]
        out[:, t] = (s * q[:, t, :, :, None]).sum(-2)
    return out.to(dtype), s


def gated_rms_norm_ref(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rms_norm(x) * silu(gate), over the last dim; statistics in float32, the weight applied
    in x's dtype (the HF order)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf.to(dtype) * F.silu(gate.float())).to(dtype)


class GatedRMSNorm(nn.Module):
    """RMSNorm over one value head, gated by silu(z) (the output norm of a Gated DeltaNet layer)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm_ref(x, gate, self.weight, self.variance_epsilon)
