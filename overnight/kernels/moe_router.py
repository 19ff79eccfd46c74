"""Router top-k of a mixture-of-experts layer: softmax over the experts, the k largest, renormalized;
and the sigmoid router with a correction bias and grouped choice (GLM-4.5 / 4.6).

References: router_topk_ref in overnight/layers/moe.py, grouped_router_topk_ref in
overnight/layers/moe_grouped_router.py (the layers' CPU paths).

One program takes BLOCK_T tokens' router logits as a [BLOCK_T, E_P2] tile (E padded to a power of two
with -inf, so padding lanes get probability 0), takes the softmax in fp32, then picks the k largest by k
rounds of argmax, each pick masked out before the next: the picks come out heaviest first, ties going
to the lower expert id, and never repeat. The k weights are collected in registers so that the
renormalization (divide by their sum) happens before the single store. Launches depend only on shapes
and pointers: safe to capture in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROUTER_BLOCK_T = 16
ROUTER_NUM_WARPS = 4


def router_warps(experts_p2: int, grouped: bool = False) -> int:
    """Warps of a router program: 4, or 8 where 4 warps' registers cannot hold its [BLOCK_T, E_P2]
    tiles. Compiled for sm_90 at 4 warps, the softmax router over 512 (padded) experts (Qwen3-Next,
    Qwen3.5-MoE) spills 80 bytes, the grouped choice (topk_group < n_group) over 256 spills 16; 256
    experts without the group choice (GLM-4.5, MiniMax-M2) fit in 197 registers and keep 4 warps
    (tests/test_kernels_router_norm_sm90.py)."""
    return 8 if experts_p2 >= (256 if grouped else 512) else ROUTER_NUM_WARPS


@triton.jit(do_not_specialize=["num_tokens"])  # changes every step (paged_prefill.py says why)
def _router_topk_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    num_tokens,
    stride_lt,
    E: tl.constexpr,
    E_P2: tl.constexpr,
    TOP_K: tl.constexpr,
    K_P2: tl.constexpr,
    BLOCK_T: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = tl.arange(0, E_P2)
    offs_j = tl.arange(0, K_P2)
    t_mask = offs_t < num_tokens
    x = tl.load(
        logits_ptr + offs_t[:, None].to(tl.int64) * stride_lt + offs_e[None, :],
        mask=t_mask[:, None] & (offs_e[None, :] < E),
        other=float("-inf"),
    ).to(tl.float32)
    x = tl.where(t_mask[:, None], x, 0.0)  # rows past the end: finite, never stored
    x = tl.exp(x - tl.max(x, axis=1)[:, None])
    probs = x / tl.sum(x, axis=1)[:, None]

    top_w = tl.zeros([BLOCK_T, K_P2], dtype=tl.float32)
    top_id = tl.zeros([BLOCK_T, K_P2], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(probs, axis=1, tie_break_left=True)
        top_w = tl.where(offs_j[None, :] == j, tl.max(probs, axis=1)[:, None], top_w)
        top_id = tl.where(offs_j[None, :] == j, best[:, None].to(tl.int32), top_id)
        probs = tl.where(offs_e[None, :] == best[:, None], -1.0, probs)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=1)[:, None]  # lanes j >= TOP_K hold 0

    out = offs_t[:, None].to(tl.int64) * TOP_K + offs_j[None, :]
    mask = t_mask[:, None] & (offs_j[None, :] < TOP_K)
    tl.store(weights_ptr + out, top_w, mask=mask)
    tl.store(ids_ptr + out, top_id, mask=mask)


def router_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (unit stride along E) -> (weights [T, k] float32, expert ids [T, k] int32),
    heaviest first; with `renormalize` the k weights of a token sum to 1."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be [T, E] with unit stride along E, got {tuple(logits.shape)}")
    num_tokens, num_experts = logits.shape
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k must be in 1..{num_experts}, got {top_k}")
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    grid = (triton.cdiv(num_tokens, ROUTER_BLOCK_T),)
    _router_topk_kernel[grid](
        logits,
        weights,
        ids,
        num_tokens,
        logits.stride(0),
        E=num_experts,
        E_P2=triton.next_power_of_2(num_experts),
        TOP_K=top_k,
        K_P2=triton.next_power_of_2(top_k),
        BLOCK_T=ROUTER_BLOCK_T,
        RENORMALIZE=renormalize,
        num_warps=router_warps(triton.next_power_of_2(num_experts)),
    )
    return weights, ids


@triton.jit(do_not_specialize=["num_tokens"])
def _grouped_router_kernel(
    logits_ptr,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    num_tokens,
    stride_lt,
    scaling,
    renorm_eps,
    E: tl.constexpr,
    E_P2: tl.constexpr,
    TOP_K: tl.constexpr,
    K_P2: tl.constexpr,
    N_GROUP: tl.constexpr,
    G_P2: tl.constexpr,
    GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    # The tile as _router_topk_kernel's: BLOCK_T tokens x E_P2 experts; padding experts choose -inf.
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = tl.arange(0, E_P2)
    offs_j = tl.arange(0, K_P2)
    t_mask = offs_t < num_tokens
    e_mask = offs_e < E
    x = tl.load(
        logits_ptr + offs_t[:, None].to(tl.int64) * stride_lt + offs_e[None, :],
        mask=t_mask[:, None] & e_mask[None, :],
        other=0.0,  # rows past the end: finite, never stored
    ).to(tl.float32)
    scores = tl.sigmoid(x)
    bias = tl.load(bias_ptr + offs_e, mask=e_mask, other=0.0).to(tl.float32)
    choice = tl.where(e_mask[None, :], scores + bias[None, :], float("-inf"))
    if TOPK_GROUP < N_GROUP:
        # A group's score: its two largest choice values (the largest twice when it is tied).
        offs_g = tl.arange(0, G_P2)
        group_scores = tl.full([BLOCK_T, G_P2], float("-inf"), tl.float32)
        for g in tl.static_range(N_GROUP):
            in_g = (offs_e >= g * GROUP) & (offs_e < (g + 1) * GROUP)
            c = tl.where(in_g[None, :], choice, float("-inf"))
            first = tl.max(c, axis=1)
            ties = tl.sum(tl.where(c == first[:, None], 1, 0), axis=1)
            below = tl.max(tl.where(c < first[:, None], c, float("-inf")), axis=1)
            pair = first + tl.where(ties > 1, first, below)
            group_scores = tl.where(offs_g[None, :] == g, pair[:, None], group_scores)
        keep = tl.zeros([BLOCK_T, E_P2], dtype=tl.int32)
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.argmax(group_scores, axis=1, tie_break_left=True)
            lo = best[:, None] * GROUP
            keep = tl.where((offs_e[None, :] >= lo) & (offs_e[None, :] < lo + GROUP), 1, keep)
            group_scores = tl.where(offs_g[None, :] == best[:, None], float("-inf"), group_scores)
        choice = tl.where(keep > 0, choice, float("-inf"))

    top_w = tl.zeros([BLOCK_T, K_P2], dtype=tl.float32)
    top_id = tl.zeros([BLOCK_T, K_P2], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(choice, axis=1, tie_break_left=True)
        hit = offs_e[None, :] == best[:, None]
        weight = tl.sum(tl.where(hit, scores, 0.0), axis=1)  # the unbiased score
        top_w = tl.where(offs_j[None, :] == j, weight[:, None], top_w)
        top_id = tl.where(offs_j[None, :] == j, best[:, None].to(tl.int32), top_id)
        choice = tl.where(hit, float("-inf"), choice)
    if RENORMALIZE:
        top_w = top_w / (tl.sum(top_w, axis=1)[:, None] + renorm_eps)  # lanes j >= TOP_K hold 0
    top_w = top_w * scaling

    out = offs_t[:, None].to(tl.int64) * TOP_K + offs_j[None, :]
    mask = t_mask[:, None] & (offs_j[None, :] < TOP_K)
    tl.store(weights_ptr + out, top_w, mask=mask)
    tl.store(ids_ptr + out, top_id, mask=mask)


def grouped_router_topk(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    scaling: float,
    renorm_eps: float = 1e-20,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (unit stride along E), bias [E] -> (weights [T, k] float32, expert ids [T, k]
    int32), by decreasing biased score: sigmoid scores plus bias choose among the topk_group best of
    n_group groups, the unbiased scores weigh (renormalized: divided by their sum + renorm_eps, GLM's
    1e-20 or LFM2-MoE's 1e-6; times scaling)."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be [T, E] with unit stride along E, got {tuple(logits.shape)}")
    num_tokens, num_experts = logits.shape
    if bias.shape != (num_experts,) or not bias.is_contiguous():
        raise ValueError(f"bias must be a contiguous [{num_experts}], got {tuple(bias.shape)}")
    if n_group < 1 or num_experts % n_group or num_experts // n_group < 2:
        raise ValueError(f"n_group {n_group} must split {num_experts} experts into groups of 2 or more")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group must be in 1..{n_group}, got {topk_group}")
    group = num_experts // n_group
    if not 0 < top_k <= topk_group * group:
        raise ValueError(f"top_k must be in 1..{topk_group * group}, got {top_k}")
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    grid = (triton.cdiv(num_tokens, ROUTER_BLOCK_T),)
    _grouped_router_kernel[grid](
        logits,
        bias,
        weights,
        ids,
        num_tokens,
        logits.stride(0),
        float(scaling),
        float(renorm_eps),
        E=num_experts,
        E_P2=triton.next_power_of_2(num_experts),
        TOP_K=top_k,
        K_P2=triton.next_power_of_2(top_k),
        N_GROUP=n_group,
        G_P2=triton.next_power_of_2(n_group),
        GROUP=group,
        TOPK_GROUP=topk_group,
        BLOCK_T=ROUTER_BLOCK_T,
        RENORMALIZE=renormalize,
        num_warps=router_warps(triton.next_power_of_2(num_experts), topk_group < n_group),
    )
    return weights, ids
