"""The recurrent form of a Mamba2 mixer on the GPU, states updated in place in the pool: the decode step
(the selective state update, one token per sequence) and its varlen form (whole prompts, token by token
within a sequence, every sequence and head in one launch).

References: mamba2_dt, ssd_step_ref and ssd_chunk_ref in overnight/layers/mamba2.py (the CPU path). The
causal conv before it is kernels/gated_delta_decode.py's conv_step (with the mixer's conv bias).

    ssm_pool [num_slots + 1, H, P, N]  float32, float16 or bfloat16 (mamba_ssm_cache_dtype)
                          ^^^^^^^ row-major, N (d_state) contiguous: a program owns the [BLOCK_P, N]
                                  row block of one head, so programs never share state elements
    grid (sequence, head, P block)

Per token (head h, group h // (H / G)): dt = clamp(softplus(dt_raw + dt_bias)), S <- exp(dt A) S +
dt x B^T, y = S C + D x, with A = -exp(A_log). The state tile stays in registers across a sequence's
tokens (the varlen form) and is stored once, at the end: a 16-bit pool is widened as it loads and
rounded once per step (decode) or per sequence (prefill), never per token.

Sequence i uses slot slot_ids[i]; has_state[i] == 0 makes it start from zeros (the old contents are not
read: a slot is never cleared). Padding rows of a CUDA-graph batch point at the scratch slot with
has_state 0. Launches depend only on shapes, strides and pointers (no host reads of device values):
decode steps capture into CUDA graphs.

The prefill the engine runs is kernels/mamba2_chunked.py's (the same recurrence a chunk of tokens at a
time); ssd_varlen (token by token) stays as its reference on the GPU and the benchmark's baseline.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from overnight.kernels.gated_delta_decode import SSM_POOL_DTYPES, check_slots, seq_rows, softplus


@triton.jit
def _load_token(
    x_ptr, dt_ptr, b_ptr, c_ptr, t, h, g, offs_p, offs_n, mask_p, mask_n,
    stride_xn, stride_xh, stride_dtn, stride_bn, stride_bg, stride_cn, stride_cg,
):  # fmt: skip
    """Row t's inputs for head h (group g), in their own dtypes."""
    x = tl.load(x_ptr + t * stride_xn + h * stride_xh + offs_p, mask=mask_p, other=0.0)
    bv = tl.load(b_ptr + t * stride_bn + g * stride_bg + offs_n, mask=mask_n, other=0.0)
    cv = tl.load(c_ptr + t * stride_cn + g * stride_cg + offs_n, mask=mask_n, other=0.0)
    dt = tl.load(dt_ptr + t * stride_dtn + h)
    return x, bv, cv, dt


