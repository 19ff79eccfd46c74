"""Latent attention's prefill (MLA, attention/mla.py's decompressed form) in Triton: a varlen causal flash
attention over the keys and values decompressed from every prefill request's cached rows, gathered by
kernels/latent_gather.py. attention/mla_prefill.py runs the two with the decompression (one GEMM
through kv_b_proj's weight) between them; the reference is latent_prefill_ref in attention/mla.py.

mla_prefill_attention: request first_req + i owns query rows query_start_loc[first_req + i] .. [+ 1]
(q_len of them, the last q_len positions of its L = kv_loc[i + 1] - kv_loc[i] keys), so query row j
sits at position L - q_len + j and sees keys 0 .. that position. Per head h:

    s = scale * (q_nope[h] . k_nope[h] + q_pe[h] . k_pe)     (k_pe: one rotated key for every head)
    o[h] = softmax(s) @ v[h]                                (v's width Dv need not equal Dn + P)

The two dots accumulate into one score tile, so the query and key never need concatenating (192 wide
at DeepSeek's 128 + 64, not a power of two); each part's width is padded to a power of two with masks
(GLM-4.7-Flash: Dn 192, Dv 256). k_nope and v are strided views ([L, H, D] with any row and head
strides: both halves of one GEMM's output), k_pe a strided [L, P] view of the gathered rows.

    grid = (num_query_tiles, num_heads)

Query tiles never straddle requests; they are numbered without a host plan as paged_prefill.py does
(request i's tiles start at (query_start_loc[first + i] - query_start_loc[first]) // BLOCK_M + i, a
binary search finds a program's request, tiles past a request's rows exit). Tiles vary fastest, so the
programs running together mostly read the same head's keys (through L2). Key tiles before a query
tile's first position run unmasked; only the diagonal ones apply the causal mask. Online softmax in
fp32 in the log2 domain, fp32 accumulation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class MlaPrefillConfig:
    """Tiles of mla_prefill_attention. Defaults from default_mla_prefill_config; compiled for sm_90 on the
    CPU (tests/test_kernels_mla_prefill_sm90.py: no spills, shared memory within the limit), timed on a
    GPU by bench/mla_prefill_gpu.py."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3


def default_mla_prefill_config(nope: int, rope: int, v_dim: int) -> MlaPrefillConfig:
    """DeepSeek's 128 + 64 keys and 128-wide values: 128 x 64 tiles on 8 warps, three stages (a [128, 128]
    fp32 accumulator is 64 values a thread), the fastest of bench/mla_prefill_gpu.py's four on an H200
    (session J: 1.05-1.25x the 64 x 64 / 4-warp tiles, 16 x 512 and 4 x 2,048-after-2,048 tokens, bf16
    and e4m3 caches). Wider heads (GLM-4.7-Flash's 192 + 64 keys,
    256-wide values): 64 x 32 tiles on 8 warps, two stages keep the accumulator at 64 values a thread
    (183 registers, 112 KB). The rope width only pads the score dots; it does not change the choice."""
    if max(triton.next_power_of_2(nope), triton.next_power_of_2(v_dim)) <= 128:
        return MlaPrefillConfig(128, 64, 8, 3)
    return MlaPrefillConfig(64, 32, 8, 2)


