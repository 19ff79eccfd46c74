"""The recurrent form of a Gated DeltaNet layer on the GPU, states updated in place in the pool: the decode
step (one token per sequence) and its varlen form (whole prompts, token by token: prefill without
fla-core).

References: causal_conv1d_step_ref, gdn_gates and recurrent_gated_delta_rule_ref in
overnight/layers/gated_delta.py (the CPU path).

A decode step is two launches per layer, both reading and writing the request's slot of the state
pools directly. Qwen3.5-9B at 256 sequences holds 0.5 GB of delta-rule state per layer: these kernels
read and write it once, where the torch path's gather, elementwise passes and scatter move it about ten
times.

    conv_pool [num_slots + 1, K - 1, C]  float32     conv_step:   grid (sequence, channel block)
    ssm_pool  [num_slots + 1, Hv, dk, dv] float32,   delta_step:  grid (sequence, value head, dv block)
                                          float16 or bfloat16 (the engine's mamba_ssm_cache_dtype)
                               ^^^^^^ row-major, dv contiguous: a program owns the [dk, BLOCK_V] column
                                      block of one head, so programs never share state elements

A 16-bit ssm_pool is widened to float32 as a program loads its tile, and the tile is rounded back once,
when it is stored: once per decode step, once per sequence in the varlen form (never per token there,
nor per element of the update), so a 16-bit state costs one rounding of the state per step.

Sequence i uses slot slot_ids[i]; has_state[i] == 0 makes it start from zeros (the old slot contents
are ignored, not read: a slot is never cleared). Padding rows of a CUDA-graph batch all point at the
scratch slot with has_state 0: they race on it, which is harmless because nothing reads scratch.

The delta-rule kernel fuses what surrounds the recurrence: the q/k L2 norm (fp32, eps 1e-6), the decay
g = -exp(A_log) * softplus(a + dt_bias) and the write strength beta = sigmoid(b) (rounded to b's dtype
first, as the reference computes it in b's dtype). Head h of Hv reads q/k head h // (Hv // Hk). In its
varlen form (delta_rule_varlen) a program keeps its state tile in registers across its sequence's
tokens and stores it once at the end.

Launches depend only on shapes, strides and pointers (no host reads of device values): decode steps
capture into CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

L2_EPS = 1e-6  # the q/k L2 norm's eps (layers/gated_delta.py's L2_EPS; kernels import nothing of ours)


@triton.jit
def _conv_step_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    pool_ptr,
    slot_ptr,
    has_ptr,
    out_ptr,
    stride_x,
    stride_o,
    stride_ps,
    C: tl.constexpr,
    K: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
):
    n = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = offs_c < C
    slot = tl.load(slot_ptr + n).to(tl.int64)
    # without a state the old contents are not even read (they may be garbage); a vector for the mask
    keep = tl.load(has_ptr + n + 0 * offs_c) != 0
    state = pool_ptr + slot * stride_ps
    x = tl.load(x_ptr + n.to(tl.int64) * stride_x + offs_c, mask=mask, other=0.0)
    wdt = w_ptr.dtype.element_ty
    # window = [state rows 0 .. K-2, x]; taps in the weight's dtype, as the reference's conv1d
    acc = tl.load(w_ptr + offs_c * K + (K - 1), mask=mask, other=0.0).to(tl.float32) * x.to(wdt).to(
        tl.float32
    )
    for j in tl.static_range(K - 1):
        s = tl.load(state + j * C + offs_c, mask=mask & keep, other=0.0)
        s = s.to(wdt).to(tl.float32)
        acc += tl.load(w_ptr + offs_c * K + j, mask=mask, other=0.0).to(tl.float32) * s
        if j > 0:  # shift: row j-1 takes row j (all reads of row j happen before its write below)
            tl.store(state + (j - 1) * C + offs_c, s, mask=mask)
    tl.store(state + (K - 2) * C + offs_c, x.to(wdt).to(tl.float32), mask=mask)
    if HAS_BIAS:  # Mamba2's conv bias, added before the activation
        acc += tl.load(bias_ptr + offs_c, mask=mask, other=0.0).to(tl.float32)
    acc = acc.to(wdt).to(tl.float32)
    y = acc / (1.0 + tl.exp(-acc)) if SILU else acc  # LFM2's short conv has no activation
    tl.store(out_ptr + n.to(tl.int64) * stride_o + offs_c, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def seq_rows(cu_ptr, n, VARLEN: tl.constexpr):
    """Rows bos .. eos of sequence n: cu[n] .. cu[n+1] in the varlen form, else the one row n."""
    if VARLEN:
        bos = tl.load(cu_ptr + n).to(tl.int64)
        eos = tl.load(cu_ptr + n + 1).to(tl.int64)
    else:
        bos = n
        eos = n + 1
    return bos, eos


@triton.jit
def softplus(x):
    """torch's softplus (linear past 20), in x's float32."""
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def _load_token(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, t, h, hk, offs_k, offs_v, mask_k, mask_v,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_an, stride_bn,
):  # fmt: skip
    """Row t's inputs for value head h (key head hk), in their own dtypes."""
    q = tl.load(q_ptr + t * stride_qn + hk * stride_qh + offs_k, mask=mask_k, other=0.0)
    k = tl.load(k_ptr + t * stride_kn + hk * stride_kh + offs_k, mask=mask_k, other=0.0)
    v = tl.load(v_ptr + t * stride_vn + h * stride_vh + offs_v, mask=mask_v, other=0.0)
    a = tl.load(a_ptr + t * stride_an + h)
    b = tl.load(b_ptr + t * stride_bn + h)
    return q, k, v, a, b


