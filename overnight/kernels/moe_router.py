"""Router top-k of a mixture-of-experts layer: softmax over the experts, the k largest, renormalized.

Reference: router_topk_ref in overnight/layers/moe.py (the layer's CPU path).

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
        num_warps=ROUTER_NUM_WARPS,
    )
    return weights, ids