@triton.jit
def _load(ptrs, mask, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(ptrs, mask=mask, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _attend_tile(
    q_nope,
    q_pe,
    acc,
    m_i,
    l_i,
    n0,
    kn_base,  # this request's and head's k_nope row 0
    kp_base,  # this request's k_pe row 0
    v_base,  # this request's and head's v row 0
    stride_knl,
    stride_kpl,
    stride_vl,
    pos,  # [BLOCK_M] each query row's position
    kv_end,  # keys from kv_end on are masked (CAUSAL tiles only)
    qk_scale,
    NOPE: tl.constexpr,
    ROPE: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_NOPE: tl.constexpr,
    BLOCK_ROPE: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step over keys n0 .. n0 + BLOCK_N (CAUSAL: the diagonal, masked by position;
    otherwise every key of the tile exists and every row sees it)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < kv_end
    offs_dn = tl.arange(0, BLOCK_NOPE)
    offs_p = tl.arange(0, BLOCK_ROPE)
    offs_v = tl.arange(0, BLOCK_V)
    rows = offs_n.to(tl.int64)
    kn = _load(
        kn_base + rows[:, None] * stride_knl + offs_dn[None, :],
        n_mask[:, None] & (offs_dn < NOPE)[None, :],
        CAUSAL or BLOCK_NOPE != NOPE,
    )
    kp = _load(
        kp_base + rows[:, None] * stride_kpl + offs_p[None, :],
        n_mask[:, None] & (offs_p < ROPE)[None, :],
        CAUSAL or BLOCK_ROPE != ROPE,
    )
    s = tl.dot(q_nope, tl.trans(kn), input_precision=DOT_PRECISION)
    s = tl.dot(q_pe, tl.trans(kp), acc=s, input_precision=DOT_PRECISION) * qk_scale
    if CAUSAL:
        s = tl.where(offs_n[None, :] <= pos[:, None], s, float("-inf"))
    # Every row sees key 0 and the walk starts there, so m_new is finite from the first tile on.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load(
        v_base + rows[:, None] * stride_vl + offs_v[None, :],
        n_mask[:, None] & (offs_v < V_DIM)[None, :],
        CAUSAL or BLOCK_V != V_DIM,
    )
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


# The counts change every step; specializing on them would compile a new variant mid-run (as in
# paged_prefill.py).
@triton.jit(do_not_specialize=["first_req", "num_reqs", "search_steps"])
def _mla_prefill_kernel(
    q_nope_ptr,  # [T, H, NOPE]
    q_pe_ptr,  # [T, H, ROPE]
    k_nope_ptr,  # [sum L, H, NOPE]
    k_pe_ptr,  # [sum L, ROPE]
    v_ptr,  # [sum L, H, V_DIM]
    out_ptr,  # [T, H, V_DIM]
    query_start_loc_ptr,  # the batch's [num_reqs_all + 1] int32
    kv_loc_ptr,  # [num_reqs + 1] int32: request first_req + i's keys are rows kv_loc[i] .. kv_loc[i + 1]
    qk_scale,  # softmax scale * log2(e)
    first_req,
    num_reqs,
    search_steps,  # ceil(log2(num_reqs + 1))
    stride_qnt,
    stride_qnh,
    stride_qpt,
    stride_qph,
    stride_knl,
    stride_knh,
    stride_kpl,
    stride_vl,
    stride_vh,
    stride_ot,
    stride_oh,
    NOPE: tl.constexpr,
    ROPE: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_NOPE: tl.constexpr,
    BLOCK_ROPE: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Launch the tiles in reverse: each request's last tiles see the most keys, start them first.
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    h = tl.program_id(1)

    # Largest i in [0, num_reqs) with base_i <= tile (base_0 == 0, so i >= 0).
    first_row = tl.load(query_start_loc_ptr + first_req)
    lo = tl.full([], 0, tl.int32)
    hi = lo + num_reqs
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        base_mid = (tl.load(query_start_loc_ptr + first_req + mid) - first_row) // BLOCK_M + mid
        go = (base_mid <= tile) & (lo < hi)
        lo = tl.where(go, mid + 1, lo)
        hi = tl.where(go | (lo >= hi), hi, mid)
    i = lo - 1
    q_start = tl.load(query_start_loc_ptr + first_req + i)
    q_len = tl.load(query_start_loc_ptr + first_req + i + 1) - q_start
    m0 = (tile - ((q_start - first_row) // BLOCK_M + i)) * BLOCK_M
    if m0 >= q_len:
        return
    kv_start = tl.load(kv_loc_ptr + i)
    ctx_start = tl.load(kv_loc_ptr + i + 1) - kv_start - q_len  # the chunk's first row's position

    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < q_len
    rows = (q_start + offs_m).to(tl.int64)
    offs_dn = tl.arange(0, BLOCK_NOPE)
    offs_p = tl.arange(0, BLOCK_ROPE)
    q_nope = tl.load(
        q_nope_ptr + rows[:, None] * stride_qnt + h * stride_qnh + offs_dn[None, :],
        mask=m_mask[:, None] & (offs_dn < NOPE)[None, :],
        other=0.0,
    )
    q_pe = tl.load(
        q_pe_ptr + rows[:, None] * stride_qpt + h * stride_qph + offs_p[None, :],
        mask=m_mask[:, None] & (offs_p < ROPE)[None, :],
        other=0.0,
    )
    pos = ctx_start + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)
    first_key = kv_start.to(tl.int64)
    kn_base = k_nope_ptr + first_key * stride_knl + h * stride_knh
    kp_base = k_pe_ptr + first_key * stride_kpl
    v_base = v_ptr + first_key * stride_vl + h * stride_vh

    # Keys below full_end are visible to every row of the tile; from kv_end on to none of them.
    #   keys  0 ............................ full_end ........... kv_end
    #         [ unmasked tiles               ] [ diagonal, masked ]
    full_end = (ctx_start + m0 + 1) // BLOCK_N * BLOCK_N
    kv_end = ctx_start + tl.minimum(m0 + BLOCK_M, q_len)
    for n0 in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q_nope, q_pe, acc, m_i, l_i, n0, kn_base, kp_base, v_base, stride_knl, stride_kpl, stride_vl,
            pos, kv_end, qk_scale, NOPE, ROPE, V_DIM, BLOCK_NOPE, BLOCK_ROPE, BLOCK_V, BLOCK_N, False,
            DOT_PRECISION,
        )  # fmt: skip
    for n0 in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q_nope, q_pe, acc, m_i, l_i, n0, kn_base, kp_base, v_base, stride_knl, stride_kpl, stride_vl,
            pos, kv_end, qk_scale, NOPE, ROPE, V_DIM, BLOCK_NOPE, BLOCK_ROPE, BLOCK_V, BLOCK_N, True,
            DOT_PRECISION,
        )  # fmt: skip

    out = acc / l_i[:, None]
    offs_v = tl.arange(0, BLOCK_V)
    dst = out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_v[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & (offs_v < V_DIM)[None, :])


def mla_prefill_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    v: torch.Tensor,
    query_start_loc: torch.Tensor,
    kv_loc: torch.Tensor,
    first_req: int,
    num_reqs: int,
    num_rows: int,
    scale: float,
    out: torch.Tensor,
    config: MlaPrefillConfig | None = None,
) -> torch.Tensor:
    """Causal attention of requests first_req .. first_req + num_reqs - 1 (their query rows by
    query_start_loc, int32 on the device) over their keys (rows kv_loc[i] .. kv_loc[i + 1] of k_nope,
    k_pe and v; kv_loc int32 [num_reqs + 1] on the device), into their rows of out; other rows of out are
    not written. q_nope [T, H, Dn], q_pe [T, H, P], k_nope [L, H, Dn], k_pe [L, P], v [L, H, Dv],
    out [T, H, Dv]: one dtype, unit stride along the last dimension, any other strides. num_rows: an
    upper bound on those requests' query rows (it sizes the grid). A request's query rows must not
    outnumber its keys (its chunk is in the cache already). Returns out."""
    t, heads, nope = q_nope.shape
    rope, v_dim = q_pe.shape[-1], v.shape[-1]
    keys = k_nope.shape[0]
    shapes = {
        "q_pe": (q_pe, (t, heads, rope)),
        "k_nope": (k_nope, (keys, heads, nope)),
        "k_pe": (k_pe, (keys, rope)),
        "v": (v, (keys, heads, v_dim)),
        "out": (out, (t, heads, v_dim)),
    }
    for name, (x, shape) in shapes.items():
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} {tuple(x.shape)} should be {shape} (q_nope {tuple(q_nope.shape)})")
        if x.dtype != q_nope.dtype or x.device != q_nope.device:
            raise ValueError(f"{name} is {x.dtype} on {x.device}, q_nope {q_nope.dtype} on {q_nope.device}")
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride along its last dimension")
    if q_nope.stride(-1) != 1:
        raise ValueError("q_nope must have unit stride along its last dimension")
    for name, x in (("query_start_loc", query_start_loc), ("kv_loc", kv_loc)):
        if x.dtype != torch.int32 or x.stride(-1) != 1 or x.device != q_nope.device:
            raise ValueError(f"{name} must be int32 with unit last stride on q's device")
    if kv_loc.shape[0] != num_reqs + 1 or query_start_loc.shape[0] < first_req + num_reqs + 1:
        raise ValueError(f"kv_loc and query_start_loc must cover requests {first_req} .. +{num_reqs}")
    if min(nope, rope, v_dim) < 1:
        raise ValueError(f"widths {nope} + {rope} and {v_dim} must be positive")
    cfg = config or default_mla_prefill_config(nope, rope, v_dim)
    if num_reqs <= 0 or num_rows <= 0:
        return out
    num_tiles = triton.cdiv(num_rows, cfg.block_m) + num_reqs
    _mla_prefill_kernel[(num_tiles, heads)](
        q_nope,
        q_pe,
        k_nope,
        k_pe,
        v,
        out,
        query_start_loc,
        kv_loc,
        scale * LOG2E,
        first_req,
        num_reqs,
        max(1, math.ceil(math.log2(num_reqs + 1))),
        q_nope.stride(0),
        q_nope.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        k_nope.stride(0),
        k_nope.stride(1),
        k_pe.stride(0),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        NOPE=nope,
        ROPE=rope,
        V_DIM=v_dim,
        BLOCK_NOPE=max(16, triton.next_power_of_2(nope)),
        BLOCK_ROPE=max(16, triton.next_power_of_2(rope)),
        BLOCK_V=max(16, triton.next_power_of_2(v_dim)),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        DOT_PRECISION="ieee" if q_nope.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