@triton.jit
def _delta_rule_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    a_ptr,
    b_ptr,
    A_log_ptr,
    dt_bias_ptr,
    pool_ptr,
    slot_ptr,
    has_ptr,
    cu_ptr,
    o_ptr,
    stride_qn,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_an,
    stride_bn,
    stride_on,
    stride_oh,
    stride_ps,
    scale,
    eps,
    R: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    VARLEN: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_k = tl.arange(0, BLOCK_K)
    mask_k, mask_v = offs_k < DK, offs_v < DV
    hk = h // R
    bos, eos = seq_rows(cu_ptr, n, VARLEN)

    slot = tl.load(slot_ptr + n).to(tl.int64)
    # without a state the old contents are not even read (they may be garbage); a tile for the mask
    keep = tl.load(has_ptr + n + 0 * offs_v) != 0
    p_s = pool_ptr + slot * stride_ps + h * (DK * DV) + offs_k[:, None] * DV + offs_v[None, :]
    s = tl.load(p_s, mask=mask_k[:, None] & (mask_v & keep)[None, :], other=0.0)  # [BLOCK_K, BLOCK_V]
    s = s.to(tl.float32)  # a 16-bit pool's state, widened: the recurrence runs in float32
    neg_A = -tl.exp(tl.load(A_log_ptr + h).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)

    # Software pipelining: token t+1's inputs load while token t computes (the last iteration reloads
    # its own row, which is always in bounds), so the sequential loop does not wait on memory each step.
    q_n, k_n, v_n, a_n, b_n = _load_token(
        q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, bos, h, hk, offs_k, offs_v, mask_k, mask_v,
        stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_an, stride_bn,
    )  # fmt: skip
    for t in range(bos, eos):
        q, k, v, a, b = q_n, k_n, v_n, a_n, b_n
        q_n, k_n, v_n, a_n, b_n = _load_token(
            q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, tl.minimum(t + 1, eos - 1), h, hk, offs_k, offs_v, mask_k,
            mask_v, stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_an, stride_bn,
        )  # fmt: skip
        q = q.to(tl.float32)
        k = k.to(tl.float32)
        q = q * tl.math.rsqrt(tl.sum(q * q) + eps) * scale
        k = k * tl.math.rsqrt(tl.sum(k * k) + eps)
        # g = -exp(A_log) * softplus(a + dt_bias) (torch's softplus: linear past 20); beta = sigmoid(b)
        dt = softplus(a.to(tl.float32) + dt_bias)
        beta = (1.0 / (1.0 + tl.exp(-b.to(tl.float32)))).to(b.dtype).to(tl.float32)

        s = s * tl.exp(neg_A * dt)
        r = (v.to(tl.float32) - tl.sum(s * k[:, None], axis=0)) * beta  # what S mispredicts for k
        s = s + k[:, None] * r[None, :]
        o = tl.sum(s * q[:, None], axis=0)
        tl.store(o_ptr + t * stride_on + h * stride_oh + offs_v, o.to(o_ptr.dtype.element_ty), mask=mask_v)
    tl.store(p_s, s.to(pool_ptr.dtype.element_ty), mask=mask_k[:, None] & mask_v[None, :])  # one rounding


# What each pool may hold: the conv state is always float32; the delta-rule state float32 or 16-bit.
CONV_POOL_DTYPES = (torch.float32,)
SSM_POOL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_slots(
    n: int,
    pool: torch.Tensor,
    slot_ids: torch.Tensor,
    has_state: torch.Tensor,
    dtypes: tuple[torch.dtype, ...],
) -> None:
    if pool.dtype not in dtypes or not pool.is_contiguous():
        allowed = " / ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(
            f"the state pool must be contiguous {allowed}, got {pool.dtype}"
            + ("" if pool.is_contiguous() else " (not contiguous)")
        )
    if slot_ids.shape != (n,) or slot_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_ids must be [{n}] int32/int64, got {tuple(slot_ids.shape)} {slot_ids.dtype}")
    if has_state.shape != (n,) or has_state.dtype != torch.float32:
        raise ValueError(f"has_state must be [{n}] float32, got {tuple(has_state.shape)} {has_state.dtype}")
    if not (pool.device == slot_ids.device == has_state.device):
        raise ValueError("the pool, slot_ids and has_state must be on one device")


