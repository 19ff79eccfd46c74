"""The prefill of a Mamba2 mixer on the GPU: every sequence of a step in one launch, a chunk of L tokens at
a time (layers/mamba2.py's chunked form, ssd_chunk_ref), states read from and left in the pool in place.

Reference: ssd_chunk_ref (the CPU path), and kernels/mamba2_scan.py's token-by-token ssd_varlen, which
takes the same arguments and gives the same result up to rounding.

    grid (sequence, head, P block); one program walks its sequence's chunks in order:

        load x [L, BLOCK_P], B and C [L, N], dt [L]          rows past the sequence: dt = 0, x = 0
        G = cumsum(dt * A)                                     the chunk's log decay, non-increasing
        y = ((C B^T) * exp(G_i - G_j) [j <= i] * dt_j) x       within the chunk
          + exp(G) * (C S^T) + D x                             from the state before the chunk
        S <- exp(G_L) S + (x * exp(G_L - G) dt)^T B            the state after it

    a 512-token prompt is 16 dependent iterations of four small matrix products instead of 512 steps.
    The [BLOCK_P, N] state tile stays in registers from chunk to chunk and is stored once (a 16-bit pool
    rounds it once per step); has_state 0 starts from zeros without reading the slot.

Prefill steps are never captured in CUDA graphs; the launch still reads nothing from the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from overnight.kernels.gated_delta_decode import softplus
from overnight.kernels.mamba2_scan import check_inputs


@triton.jit
def _ssd_chunked_kernel(
    x_ptr,
    dt_ptr,
    b_ptr,
    c_ptr,
    A_log_ptr,
    dt_bias_ptr,
    D_ptr,
    pool_ptr,
    slot_ptr,
    has_ptr,
    cu_ptr,
    y_ptr,
    stride_xn,
    stride_xh,
    stride_dtn,
    stride_bn,
    stride_bg,
    stride_cn,
    stride_cg,
    stride_yn,
    stride_yh,
    stride_ps,
    dt_min,
    dt_max,
    R: tl.constexpr,
    P: tl.constexpr,
    N: tl.constexpr,
    L: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DT_LIMIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """The varlen prefill, L tokens at a time (layers/mamba2.py's chunked form): within a chunk, with G
    the cumulative sum of dt * A,

        y = ((C B^T) * exp(G_i - G_j) [j <= i] * dt_j) x + exp(G) * (C S^T) + D x
        S <- exp(G_L) S + (x * exp(G_L - G) dt)^T B

    so a chunk is four small matrix products; the state tile stays in registers across the chunks."""
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    offs_l = tl.arange(0, L)
    mask_p, mask_n = offs_p < P, offs_n < N
    g = h // R
    bos = tl.load(cu_ptr + n).to(tl.int64)
    eos = tl.load(cu_ptr + n + 1).to(tl.int64)

    slot = tl.load(slot_ptr + n).to(tl.int64)
    keep = tl.load(has_ptr + n + 0 * offs_p) != 0
    p_s = pool_ptr + slot * stride_ps + h * (P * N) + offs_p[:, None] * N + offs_n[None, :]
    s = tl.load(p_s, mask=(mask_p & keep)[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
    A = -tl.exp(tl.load(A_log_ptr + h).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    D = tl.load(D_ptr + h).to(tl.float32)
    causal = offs_l[:, None] >= offs_l[None, :]

    for c0 in range(bos, eos, L):
        rows = c0 + offs_l
        mask_t = rows < eos
        x = tl.load(
            x_ptr + rows[:, None] * stride_xn + h * stride_xh + offs_p[None, :],
            mask=mask_t[:, None] & mask_p[None, :],
            other=0.0,
        ).to(tl.float32)  # [L, BLOCK_P]
        mask_tn = mask_t[:, None] & mask_n[None, :]
        bm = tl.load(
            b_ptr + rows[:, None] * stride_bn + g * stride_bg + offs_n[None, :], mask=mask_tn, other=0.0
        )
        cm = tl.load(
            c_ptr + rows[:, None] * stride_cn + g * stride_cg + offs_n[None, :], mask=mask_tn, other=0.0
        )
        bm = bm.to(tl.float32)
        cm = cm.to(tl.float32)
        dt = tl.load(dt_ptr + rows * stride_dtn + h, mask=mask_t, other=0.0).to(tl.float32)
        dt = softplus(dt + dt_bias)
        if DT_LIMIT:
            dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
        dt = tl.where(mask_t, dt, 0.0)  # rows past the sequence neither decay nor write
        G = tl.cumsum(dt * A, axis=0)  # [L], non-increasing
        G_last = tl.sum(dt * A, axis=0)
        decay = tl.where(causal, tl.exp(tl.minimum(G[:, None] - G[None, :], 0.0)), 0.0)
        scores = tl.dot(cm, tl.trans(bm), input_precision=DOT_PRECISION) * decay * dt[None, :]  # [L, L]
        y = tl.dot(scores, x, input_precision=DOT_PRECISION)
        y += tl.exp(G)[:, None] * tl.dot(cm, tl.trans(s), input_precision=DOT_PRECISION)
        y += D * x
        tl.store(
            y_ptr + rows[:, None] * stride_yn + h * stride_yh + offs_p[None, :],
            y.to(y_ptr.dtype.element_ty),
            mask=mask_t[:, None] & mask_p[None, :],
        )
        w = tl.exp(G_last - G) * dt  # [L]
        s = s * tl.exp(G_last) + tl.dot(tl.trans(x * w[:, None]), bm, input_precision=DOT_PRECISION)
    tl.store(p_s, s.to(pool_ptr.dtype.element_ty), mask=mask_p[:, None] & mask_n[None, :])  # one rounding


def ssd_varlen_chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    D: torch.Tensor,
    ssm_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    has_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    chunk: int = 32,
    block_p: int = 32,
    num_warps: int = 8,
) -> torch.Tensor:
    """ssd_varlen's result (the same arguments) in chunks of `chunk` tokens: four small matrix products
    a chunk instead of `chunk` dependent steps. chunk and block_p are powers of two of at least 16 (the
    tensor-core tile); 16-bit inputs multiply in tf32, float32 ones in full float32. The defaults compile
    for sm_90 without spills at d_state 128 (a [32, 128] float32 state tile, B and C chunks of the same
    size: 64-token chunks or 4 warps spill; tests/test_kernels_mamba2_sm90.py)."""
    if chunk < 16 or chunk & (chunk - 1) or block_p < 16 or block_p & (block_p - 1):
        raise ValueError(f"chunk ({chunk}) and block_p ({block_p}) must be powers of two, at least 16")
    t, h, p = x.shape
    n, g, d_state, limited = check_inputs(
        x, dt, B, C, A_log, dt_bias, D, ssm_pool, slot_ids, has_state, cu_seqlens, dt_limit
    )
    lo, hi = dt_limit
    y = torch.empty(t, h, p, dtype=x.dtype, device=x.device)
    if n and t:
        block_p = min(block_p, max(16, triton.next_power_of_2(p)))
        _ssd_chunked_kernel[(n, h, triton.cdiv(p, block_p))](
            x, dt, B, C, A_log, dt_bias, D, ssm_pool, slot_ids, has_state, cu_seqlens, y,
            x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1), C.stride(0), C.stride(1),
            y.stride(0), y.stride(1), ssm_pool.stride(0), float(lo), float(hi) if limited else 0.0,
            R=h // g, P=p, N=d_state, L=chunk, BLOCK_P=block_p, BLOCK_N=max(16, triton.next_power_of_2(d_state)),
            DT_LIMIT=limited, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=num_warps,
            num_stages=1,
        )  # fmt: skip
    return y