@triton.jit
def _ssd_kernel(
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
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    VARLEN: tl.constexpr,
    DT_LIMIT: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p, mask_n = offs_p < P, offs_n < N
    g = h // R
    bos, eos = seq_rows(cu_ptr, n, VARLEN)

    slot = tl.load(slot_ptr + n).to(tl.int64)
    # without a state the old contents are not even read (they may be garbage); a tile for the mask
    keep = tl.load(has_ptr + n + 0 * offs_p) != 0
    p_s = pool_ptr + slot * stride_ps + h * (P * N) + offs_p[:, None] * N + offs_n[None, :]
    s = tl.load(p_s, mask=(mask_p & keep)[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_P, BLOCK_N]
    s = s.to(tl.float32)  # a 16-bit pool's state, widened: the recurrence runs in float32
    A = -tl.exp(tl.load(A_log_ptr + h).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    D = tl.load(D_ptr + h).to(tl.float32)

    # Software pipelining: token t+1's inputs load while token t computes (the last iteration reloads
    # its own row, which is always in bounds), so the sequential loop does not wait on memory each step.
    x_n, b_n, c_n, dt_n = _load_token(
        x_ptr, dt_ptr, b_ptr, c_ptr, bos, h, g, offs_p, offs_n, mask_p, mask_n,
        stride_xn, stride_xh, stride_dtn, stride_bn, stride_bg, stride_cn, stride_cg,
    )  # fmt: skip
    for t in range(bos, eos):
        x, bv, cv, dt = x_n.to(tl.float32), b_n.to(tl.float32), c_n.to(tl.float32), dt_n.to(tl.float32)
        x_n, b_n, c_n, dt_n = _load_token(
            x_ptr, dt_ptr, b_ptr, c_ptr, tl.minimum(t + 1, eos - 1), h, g, offs_p, offs_n, mask_p, mask_n,
            stride_xn, stride_xh, stride_dtn, stride_bn, stride_bg, stride_cn, stride_cg,
        )  # fmt: skip
        # dt = softplus(dt_raw + dt_bias) (torch's softplus: linear past 20), clamped to the limit
        dt = softplus(dt + dt_bias)
        if DT_LIMIT:
            dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
        s = s * tl.exp(dt * A) + (dt * x)[:, None] * bv[None, :]
        y = tl.sum(s * cv[None, :], axis=1) + D * x
        tl.store(y_ptr + t * stride_yn + h * stride_yh + offs_p, y.to(y_ptr.dtype.element_ty), mask=mask_p)
    tl.store(p_s, s.to(pool_ptr.dtype.element_ty), mask=mask_p[:, None] & mask_n[None, :])  # one rounding


def ssd_step(
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
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    block_p: int = 16,
    num_warps: int = 4,
) -> torch.Tensor:
    """One recurrent step of the Mamba2 SSM per sequence, each slot's state updated in place.

    x [N, H, P]; dt [N, H] the raw projection (before dt_bias and softplus); B, C [N, G, d_state]
    (any row/head strides, unit stride along the last dim: views into the conv output); A_log, dt_bias,
    D [H]; ssm_pool [S, H, P, d_state] float32, float16 or bfloat16 (computed in float32, rounded once
    as each state is stored). Returns y [N, H, P] in x's dtype (D x included, not gated)."""
    return _launch(
        x, dt, B, C, A_log, dt_bias, D, ssm_pool, slot_ids, has_state, None, dt_limit, block_p, num_warps
    )


def ssd_varlen(
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
    block_p: int = 16,
    num_warps: int = 4,
) -> torch.Tensor:
    """ssd_step over whole sequences: sequence i is rows cu_seqlens[i] .. cu_seqlens[i+1] of the T-row
    inputs (shapes as ssd_step's with T for N), run token by token from its slot's state, which is left
    there. One launch for the step, no Python per token; sequential within a sequence."""
    seqs = (slot_ids, has_state, cu_seqlens)
    return _launch(x, dt, B, C, A_log, dt_bias, D, ssm_pool, *seqs, dt_limit, block_p, num_warps)


def check_inputs(
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
    cu_seqlens: torch.Tensor | None,
    dt_limit: tuple[float, float],
) -> tuple[int, int, int, bool]:
    """ValueError naming the first input that does not fit ssd_step's / ssd_varlen's contract; else
    (sequences, groups, d_state, whether dt_limit clamps anything)."""
    t, h, p = x.shape
    _, g, d_state = B.shape
    if B.shape[0] != t or C.shape != B.shape or h % g:
        raise ValueError(f"x {tuple(x.shape)}, B {tuple(B.shape)}, C {tuple(C.shape)} do not fit")
    if dt.shape != (t, h) or A_log.shape != (h,) or dt_bias.shape != (h,) or D.shape != (h,):
        raise ValueError(f"dt must be [{t}, {h}] and A_log, dt_bias, D [{h}]")
    if ssm_pool.dim() != 4 or ssm_pool.shape[1:] != (h, p, d_state):
        raise ValueError(f"ssm_pool must be [S, {h}, {p}, {d_state}], got {tuple(ssm_pool.shape)}")
    if any(m.stride(-1) != 1 for m in (x, dt, B, C, A_log, dt_bias, D)):
        raise ValueError("x, dt, B, C, A_log, dt_bias and D need unit stride along their last dimension")
    n = t if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if cu_seqlens is not None and (cu_seqlens.dim() != 1 or cu_seqlens.device != x.device):
        raise ValueError(f"cu_seqlens must be [num_seqs + 1] on {x.device}")
    check_slots(n, ssm_pool, slot_ids, has_state, SSM_POOL_DTYPES)
    lo, hi = dt_limit
    return n, g, d_state, lo > 0.0 or hi != float("inf")


def _launch(
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
    cu_seqlens: torch.Tensor | None,
    dt_limit: tuple[float, float],
    block_p: int,
    num_warps: int,
) -> torch.Tensor:
    t, h, p = x.shape
    n, g, d_state, limited = check_inputs(
        x, dt, B, C, A_log, dt_bias, D, ssm_pool, slot_ids, has_state, cu_seqlens, dt_limit
    )
    lo, hi = dt_limit
    y = torch.empty(t, h, p, dtype=x.dtype, device=x.device)
    if n and t:
        block_p = min(block_p, triton.next_power_of_2(p))
        _ssd_kernel[(n, h, triton.cdiv(p, block_p))](
            x,
            dt,
            B,
            C,
            A_log,
            dt_bias,
            D,
            ssm_pool,
            slot_ids,
            has_state,
            cu_seqlens if cu_seqlens is not None else slot_ids,  # unread without VARLEN
            y,
            x.stride(0),
            x.stride(1),
            dt.stride(0),
            B.stride(0),
            B.stride(1),
            C.stride(0),
            C.stride(1),
            y.stride(0),
            y.stride(1),
            ssm_pool.stride(0),
            float(lo),
            float(hi) if limited else 0.0,
            R=h // g,
            P=p,
            N=d_state,
            BLOCK_P=block_p,
            BLOCK_N=triton.next_power_of_2(d_state),
            VARLEN=cu_seqlens is not None,
            DT_LIMIT=limited,
            num_warps=num_warps,
        )
    return y