def conv_step(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    has_state: torch.Tensor,
    block_c: int = 256,
    bias: torch.Tensor | None = None,
    silu: bool = True,
) -> torch.Tensor:
    """silu(causal depthwise conv + bias) of one token per sequence (silu False: without the
    activation, LFM2's short conv), shifting each slot's conv state in place.

    x [N, C] (unit stride along C); weight [C, K] contiguous; bias [C] contiguous or None;
    conv_pool [S, K-1, C] float32. Returns [N, C] in x's dtype."""
    n, c = x.shape
    if weight.dim() != 2 or weight.shape[0] != c or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous [{c}, K], got {tuple(weight.shape)}")
    k = weight.shape[1]
    if k < 2 or conv_pool.dim() != 3 or conv_pool.shape[1:] != (k - 1, c):
        raise ValueError(f"conv_pool must be [S, {k - 1}, {c}], got {tuple(conv_pool.shape)}")
    if x.stride(1) != 1:
        raise ValueError("x must have unit stride along channels")
    if bias is not None and (bias.shape != (c,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be contiguous [{c}], got {tuple(bias.shape)}")
    check_slots(n, conv_pool, slot_ids, has_state, CONV_POOL_DTYPES)
    out = torch.empty(n, c, dtype=x.dtype, device=x.device)
    if n:
        block_c = min(block_c, triton.next_power_of_2(c))
        _conv_step_kernel[(n, triton.cdiv(c, block_c))](
            x,
            weight,
            weight if bias is None else bias,  # unread without HAS_BIAS
            conv_pool,
            slot_ids,
            has_state,
            out,
            x.stride(0),
            out.stride(0),
            conv_pool.stride(0),
            C=c,
            K=k,
            BLOCK_C=block_c,
            HAS_BIAS=bias is not None,
            SILU=silu,
            num_warps=4,
        )
    return out


def delta_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    has_state: torch.Tensor,
    block_v: int = 32,
    num_warps: int = 4,
) -> torch.Tensor:
    """One recurrent step of the gated delta rule per sequence, each slot's state updated in place.

    q, k [N, Hk, dk]; v [N, Hv, dv] (any row/head strides, unit stride along d: views into the conv
    output); a, b [N, Hv] raw projections (unit stride along heads); A_log, dt_bias [Hv];
    ssm_pool [S, Hv, dk, dv] float32, float16 or bfloat16 (computed in float32, rounded once as each
    state is stored). Returns o [N, Hv, dv] in v's dtype."""
    return _launch(q, k, v, a, b, A_log, dt_bias, ssm_pool, slot_ids, has_state, None, block_v, num_warps)


def delta_rule_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    has_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_v: int = 32,
    num_warps: int = 4,
) -> torch.Tensor:
    """delta_step over whole sequences: sequence i is rows cu_seqlens[i] .. cu_seqlens[i+1] of the
    T-row inputs (shapes as delta_step's with T for N), run token by token from its slot's state, which
    is left there. The prefill path without fla-core: one launch for the step, no Python per token,
    but sequential within a sequence (fla's chunked form does the tokens of a chunk in parallel)."""
    return _launch(
        q, k, v, a, b, A_log, dt_bias, ssm_pool, slot_ids, has_state, cu_seqlens, block_v, num_warps
    )


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    has_state: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    block_v: int,
    num_warps: int,
) -> torch.Tensor:
    t, hk, dk = q.shape
    _, hv, dv = v.shape
    if k.shape != q.shape or v.shape[0] != t or hv % hk:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit")
    if a.shape != (t, hv) or b.shape != (t, hv) or A_log.shape != (hv,) or dt_bias.shape != (hv,):
        raise ValueError(f"a, b must be [{t}, {hv}] and A_log, dt_bias [{hv}]")
    if ssm_pool.dim() != 4 or ssm_pool.shape[1:] != (hv, dk, dv):
        raise ValueError(f"ssm_pool must be [S, {hv}, {dk}, {dv}], got {tuple(ssm_pool.shape)}")
    if any(x.stride(-1) != 1 for x in (q, k, v, a, b, A_log, dt_bias)):
        raise ValueError("q, k, v, a, b, A_log and dt_bias need unit stride along their last dimension")
    n = t if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if cu_seqlens is not None and (cu_seqlens.dim() != 1 or cu_seqlens.device != q.device):
        raise ValueError(f"cu_seqlens must be [num_seqs + 1] on {q.device}")
    check_slots(n, ssm_pool, slot_ids, has_state, SSM_POOL_DTYPES)
    o = torch.empty(t, hv, dv, dtype=v.dtype, device=v.device)
    if n and t:
        block_v = min(block_v, triton.next_power_of_2(dv))
        _delta_rule_kernel[(n, hv, triton.cdiv(dv, block_v))](
            q,
            k,
            v,
            a,
            b,
            A_log,
            dt_bias,
            ssm_pool,
            slot_ids,
            has_state,
            cu_seqlens if cu_seqlens is not None else slot_ids,  # unread without VARLEN
            o,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            a.stride(0),
            b.stride(0),
            o.stride(0),
            o.stride(1),
            ssm_pool.stride(0),
            dk**-0.5,
            L2_EPS,
            R=hv // hk,
            DK=dk,
            DV=dv,
            BLOCK_K=triton.next_power_of_2(dk),
            BLOCK_V=block_v,
            VARLEN=cu_seqlens is not None,
            num_warps=num_warps,
        )
    return o
