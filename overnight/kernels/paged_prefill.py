"""Paged causal attention for prefill chunks (varlen; chunked prefill and prefix-cache hits included).

Reference: the prefill loop of paged_attention_ref in overnight/attention/torch_backend.py.

Request i (num_decodes <= i < num_reqs) owns query rows query_start_loc[i] .. query_start_loc[i+1]; its
q_len rows are the last q_len positions of its seq_len-token context, whose K/V (this chunk's included)
are already in the paged cache. Row j sits at position seq_len - q_len + j and sees keys 0 .. that position.

    grid = (num_q_heads, num_query_tiles)

A program computes one BLOCK_M x D tile of one query head (heads vary fastest, so the programs sharing
a KV head run side by side and reuse its K/V through L2). Query tiles never straddle requests. Tile
numbering needs no host plan: request i's tiles start at

    base_i = (query_start_loc[i] - query_start_loc[num_decodes]) // BLOCK_M + (i - num_decodes)

which increases by at least the request's tile count from one request to the next, so
num_query_tiles = ceil(prefill_rows / BLOCK_M) + num_prefills covers every tile; a program finds its
request by binary search over base_i and exits if its tile lies past the request's rows.

Keys are walked in BLOCK_N tiles through the block table. Key tiles below the tile's first query
position are visible to every row and run unmasked; only the diagonal tiles apply the causal mask, and
tiles past the last row's position are never visited.

Key limits (HAS_KEY_LIMIT, constexpr: the causal build is unchanged): each row reads its last visible
key from key_limit (the tokens of one image attend to each other both ways, Gemma 3); the diagonal run
extends to the tile's furthest limit and masks by limit instead of position. A window still counts back
from the row's own position.

A layer's variant (score_mods.py, constexpr-selected: full attention compiles as before). With a window
of W tokens row p sees keys p - W + 1 .. p: a query tile walks only from the first key any of its rows
sees, in three runs (edge tiles masked by the window, tiles every row sees unmasked, the causal
diagonal), so a windowed layer's prefill costs about chunk_len * min(W + BLOCK_M, context) scores
instead of chunk_len * context. Keys before every row's window are never loaded (their blocks may be
given back); an edge tile's FP8 V is then loaded with a token mask. A softcap adds a tanh per score;
sinks start each row's online softmax from its head's sink logit. An attention chunk of C tokens
(Llama 4) bounds each row from below by its chunk's start, floor(p / C) * C, and takes the window's
three runs (a tile may straddle a chunk boundary: its rows then see different first keys); both bounds
together take the larger. Heads wider than 128 take smaller default tiles and 8 warps
(default_prefill_config). None of these was timed on the GPU yet.

FP8 cache: as in paged_decode.py, the scales are read from a device pointer (k_scale folds into the
score scale, v_scale into the final normalization) and V is read token-major (kv_layout.py). By default
(PrefillConfig.fp8_mma, default_prefill_config) the dots read the e4m3 tiles as stored: q is rounded to
e4m3 once per program (each row with its own scale) and P per key tile (after a 2**8 shift), the
roundings of paged_decode_fp8.py; prefill_fp8_mma_ref (attention_fp8_ref.py) emulates them. Without it
the tiles are converted and the dots run in fp16 (dot_dtype).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from overnight.kernels.kv_layout import is_fp8, v_token_major
from overnight.kernels.kv_tiles import load_v_token_major, page_ids
from overnight.kernels.kv_write import check_kv_cache, check_kv_scale
from overnight.kernels.paged_decode import dot_dtype
from overnight.kernels.paged_decode_fp8 import P_SHIFT, Q_MAX, to_e4m3
from overnight.kernels.score_mods import (
    check_head_dim,
    check_sinks,
    chunk_constexpr,
    gpu_dot_refusal,
    layer_constexprs,
    sink_init,
    softcap,
)


@dataclass(frozen=True)
class PrefillConfig:
    # The H200 bench's winner in two runs (bench/kernels_gpu.py).
    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    # Load the next key tile's page ids one iteration ahead in the loop over fully visible key tiles
    # (kv_tiles.py: the pipeliner then keeps num_stages - 1 K/V tiles in flight). On by default: on the
    # H200, 16 x 1024 query tokens after a 512-token prefix, 799 vs 902 us (bf16) and 1180 vs 1247 us (FP8
    # cache) at these tiles (bench/attention_gpu.py).
    prefetch_pages: bool = True
    # FP8 cache only: both dots on the 8-bit values as stored (Hopper's warpgroup MMA reads e4m3 from
    # shared memory when M is a multiple of 64), q rounded to e4m3 per row and P per tile, as the FP8
    # decode kernel does (paged_decode_fp8.py) and FlashAttention-3's FP8 path does. The fp16 path
    # converts every K and V tile once per query head and query tile: on the H200, 16 x 1024 query
    # tokens after a 512-token prefix took 1,180 us that way and 835 us with e4m3 dots (bench/attention_gpu.py).
    # default_prefill_config turns it on for e4m3 caches.
    fp8_mma: bool = False


def default_prefill_config(cache_dtype: torch.dtype, head_dim: int = 128) -> PrefillConfig:
    """e5m2 caches keep the fp16 dots until the H200 bench has checked e4m3 q against e5m2 K there
    (bench/attention_gpu.py's prefill checks now include them; the interpreter tests pass).

    Heads wider than 128: a program holds a [BLOCK_M, D] fp32 accumulator and its q tile in registers,
    and num_stages K and V tiles of [BLOCK_N, D] in shared memory. At D = 256 (Gemma) 64 x 32 tiles
    on 8 warps keep 64 accumulator values per thread; at D = 512 (Gemma 4's global layers) 32 x 32
    tiles do the same, with the fp16 dots (the e4m3 warpgroup MMA wants 64 rows). Compiled for sm_90
    on the CPU (ptxas, no GPU; tests/test_kernels_attention_sm90.py) with windows, softcaps and sinks
    on: no spills, 197-244 registers, shared memory 131 / 100 KB (bf16 at 256 / 512), 64 / 66 KB (FP8).
    Not yet timed on a GPU (bench/attention_gpu.py can)."""
    fp8_mma = cache_dtype == torch.float8_e4m3fn
    d = triton.next_power_of_2(head_dim)
    if d <= 128:
        return PrefillConfig(fp8_mma=fp8_mma)
    if d <= 256:
        return PrefillConfig(64, 32, 8, 3, fp8_mma=fp8_mma)
    return PrefillConfig(32, 32, 8, 2)


@triton.jit
def _load(ptrs, mask, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(ptrs, mask=mask, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _attend_tile(
    q,
    acc,
    m_i,
    l_i,
    n0,
    page,  # int64 [BLOCK_N]: physical page of each key (page_ids)
    kv_base,
    v_base,  # token-major V of this head (kv_layout.py), used when V_TOKEN_MAJOR
    stride_ckv,
    stride_cblk,
    stride_cslot,
    pos,
    limit,  # [BLOCK_M] the last key each row sees: pos (causal), or further with key limits
    kv_lo,  # the first key any row of the tile sees (0 without a window)
    kv_end,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    V_TOKEN_MAJOR: tl.constexpr,
    V_RUN: tl.constexpr,
    FP8_MMA: tl.constexpr,
    EXACT_CAST: tl.constexpr,
    P_SHIFT: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """One online-softmax step over keys n0 .. n0 + BLOCK_N (masked by position when CAUSAL: the
    causal diagonal, and with a WINDOW or a CHUNK each row's lower edge).

    FP8_MMA: q is e4m3 already and qk_scale a [BLOCK_M, 1] column (each row's q scale folded in); the
    weights are scaled by 2**P_SHIFT before their rounding to e4m3, and l_i carries the same factor, so
    it cancels in acc / l_i."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_mask = offs_n < kv_end
    if CAUSAL and (WINDOW > 0 or CHUNK > 0):  # keys before every row's bound are not loaded
        n_mask = n_mask & (offs_n >= kv_lo)
    kv_mask = n_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    # Off the diagonal every key exists: load without masks unless head_dim needs padding.
    MASKED: tl.constexpr = CAUSAL or BLOCK_D != HEAD_DIM
    tok = page * stride_cblk + (offs_n % PAGE) * stride_cslot
    k = _load(kv_base + tok[:, None] + offs_d[None, :], kv_mask, MASKED)
    if FP8_MMA:
        s = tl.dot(q, tl.trans(k)) * qk_scale
    else:
        s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION) * qk_scale
    if SOFTCAP > 0:
        s = softcap(s, SOFTCAP)
    if CAUSAL:
        visible = offs_n[None, :] <= limit[:, None]
        if WINDOW > 0:
            visible = visible & (offs_n[None, :] > pos[:, None] - WINDOW)
        if CHUNK > 0:  # the row's own chunk only
            visible = visible & (offs_n[None, :] >= (pos // CHUNK * CHUNK)[:, None])
        s = tl.where(visible, s, float("-inf"))
    # Without a window every row sees key 0, and the first visited tile holds a key <= every row's
    # position, so m_new is finite from the first tile on and exp2(-inf - m_new) is a clean 0. A
    # window's (or chunk's) edge tile may hold no key of some row: its maximum stays -inf, and exp2 is
    # taken against 0 instead (weights 0, acc and l_i unchanged at 0).
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if CAUSAL and (WINDOW > 0 or CHUNK > 0):
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    if FP8_MMA:
        p = tl.exp2(s - (m_use - P_SHIFT)[:, None])
    else:
        p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if V_TOKEN_MAJOR:  # unmasked along tokens (p is 0 past kv_end), except at a window's edge
        v = load_v_token_major(
            v_base,
            page,
            offs_n,
            offs_d,
            stride_cblk,
            HEAD_DIM,
            BLOCK_D,
            PAGE,
            V_RUN,
            n_mask,
            CAUSAL and (WINDOW > 0 or CHUNK > 0),
        )
    else:
        v = _load(kv_base + stride_ckv + tok[:, None] + offs_d[None, :], kv_mask, MASKED)
    if FP8_MMA:
        acc = acc * alpha[:, None] + tl.dot(to_e4m3(p, EXACT_CAST), v)
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    return acc, m_new, l_i


# The counts change every step; specializing on them (== 1, multiple of 16) would compile a new variant
# in the middle of a run whenever a step brings a new combination (seconds each, the GPU idle meanwhile).
@triton.jit(do_not_specialize=["num_decodes", "num_prefills", "search_steps"])
def _prefill_kernel(
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    kv_scale_ptr,  # [2] float32 (k_scale, v_scale), read when HAS_SCALE
    sinks_ptr,  # [Hq] float32 sink logits, read when HAS_SINKS
    key_limit_ptr,  # [T] int32 last visible key per row, read when HAS_KEY_LIMIT
    qk_scale,  # softmax scale * log2(e)
    num_decodes,
    num_prefills,
    search_steps,  # ceil(log2(num_prefills + 1))
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_ckv,
    stride_cblk,
    stride_cslot,
    stride_ch,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    V_TOKEN_MAJOR: tl.constexpr,  # an fp8 cache: V stored [Hkv, D, PAGE] per block (kv_layout.py)
    V_RUN: tl.constexpr,  # min(PAGE, BLOCK_N)
    PREFETCH_PAGES: tl.constexpr,  # PrefillConfig.prefetch_pages
    FP8_MMA: tl.constexpr,  # PrefillConfig.fp8_mma (an FP8 cache)
    EXACT_CAST: tl.constexpr,  # under the interpreter (paged_decode_fp8.to_e4m3)
    Q_MAX: tl.constexpr,
    P_SHIFT: tl.constexpr,
    WINDOW: tl.constexpr,  # sliding window in tokens, 0: none (score_mods.py)
    SOFTCAP: tl.constexpr,  # logit softcap in log2 units, 0.0: none
    HAS_SINKS: tl.constexpr,
    HAS_KEY_LIMIT: tl.constexpr,  # per-row key limits (images attending both ways), else causal
    CHUNK: tl.constexpr,  # attention chunk in tokens, 0: none (score_mods.py)
):
    h = tl.program_id(0)
    # Launch the tiles in reverse: the last tiles of each request see the most keys, start them first.
    tile = tl.num_programs(1) - 1 - tl.program_id(1)

    # Largest i in [0, num_prefills) with base_i <= tile (base_0 == 0, so i >= 0).
    first_row = tl.load(query_start_loc_ptr + num_decodes)
    lo = tl.full([], 0, tl.int32)
    hi = lo + num_prefills
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        base_mid = (tl.load(query_start_loc_ptr + num_decodes + mid) - first_row) // BLOCK_M + mid
        go = (base_mid <= tile) & (lo < hi)
        lo = tl.where(go, mid + 1, lo)
        hi = tl.where(go | (lo >= hi), hi, mid)
    i = lo - 1
    req = num_decodes + i
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    m0 = (tile - ((q_start - first_row) // BLOCK_M + i)) * BLOCK_M
    if m0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_start = seq_len - q_len  # absolute position of the chunk's first row

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    io_mask = (offs_m < q_len)[:, None] & (offs_d < HEAD_DIM)[None, :]
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=io_mask, other=0.0)
    pos = ctx_start + offs_m
    if HAS_SCALE:
        qk_scale = qk_scale * tl.load(kv_scale_ptr)
        v_scale = tl.load(kv_scale_ptr + 1)
    else:
        v_scale = 1.0
    if FP8_MMA:  # each row's largest |q| maps to e4m3's largest value; padding rows keep scale 1
        q = q.to(tl.float32)
        amax = tl.max(tl.abs(q), 1)
        q_scale = tl.where(amax > 0.0, amax / Q_MAX, 1.0)
        q = to_e4m3(q / q_scale[:, None], EXACT_CAST)
        row_scale = (q_scale * qk_scale)[:, None]
    else:
        q = q.to(DOT_DTYPE)
        row_scale = qk_scale

    # With sinks the softmax starts from the head's sink logit (FP8_MMA: l_i carries 2**P_SHIFT).
    m_i, l_i = sink_init(sinks_ptr, h, h < tl.num_programs(0), BLOCK_M, HAS_SINKS)
    if FP8_MMA:
        l_i = l_i * tl.exp2(tl.zeros_like(l_i) + P_SHIFT)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + req.to(tl.int64) * stride_bt
    kv_base = cache_ptr + (h // GROUP) * stride_ch
    v_base = cache_ptr + stride_ckv + (h // GROUP) * (HEAD_DIM * PAGE)

    # Keys below full_end are visible to all rows of the tile; keys from kv_end on to none of them.
    # With a window, keys from mid_start on are above every row's window edge: the tiles before it
    # (from the first key any row sees, kv_lo) take the window's mask, those in [mid_start, full_end)
    # none, those after full_end the causal one.
    #
    #   keys  0 ..... kv_lo ..... mid_start ............. full_end ....... kv_end
    #         never read  [ edge tiles ]  [ unmasked tiles  ]  [ diagonal ]
    full_end = (ctx_start + m0 + 1) // BLOCK_N * BLOCK_N
    kv_end = ctx_start + tl.minimum(m0 + BLOCK_M, q_len)
    # Key limits: a row may see past its own position, up to its image's end (in this chunk, so
    # below seq_len); the diagonal run then reaches vis_end, the tile's furthest limit, masked by each
    # row's limit. Limits below a row's position are raised to it (never less than causal).
    if HAS_KEY_LIMIT:
        limit = tl.load(key_limit_ptr + rows, mask=offs_m < q_len, other=0)
        limit = tl.minimum(tl.maximum(limit, pos), seq_len - 1)
        vis_end = tl.maximum(kv_end, tl.max(tl.where(offs_m < q_len, limit, 0), 0) + 1)
    else:
        limit = pos
        vis_end = kv_end
    if WINDOW > 0 or CHUNK > 0:
        # Row bounds rise with the row: the tile's first row has the lowest (kv_lo), its last the
        # highest, from which on every row sees every key (mid_start, rounded up to a tile).
        if WINDOW > 0:
            kv_lo = tl.maximum(ctx_start + m0 - WINDOW + 1, 0)
            last_lo = tl.maximum(kv_end - WINDOW, 0)
        else:
            kv_lo = ctx_start * 0
            last_lo = ctx_start * 0
        if CHUNK > 0:  # a chunk boundary inside the tile: its later rows see only keys from it on
            kv_lo = tl.maximum(kv_lo, (ctx_start + m0) // CHUNK * CHUNK)
            last_lo = tl.maximum(last_lo, (kv_end - 1) // CHUNK * CHUNK)
        mid_start = tl.cdiv(last_lo, BLOCK_N) * BLOCK_N
        for n0 in range(kv_lo // BLOCK_N * BLOCK_N, tl.minimum(mid_start, kv_end), BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                q,
                acc,
                m_i,
                l_i,
                n0,
                page_ids(bt_row, n0, vis_end, BLOCK_N, PAGE).to(tl.int64),
                kv_base,
                v_base,
                stride_ckv,
                stride_cblk,
                stride_cslot,
                pos,
                limit,
                kv_lo,
                vis_end,
                row_scale,
                HEAD_DIM,
                BLOCK_D,
                PAGE,
                BLOCK_N,
                True,
                DOT_PRECISION,
                DOT_DTYPE,
                V_TOKEN_MAJOR,
                V_RUN,
                FP8_MMA,
                EXACT_CAST,
                P_SHIFT,
                WINDOW,
                SOFTCAP,
                CHUNK,
            )
        diag_start = tl.maximum(full_end, mid_start)
    else:  # full attention: the walk from key 0 the kernel had before windows existed
        kv_lo = 0
        mid_start = 0
        diag_start = full_end
    page_next = page_ids(bt_row, mid_start, vis_end, BLOCK_N, PAGE)
    for n0 in range(mid_start, full_end, BLOCK_N):
        if PREFETCH_PAGES:
            page = page_next.to(tl.int64)
            page_next = page_ids(bt_row, n0 + BLOCK_N, vis_end, BLOCK_N, PAGE)
        else:
            page = page_ids(bt_row, n0, vis_end, BLOCK_N, PAGE).to(tl.int64)
        acc, m_i, l_i = _attend_tile(
            q,
            acc,
            m_i,
            l_i,
            n0,
            page,
            kv_base,
            v_base,
            stride_ckv,
            stride_cblk,
            stride_cslot,
            pos,
            limit,
            kv_lo,
            vis_end,
            row_scale,
            HEAD_DIM,
            BLOCK_D,
            PAGE,
            BLOCK_N,
            False,
            DOT_PRECISION,
            DOT_DTYPE,
            V_TOKEN_MAJOR,
            V_RUN,
            FP8_MMA,
            EXACT_CAST,
            P_SHIFT,
            WINDOW,
            SOFTCAP,
            CHUNK,
        )
    for n0 in range(diag_start, vis_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q,
            acc,
            m_i,
            l_i,
            n0,
            page_ids(bt_row, n0, vis_end, BLOCK_N, PAGE).to(tl.int64),
            kv_base,
            v_base,
            stride_ckv,
            stride_cblk,
            stride_cslot,
            pos,
            limit,
            kv_lo,
            vis_end,
            row_scale,
            HEAD_DIM,
            BLOCK_D,
            PAGE,
            BLOCK_N,
            True,
            DOT_PRECISION,
            DOT_DTYPE,
            V_TOKEN_MAJOR,
            V_RUN,
            FP8_MMA,
            EXACT_CAST,
            P_SHIFT,
            WINDOW,
            SOFTCAP,
            CHUNK,
        )

    if CHUNK > 0:  # a padding row past the tile's rows may sit in a chunk none of its keys reach
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc * (v_scale / l_i)[:, None]
    dst = out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=io_mask)


def paged_prefill(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_decodes: int,
    num_reqs: int,
    num_prefill_rows: int,
    scale: float,
    out: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
    config: PrefillConfig | None = None,
    *,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    key_limit: torch.Tensor | None = None,
    chunk: int | None = None,
) -> None:
    """Causal attention of requests num_decodes .. num_reqs-1 over their cached contexts, into out.

    q, out: [T, Hq, D]; kv_cache: [2, num_blocks, block_size, Hkv, D] (any float dtype; fp8 with
    kv_scale, [2] float32 (k_scale, v_scale) on the device); block_tables [num_reqs, max_blocks],
    seq_lens [num_reqs], query_start_loc [num_reqs + 1]: int32 on q's device. num_prefill_rows: an upper bound on the prefill requests' rows
    (query_start_loc[num_reqs] - query_start_loc[num_decodes]); it only sizes the grid.
    window: a row sees its last `window` positions (its own included); keys before every row's window
    are never read. softcap: cap * tanh(s / cap) on the scaled scores. sinks: [Hq] float32 sink logits
    on q's device (score_mods.py). key_limit: [>= T] int32 on q's device, the last key position each
    row sees (AttentionMetadata.key_limit: past its own position only within its chunk); None: causal.
    chunk: a row at position p sees keys floor(p / chunk) * chunk .. p only (spec.py).
    """
    check_kv_cache(kv_cache)
    check_kv_scale(kv_scale, kv_cache)
    _, _, page, num_kv_heads, head_dim = kv_cache.shape
    check_head_dim(head_dim)
    cfg = config or default_prefill_config(kv_cache.dtype, head_dim)
    num_heads = q.shape[1]
    window_c, softcap_c = layer_constexprs(window, softcap)
    chunk_c = chunk_constexpr(chunk)
    check_sinks(sinks, num_heads, q.device)
    if q.dim() != 3 or q.shape[2] != head_dim or num_heads % num_kv_heads != 0:
        raise ValueError(f"q {tuple(q.shape)} does not match kv_cache {tuple(kv_cache.shape)}")
    if out.shape[1:] != q.shape[1:] or out.dtype != q.dtype:
        raise ValueError("out must have q's head shape and dtype")
    if q.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("q and out must have unit stride along head_dim")
    for name, x in (
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
        ("query_start_loc", query_start_loc),
    ):
        if x.dtype != torch.int32 or x.stride(-1) != 1:
            raise ValueError(f"{name} must be int32 with unit last stride")
    if key_limit is not None and (
        key_limit.dtype != torch.int32
        or key_limit.dim() != 1
        or key_limit.shape[0] < q.shape[0]
        or key_limit.stride(0) != 1
        or key_limit.device != q.device
    ):
        raise ValueError(f"key_limit must be contiguous int32 [>= {q.shape[0]}] on q's device")
    if cfg.fp8_mma and not is_fp8(kv_cache.dtype):
        raise ValueError(f"PrefillConfig.fp8_mma needs an FP8 cache, got {kv_cache.dtype}")
    if q.is_cuda:
        why = gpu_dot_refusal(head_dim, cfg.block_n, cfg.fp8_mma)
        if why and cfg.fp8_mma and config is None:  # the default on heads too narrow for 8-bit dots
            cfg = replace(cfg, fp8_mma=False)
            why = gpu_dot_refusal(head_dim, cfg.block_n, False)
        if why:
            raise ValueError(f"PrefillConfig: {why}")
    num_prefills = num_reqs - num_decodes
    if num_prefills <= 0 or num_prefill_rows <= 0:
        return
    num_tiles = triton.cdiv(num_prefill_rows, cfg.block_m) + num_prefills
    _prefill_kernel[(num_heads, num_tiles)](
        q,
        kv_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        kv_scale if kv_scale is not None else seq_lens,  # not read without a scale
        sinks if sinks is not None else seq_lens,  # not read without sinks
        key_limit if key_limit is not None else seq_lens,  # not read without key limits
        scale * math.log2(math.e),
        num_decodes,
        num_prefills,
        max(1, math.ceil(math.log2(num_prefills + 1))),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_tables.stride(0),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        PAGE=page,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_DTYPE=dot_dtype(q.dtype, kv_cache.dtype)[0],
        HAS_SCALE=kv_scale is not None,
        V_TOKEN_MAJOR=v_token_major(kv_cache.dtype),
        V_RUN=min(page, cfg.block_n),
        PREFETCH_PAGES=cfg.prefetch_pages,
        FP8_MMA=cfg.fp8_mma,
        EXACT_CAST=q.device.type == "cpu",  # only the interpreter runs on CPU tensors
        Q_MAX=Q_MAX,
        P_SHIFT=P_SHIFT,
        WINDOW=window_c,
        SOFTCAP=softcap_c,
        HAS_SINKS=sinks is not None,
        HAS_KEY_LIMIT=key_limit is not None,
        CHUNK=chunk_c,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
