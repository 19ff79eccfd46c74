"""Grouped GEMM of a mixture-of-experts layer on integer expert weights (W4A16 / W8A16): moe_gemm.py's
sorted-pair scheme with w4a16_gemm.py's in-kernel dequantization.

Reference: w4a16_moe_gemm_ref (below).

    a       [A, K] rows gathered per pair (A_DIV as in moe_gemm.py)
    qw      [E, N, K / P] int32, P = 32 / BITS values per word, low bits first (int_formats.py)
    scale   [E, N, K / G] float32, zero the same or none (2^(BITS-1))
    out     [P, N]: gated -> silu(gate) * up with qw holding [gate | up] rows; else times the pair's
            routing weight

W[e, n, k] = (code - zero[e, n, k // G]) * scale[e, n, k // G], rounded to a's dtype, then the dot with fp32
accumulation (the dequantized model's product). BLOCK_K divides G, so each K step has one scale per row.
Tiles past num_padded return at once: a launch depends only on shapes, safe in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from overnight.kernels.moe_align import ExpertRuns, moe_align


@triton.jit(do_not_specialize=["num_pairs", "num_tiles_m"])
def _w4a16_moe_kernel(
    a_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    out_ptr,
    topk_weights_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_padded_ptr,
    N,
    K,
    num_pairs,
    num_tiles_m,
    stride_am,
    stride_qe,
    stride_qn,
    stride_se,
    stride_sn,
    stride_om,
    up_offset_rows,
    A_DIV: tl.constexpr,
    GATED: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    PER: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    pid = tl.program_id(0)
    num_tiles_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_tiles_n
    pid_n = pid % num_tiles_n
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = pair < num_pairs
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_n = tl.minimum(offs_n, N - 1).to(tl.int64)
    a_rows = (pair // A_DIV).to(tl.int64)
    shifts = tl.arange(0, PER) * BITS
    q_base = qw_ptr + expert * stride_qe + rows_n[None, :] * stride_qn
    s_base = s_ptr + expert * stride_se + rows_n * stride_sn
    z_base = z_ptr + expert * stride_se + rows_n * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :], mask=row_mask[:, None], other=0.0)
        offs_w = k0 // PER + tl.arange(0, BLOCK_K // PER)
        g = k0 // GROUP
        words = tl.load(q_base + offs_w[:, None])
        codes = tl.reshape((words[:, None, :] >> shifts[None, :, None]) & MASK, (BLOCK_K, BLOCK_N))
        scale = tl.load(s_base + g)
        if HAS_ZERO:
            zero = tl.load(z_base + g)
        else:
            zero = tl.full((BLOCK_N,), 1 << (BITS - 1), tl.float32)
        w = ((codes.to(tl.float32) - zero[None, :]) * scale[None, :]).to(a.dtype)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
        if GATED:
            up_words = tl.load(q_base + up_offset_rows * stride_qn + offs_w[:, None])
            up_codes = tl.reshape((up_words[:, None, :] >> shifts[None, :, None]) & MASK, (BLOCK_K, BLOCK_N))
            up_scale = tl.load(s_base + up_offset_rows * stride_sn + g)
            if HAS_ZERO:
                up_zero = tl.load(z_base + up_offset_rows * stride_sn + g)
            else:
                up_zero = tl.full((BLOCK_N,), 1 << (BITS - 1), tl.float32)
            up = ((up_codes.to(tl.float32) - up_zero[None, :]) * up_scale[None, :]).to(a.dtype)
            acc_up += tl.dot(a, up, input_precision=DOT_PRECISION)
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_WEIGHT:
        acc = acc * tl.load(topk_weights_ptr + pair, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & (offs_n[None, :] < N))


def _block_k(group: int) -> int:
    for bk in (128, 64, 32, 16):
        if group % bk == 0:
            return bk
    raise ValueError(f"group size {group} is not a multiple of 16")


def w4a16_moe_gemm(
    a: torch.Tensor,
    qw: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bits: int,
    group: int,
    runs: ExpertRuns,
    *,
    gated: bool = False,
    topk_weights: torch.Tensor | None = None,
    block_n: int = 64,
) -> torch.Tensor:
    """Pair p's row: a[p // (P / A)] @ dequant(qw[expert of p])^T, gated or weighted (module docstring)."""
    num_pairs = runs.num_pairs
    a_rows, k = a.shape
    e, rows, words = qw.shape
    if a_rows == 0 or num_pairs % a_rows:
        raise ValueError(f"a has {a_rows} rows; the pairs ({num_pairs}) must be a multiple of them")
    if bits not in (4, 8) or qw.dtype != torch.int32 or words * (32 // bits) != k or qw.stride(2) != 1:
        raise ValueError(f"qw must be int32 [E, N, {k}*{bits}/32], got {qw.dtype} {tuple(qw.shape)}")
    if group <= 0 or k % group:
        raise ValueError(f"group size {group} does not divide K={k}")
    if scale.shape != (e, rows, k // group) or scale.dtype != torch.float32 or not scale.is_contiguous():
        raise ValueError(f"scale must be float32 {(e, rows, k // group)}, got {tuple(scale.shape)}")
    if zero is not None and (
        zero.shape != scale.shape or zero.dtype != torch.float32 or not zero.is_contiguous()
    ):
        raise ValueError(f"zero must be float32 {tuple(scale.shape)}, got {tuple(zero.shape)}")
    if gated and rows % 2:
        raise ValueError(f"gated: qw must hold [gate | up] rows, got {rows}")
    if topk_weights is not None and topk_weights.numel() != num_pairs:
        raise ValueError(f"topk_weights must hold one weight per pair ({num_pairs})")
    if a.stride(1) != 1:
        a = a.contiguous()
    n = rows // 2 if gated else rows
    out = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    num_tiles_m = runs.sorted_ids.numel() // runs.block_m
    grid = (num_tiles_m * triton.cdiv(n, block_n),)
    _w4a16_moe_kernel[grid](
        a,
        qw,
        scale,
        zero if zero is not None else scale,
        out,
        topk_weights if topk_weights is not None else out,
        runs.sorted_ids,
        runs.expert_ids,
        runs.num_padded,
        n,
        k,
        num_pairs,
        num_tiles_m,
        a.stride(0),
        qw.stride(0),
        qw.stride(1),
        scale.stride(0),
        scale.stride(1),
        out.stride(0),
        n,
        A_DIV=num_pairs // a_rows,
        GATED=gated,
        MUL_WEIGHT=topk_weights is not None,
        BITS=bits,
        GROUP=group,
        HAS_ZERO=zero is not None,
        BLOCK_M=runs.block_m,
        BLOCK_N=block_n,
        BLOCK_K=_block_k(group),
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=4,
        num_stages=3,
    )
    return out


def w4a16_fused_experts(
    x: torch.Tensor,
    gate_up: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    down: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    bits: int,
    groups: tuple[int, int],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    block_m: int = 16,
) -> torch.Tensor:
    """x [T, H] -> [T, H]: fused_moe.py's pipeline (align, gated GEMM, weighted GEMM, sum over k) on
    (packed, scale, zero) expert weights: gate_up [E, 2I, H/P], down [E, H, I/P]."""
    num_tokens, hidden = x.shape
    if num_tokens == 0:
        return torch.zeros_like(x)
    top_k = topk_ids.shape[1]
    runs = moe_align(topk_ids.int().contiguous(), gate_up[0].shape[0], block_m)
    h = w4a16_moe_gemm(x.contiguous(), *gate_up, bits, groups[0], runs, gated=True)
    y = w4a16_moe_gemm(h, *down, bits, groups[1], runs, topk_weights=topk_weights.float().contiguous())
    return y.view(num_tokens, top_k, hidden).sum(dim=1)


def dequantize_experts_ref(
    qw: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bits: int,
    group: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """[E, N, K] in dtype: every expert's weight dequantized (the reference's first half)."""
    shifts = torch.arange(0, 32, bits, device=qw.device, dtype=torch.int32)
    codes = ((qw.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(*qw.shape[:2], -1)
    z = zero if zero is not None else torch.full_like(scale, float(1 << (bits - 1)))
    g = torch.arange(codes.shape[-1], device=qw.device) // group
    return ((codes.float() - z[:, :, g]) * scale[:, :, g]).to(dtype)


def w4a16_fused_experts_ref(
    x: torch.Tensor,
    gate_up: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    down: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    bits: int,
    groups: tuple[int, int],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The same in torch, fp32, one matmul per (token, expert) group of rows."""
    w1 = dequantize_experts_ref(*gate_up, bits, groups[0], x.dtype).float()
    w2 = dequantize_experts_ref(*down, bits, groups[1], x.dtype).float()
    inter = w1.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    xf = x.float()
    for expert in torch.unique(topk_ids).tolist():
        tok, slot = torch.nonzero(topk_ids == expert, as_tuple=True)
        h = xf[tok] @ w1[expert].t()
        h = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
        y = h.to(x.dtype).float() @ w2[expert].t()
        out.index_add_(0, tok, y * topk_weights[tok, slot].float()[:, None])
    return out.to(x.dtype)
