"""Paged attention for decode rows (one query token per request), split over the context when useful.

Reference: the decode branch of paged_attention_ref in overnight/attention/torch_backend.py.

One program serves every query head of one KV head (GQA): the group's G query rows, zero-padded to
BLOCK_G >= 16 rows so scores and outputs go through tl.dot, share each K/V tile, which is loaded once.
The program walks its range of the request's context in tiles of BLOCK_N tokens gathered through the
block table (a tile spans several pages), with an online softmax in fp32.

    grid = (num_decodes, num_kv_heads, num_splits), or (num_kv_heads, num_decodes, num_splits) with
    DecodeConfig.heads_first (the 16-bit cache default)

Flash-decoding: split s of a request with seq_len tokens covers [s * L, min((s + 1) * L, seq_len)) with
L = ceil(ceil(seq_len / num_splits) / BLOCK_N) * BLOCK_N, computed on the device from seq_lens; programs
whose range is empty exit at once. With num_splits > 1 each split writes its normalized partial output
and log2-sum-exp to a workspace and _decode_reduce_kernel combines them. num_splits sizes the grid, so
it is chosen from static quantities (batch size, max_model_len), never from this step's lengths, and
the whole thing can be captured in a CUDA graph.

A layer's variant (score_mods.py: window, softcap and sinks, constexpr-selected, so full attention
compiles to the kernel it was before them). With a window of W tokens a decode row sees
[max(0, seq_len - W), seq_len); its tiles start at the page (or tile, if smaller) holding the first of
those (kv_tiles.decode_base) and the splits divide only that range, so a windowed layer's decode reads
about min(seq_len, W) tokens per request whatever the context (a Gemma 3 local layer, W = 1024, at a
32k context: 1/32 of a full layer's bytes), and its num_splits is chosen for min(max_model_len, W)
(triton_backend.py). Pages wholly before the window are never read: the engine may have given them back.
A softcap adds a tanh (through exp2) per score; sinks start the online softmax from the sink logit,
or, split, are added once by _decode_reduce_kernel. None of these was timed on the GPU yet.

Heads wider than 128 (up to 512): default_decode_config shrinks the tiles so their bytes stay those of
a 128-wide head; the TMA copies stop at 256-wide heads (a box side is at most 256), wider ones take the
pointer gathers.

FP8 cache: the layer's (k_scale, v_scale) are read from a device pointer (kv_quant.py); k_scale folds
into the score scale, v_scale into the final normalization. V is stored token-major inside each page
(kv_layout.py: with V stored like K, the P @ V operand came out of shared memory a byte at a time) and
read without a mask along tokens. By default (FP8_DECODE_CONFIG, DecodeConfig.fp8_mma) the dots read the
8-bit tiles as stored, with q and P rounded to e4m3, each tile fetched by one TMA copy on pages of 64
tokens (DecodeConfig.tma; paged_decode_fp8.py). Otherwise the tiles are converted to fp16 for the dots
(sm_90 has no fp8 -> bf16 instruction; q is cast once), which holds every e4m3 / e5m2 value exactly; scores and accumulators stay fp32. DecodeConfig.fp8_convert picks how:

    "fp16"  cvt instructions (one per pair of values)
    "bits"  integer shifts: e5m2 is the top byte of an fp16; an e4m3 byte shifted into an fp16's
            sign / exponent / mantissa fields reads as value * 2**-8 (subnormals included), and the
            2**8 folds into the two scales
    "q"     convert to q's dtype (the slow fp8 -> bf16 path; kept for comparison)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from overnight.kernels.kv_layout import is_fp8, v_token_major
from overnight.kernels.kv_tiles import active_splits, decode_range, grid_coords, load_v_token_major, page_ids
from overnight.kernels.kv_write import check_kv_cache, check_kv_scale
from overnight.kernels.paged_decode_fp8 import launch_decode_fp8_mma, tma_supported
from overnight.kernels.score_mods import (
    check_head_dim,
    check_sinks,
    chunk_constexpr,
    gpu_dot_refusal,
    layer_constexprs,
    sink_init,
    softcap,
)

# Splitting pays when batch * kv_heads programs cannot keep the GPU's memory pipes busy: a program is
# one CTA with a handful of loads in flight, and an H200 (132 SMs) wants several CTAs per SM to saturate
# HBM. So split only while num_decodes * num_kv_heads < TARGET_CTAS_PER_SM * num_sms, and never into
# pieces shorter than MIN_SPLIT_TOKENS (the reduce and the extra partial writes would dominate).
TARGET_CTAS_PER_SM = 4
MIN_SPLIT_TOKENS = 512
MAX_SPLITS = 32


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int = 64  # context tokens per tile (a multiple of the page size keeps gathers whole-page)
    num_warps: int = 4
    num_stages: int = 4  # the H200 bench's winner (geometric mean over its decode cases) in two runs
    fp8_convert: str = "fp16"  # fp8 cache only: "fp16" | "bits" | "q" (see the module docstring)
    # Load the next tile's page ids one iteration ahead (see page_ids): the K/V loads then no longer
    # depend on a load of the same iteration, and Triton's pipeliner gives them num_stages - 1 buffers
    # and waits only for the oldest; without it the loop waits for every copy at its top.
    prefetch_pages: bool = False
    # fp8 cache only: tokens as the MMA's M and both dots on the 8-bit values as stored, q and P
    # rounded to e4m3 (paged_decode_fp8.py); fp8_convert and prefetch_pages do not apply.
    fp8_mma: bool = False
    # Grid order: the KV heads of one request as the fastest grid dimension, so the CTAs resident at
    # the same time read neighbouring bytes of the same pages (a page holds every KV head of its 16
    # tokens) instead of one head's 128- or 256-byte rows 1-2 KB apart in pages of many requests.
    heads_first: bool = False
    # With fp8_mma: each K and V tile arrives by one TMA copy (paged_decode_fp8.py), no per-thread
    # addresses. Needs pages of a multiple of block_n tokens (tma_supported says what else).
    tma: bool = False
    # With fp8_mma: fp32 sums between the 8-bit MMA's K steps (paged_decode_fp8.PRECISE_ACC_STEP)
    # instead of a whole dot in the MMA's ~14-bit accumulator. On an H100 (bench/fp8_mma_decode_gpu.py,
    # 2026-12-05) it cut the kernel's distance to its rounding emulation on the 64-token tiles from up
    # to 8.9e-3 to under 1.4e-3 in most shapes, at the same time (b512 ctx2048 721 against 723 us, b256
    # ctx768 151 against 151; b8 ctx32768 232 against 228).
    precise_acc: bool = True


# An fp8 tile of BLOCK_N tokens moves half the bytes of a bf16 one: twice the tokens per tile keeps the
# loads per iteration the same. The dots run on e4m3 as stored (fp8_mma), as FlashAttention-3's FP8 path
# does (it rounds q per tensor; we round per row): on the H200 the kernel bench had it 1-3% faster than
# the fp16-dot path at these tiles (bench/attention_gpu.py), and long-1024-1024 with an FP8 cache ran
# 1.1% faster end to end with it and the e4m3 prefill (`overnight bench throughput`). FP8_FP16_DOTS_DECODE_CONFIG is
# the fp16-dot path (`--attention-variant fp16-dots`).
FP8_SMALL_PAGE_DECODE_CONFIG = DecodeConfig(block_n=128, num_warps=4, num_stages=3, fp8_mma=True)
FP8_FP16_DOTS_DECODE_CONFIG = DecodeConfig(block_n=128, num_warps=4, num_stages=3)

# On pages of 64 tokens (an FP8 cache's default block size, options.FP8_BLOCK_SIZE) the same kernel read
# 1.28-1.33x faster than on pages of 16 in the H200 bench (bench/decode_pages_gpu.py: b512
# ctx2048 656 -> 512 us, 4.2 TB/s), and fetching each tile by one TMA copy with the heads-first grid
# another 1-3% (504 us). With splits the heads-first grid lost (the 8-request, 32k-context case 233 us
# against 184 in request order), so paged_decode drops it there for this kernel.
FP8_DECODE_CONFIG = DecodeConfig(
    block_n=64, num_warps=4, num_stages=3, fp8_mma=True, tma=True, heads_first=True
)


# 16-bit caches: the heads-first grid was faster in all 7 bf16 cases of the H200 kernel bench (1-2%,
# bench/attention_gpu.py); the FP8 kernel at 128-token tiles was not (up to 5% slower), so it keeps the old order.
BF16_DECODE_CONFIG = DecodeConfig(heads_first=True)


def default_decode_config(cache_dtype: torch.dtype, block_size: int, head_dim: int = 128) -> DecodeConfig:
    """The decode kernel's config for a cache of that dtype and page size. An FP8 cache on pages the
    TMA tiles do not divide (a --block-size of 16 or 32) keeps the 128-token pointer-gather tiles.

    Heads wider than 128 (Gemma: 256, Gemma 4's global layers: 512) keep a tile's bytes those of a
    128-wide head (fewer tokens per tile), so the K/V buffers of the pipeline fit in shared memory
    (a 64 x 512 bf16 tile is 64 KB, and num_stages of them per operand would not); the FP8 kernel keeps
    64-token tiles (its warpgroup MMA wants M >= 64) with fewer stages, and 8 warps at 512. Compiled for
    sm_90 on the CPU (ptxas, no GPU): no spills; bf16 at D = 256 / 512: 124 / 156 registers, 42 / 50 KB
    of shared memory; FP8 at 256 (TMA) / 512 (pointers): 107 / 171 registers, 103 / 140 KB. Not yet
    timed on a GPU."""
    wide = max(1, triton.next_power_of_2(head_dim) // 128)
    if not is_fp8(cache_dtype):
        if wide == 1:
            return BF16_DECODE_CONFIG
        return replace(BF16_DECODE_CONFIG, block_n=max(16, BF16_DECODE_CONFIG.block_n // wide))
    if wide == 1:
        return (
            FP8_DECODE_CONFIG if block_size % FP8_DECODE_CONFIG.block_n == 0 else FP8_SMALL_PAGE_DECODE_CONFIG
        )
    if wide == 2:
        cfg = replace(FP8_DECODE_CONFIG, num_stages=3)
    else:
        cfg = replace(FP8_DECODE_CONFIG, num_warps=8, num_stages=2)
    return cfg if block_size % cfg.block_n == 0 else replace(cfg, tma=False, heads_first=False)


# FP8_BITS: how _to_dot converts a tile: 0 a plain cast, 1 e4m3 by shifts (values * 2**-8), 2 e5m2.
_BITS = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}


def dot_dtype(
    q_dtype: torch.dtype, cache_dtype: torch.dtype, fp8_convert: str = "fp16"
) -> tuple[tl.dtype, int]:
    """(dtype both dot operands are converted to, FP8_BITS): q's dtype, except fp16 for an fp8 cache
    with a half-precision q (an fp32 q, as in interpreter tests, computes in fp32)."""
    if fp8_convert not in ("fp16", "bits", "q"):
        raise ValueError(f"fp8_convert must be fp16, bits or q, got {fp8_convert!r}")
    q_tl = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[q_dtype]
    if cache_dtype not in _BITS or fp8_convert == "q" or q_dtype == torch.float32:
        return q_tl, 0
    return tl.float16, _BITS[cache_dtype] if fp8_convert == "bits" else 0


@triton.jit
def _to_dot(x, DOT_DTYPE: tl.constexpr, FP8_BITS: tl.constexpr):
    """A K or V tile as a dot operand (FP8_BITS == 1 leaves e4m3 values scaled by 2**-8)."""
    if FP8_BITS == 0:
        y = x.to(DOT_DTYPE)
    else:
        b = x.to(tl.uint8, bitcast=True).to(tl.uint16)
        if FP8_BITS == 1:
            b = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
        else:
            b = b << 8
        y = b.to(tl.float16, bitcast=True)
    return y


def choose_num_splits(num_decodes: int, num_kv_heads: int, max_model_len: int, num_sms: int = 132) -> int:
    """Splits per request: a function of static quantities only, so a captured graph stays valid."""
    programs = max(1, num_decodes * num_kv_heads)
    target = TARGET_CTAS_PER_SM * num_sms
    if programs >= target:
        return 1
    useful = max(1, math.ceil(max_model_len / MIN_SPLIT_TOKENS))
    return max(1, min(math.ceil(target / programs), useful, MAX_SPLITS))


@triton.jit
def _decode_kernel(
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,  # [B, Hq, num_splits, D] fp32, used when SPLIT
    part_lse_ptr,  # [B, Hq, num_splits] fp32, log2 domain
    kv_scale_ptr,  # [2] float32 (k_scale, v_scale), read when HAS_SCALE
    sinks_ptr,  # [Hq] float32 sink logits, read when HAS_SINKS (and not SPLIT: the reduce adds them)
    qk_scale,  # softmax scale * log2(e)
    num_splits,
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
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,  # num_splits > 1: write partials for _decode_reduce_kernel
    DOT_PRECISION: tl.constexpr,
    DOT_DTYPE: tl.constexpr,  # operand dtype of both dots (q's, or fp16 for an fp8 cache)
    FP8_BITS: tl.constexpr,  # see _to_dot
    HAS_SCALE: tl.constexpr,
    V_TOKEN_MAJOR: tl.constexpr,  # an fp8 cache: V stored [Hkv, D, PAGE] per block (kv_layout.py)
    V_RUN: tl.constexpr,  # min(PAGE, BLOCK_N): tokens of a tile contiguous in token-major V
    PREFETCH_PAGES: tl.constexpr,  # DecodeConfig.prefetch_pages
    HEADS_FIRST: tl.constexpr,  # DecodeConfig.heads_first: grid (kv heads, requests, splits)
    WINDOW: tl.constexpr,  # sliding window in tokens, 0: none (score_mods.py)
    SOFTCAP: tl.constexpr,  # logit softcap in log2 units, 0.0: none
    HAS_SINKS: tl.constexpr,
    CHUNK: tl.constexpr,  # attention chunk in tokens, 0: none (score_mods.py)
):
    b, kvh, num_kv_heads = grid_coords(HEADS_FIRST)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    lo, start, end = decode_range(seq_len, split, num_splits, BLOCK_N, SPLIT, WINDOW, V_RUN, CHUNK)
    if SPLIT:
        if start >= end:
            return

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + offs_g
    row_mask = (offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(
        q_ptr + b * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=row_mask, other=0.0
    ).to(DOT_DTYPE)
    if HAS_SCALE:
        qk_scale = qk_scale * tl.load(kv_scale_ptr)
        v_scale = tl.load(kv_scale_ptr + 1)
    else:
        v_scale = 1.0
    if FP8_BITS == 1:  # the tiles hold e4m3 values * 2**-8
        qk_scale = qk_scale * 256.0
        v_scale = v_scale * 256.0

    m_i, l_i = sink_init(sinks_ptr, heads, offs_g < GROUP, BLOCK_G, HAS_SINKS and not SPLIT)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    k_base = cache_ptr + kvh * stride_ch
    v_base = cache_ptr + stride_ckv + kvh * (HEAD_DIM * PAGE)  # token-major V (kv_layout.py)
    page_next = page_ids(bt_row, start, end, BLOCK_N, PAGE)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        if WINDOW > 0 or CHUNK > 0:  # the first tile may start before lo: those slots are not loaded
            n_mask = n_mask & (offs_n >= lo)
        if PREFETCH_PAGES:
            page = page_next.to(tl.int64)
            page_next = page_ids(bt_row, n0 + BLOCK_N, end, BLOCK_N, PAGE)
        else:
            page = page_ids(bt_row, n0, end, BLOCK_N, PAGE).to(tl.int64)
        tok = page * stride_cblk + (offs_n % PAGE) * stride_cslot  # int64: a layer can exceed 2**31 elements
        kv_mask = n_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
        k = tl.load(k_base + tok[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(_to_dot(k, DOT_DTYPE, FP8_BITS)), input_precision=DOT_PRECISION) * qk_scale
        if SOFTCAP > 0:
            s = softcap(s, SOFTCAP)
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_TOKEN_MAJOR:
            v = load_v_token_major(
                v_base, page, offs_n, offs_d, stride_cblk, HEAD_DIM, BLOCK_D, PAGE, V_RUN, n_mask, False
            )
        else:
            v = tl.load(k_base + stride_ckv + tok[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(
            p.to(DOT_DTYPE), _to_dot(v, DOT_DTYPE, FP8_BITS), input_precision=DOT_PRECISION
        )
        m_i = m_new

    # l_i == 0 only for an empty context (a padded request): write zeros, not NaN.
    out = acc * (v_scale / tl.where(l_i == 0.0, 1.0, l_i))[:, None]
    if not SPLIT:
        dst = out_ptr + b * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_mask)
    else:
        part = (b * (GROUP * num_kv_heads) + heads) * num_splits + split
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], out, mask=row_mask)
        tl.store(part_lse_ptr + part, m_i + tl.log2(l_i), mask=offs_g < GROUP)


@triton.jit
def _decode_reduce_kernel(
    seq_lens_ptr,
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    sinks_ptr,  # [Hq] float32, read when HAS_SINKS: the sink is counted here, once per head
    num_splits,
    block_n,  # the decode kernel's BLOCK_N
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    WINDOW: tl.constexpr,  # the decode kernel's, with its ALIGN (V_RUN) and CHUNK: the same split ranges
    ALIGN: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    # Splits past the end of a short context never ran and left their workspace rows stale.
    num_active = active_splits(seq_len, num_splits, block_n, WINDOW, ALIGN, CHUNK)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_active
    part = (b * tl.num_programs(1) + h) * num_splits + offs_s
    lse = tl.load(part_lse_ptr + part, mask=s_mask, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h) * 1.4426950408889634
        lse_max = tl.maximum(lse_max, sink)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # no active split: keep exp2 finite
    w = tl.where(s_mask, tl.exp2(lse - lse_max), 0.0)
    o_mask = s_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    o = tl.load(part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=o_mask, other=0.0)
    denom = tl.sum(w, 0)
    if HAS_SINKS:
        denom += tl.exp2(sink - lse_max)
    out = tl.sum(o * w[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(
        out_ptr + b * stride_ot + h * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


class DecodeWorkspace:
    """Partial outputs of split decoding, allocated once (static pointers for CUDA graphs).

    Holds max_rows = max over batch sizes of num_decodes * num_splits request-splits.
    """

    def __init__(self, max_rows: int, num_heads: int, head_dim: int, device: torch.device | str) -> None:
        self.max_rows = max_rows
        self.part_out = torch.empty(max_rows * num_heads * head_dim, dtype=torch.float32, device=device)
        self.part_lse = torch.empty(max_rows * num_heads, dtype=torch.float32, device=device)

    def views(
        self, num_decodes: int, num_heads: int, num_splits: int, head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = num_decodes * num_splits
        if rows > self.max_rows or rows * num_heads * head_dim > self.part_out.numel():
            raise ValueError(
                f"decode workspace holds {self.max_rows} request-splits of {self.part_out.numel()} values, "
                f"need {rows} of {num_heads} x {head_dim} (size it for the widest layer's heads)"
            )
        return self.part_out[: rows * num_heads * head_dim], self.part_lse[: rows * num_heads]


def paged_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    num_decodes: int,
    scale: float,
    out: torch.Tensor,
    num_splits: int = 1,
    workspace: DecodeWorkspace | None = None,
    kv_scale: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
    *,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
) -> None:
    """out[b] = attention of q[b] over request b's first seq_lens[b] cached tokens, for b < num_decodes.

    q, out: [>= num_decodes, Hq, D]; kv_cache: [2, num_blocks, block_size, Hkv, D] of any float dtype
    (fp8 with kv_scale, [2] float32 (k_scale, v_scale) on the device); block_tables: [>= num_decodes,
    max_blocks] int32; seq_lens: [>= num_decodes] int32. Nothing is synchronized with the host.
    config defaults to default_decode_config(kv_cache.dtype, block_size); a default TMA config on a
    cache its copies cannot read falls back to the same tiles by pointers, an explicit one raises.
    window: a query sees its last `window` positions (its own included); tokens before them are never
    read, and num_splits share the visible ones. softcap: cap * tanh(s / cap) on the scaled scores.
    sinks: [Hq] float32 sink logits on q's device (score_mods.py). chunk: a query at position p sees
    positions floor(p / chunk) * chunk .. p (spec.py); tokens before its chunk are never read.
    """
    check_kv_cache(kv_cache)
    check_kv_scale(kv_scale, kv_cache)
    _, _, page, num_kv_heads, head_dim = kv_cache.shape
    check_head_dim(head_dim)
    cfg = config or default_decode_config(kv_cache.dtype, page, head_dim)
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
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32 or block_tables.stride(-1) != 1:
        raise ValueError("block_tables and seq_lens must be int32 (block_tables row-contiguous)")
    if num_decodes == 0:
        return
    group = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    compute_dtype, fp8_bits = dot_dtype(q.dtype, kv_cache.dtype, cfg.fp8_convert)
    if num_splits > 1:
        ws = workspace or DecodeWorkspace(num_decodes * num_splits, num_heads, head_dim, q.device)
        part_out, part_lse = ws.views(num_decodes, num_heads, num_splits, head_dim)
    else:
        part_out, part_lse = out, out  # unused
    # A grid's second dimension stops at 65535: more requests than that keep the requests first.
    heads_first = cfg.heads_first and num_decodes <= 65535 and not (cfg.tma and num_splits > 1)
    grid = (num_kv_heads, num_decodes, num_splits) if heads_first else (num_decodes, num_kv_heads, num_splits)
    if cfg.tma:
        why = tma_supported(kv_cache, cfg.block_n) if cfg.fp8_mma else "it needs fp8_mma"
        if why and config is not None:
            raise ValueError(f"DecodeConfig.tma: {why}")
        if why:  # the default config on a cache the copies cannot read: the same tiles by pointers
            cfg = replace(cfg, tma=False)
    if q.is_cuda:
        fp8_mma = cfg.fp8_mma and is_fp8(kv_cache.dtype)
        why = gpu_dot_refusal(head_dim, cfg.block_n, fp8_mma)
        if why and fp8_mma and config is None:  # the default on heads too narrow for 8-bit dots
            cfg = replace(cfg, fp8_mma=False, tma=False)
            why = gpu_dot_refusal(head_dim, cfg.block_n, False)
        if why:
            raise ValueError(f"DecodeConfig: {why}")
    if cfg.fp8_mma and is_fp8(kv_cache.dtype):
        launch_decode_fp8_mma(
            grid,
            q,
            kv_cache,
            block_tables,
            seq_lens,
            out,
            part_out,
            part_lse,
            kv_scale,
            scale * math.log2(math.e),
            num_splits,
            cfg.block_n,
            cfg.num_warps,
            cfg.num_stages,
            heads_first,
            cfg.tma,
            precise_acc=cfg.precise_acc,
            window=window_c,
            softcap=softcap_c,
            sinks=sinks,
            chunk=chunk_c,
        )
    else:
        _decode_kernel[grid](
            q,
            kv_cache,
            block_tables,
            seq_lens,
            out,
            part_out,
            part_lse,
            kv_scale if kv_scale is not None else seq_lens,  # not read without a scale
            sinks if sinks is not None else seq_lens,  # not read without sinks
            scale * math.log2(math.e),
            num_splits,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            kv_cache.stride(0),
            kv_cache.stride(1),
            kv_cache.stride(2),
            kv_cache.stride(3),
            block_tables.stride(0),
            GROUP=group,
            BLOCK_G=max(16, triton.next_power_of_2(group)),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            PAGE=page,
            BLOCK_N=cfg.block_n,
            SPLIT=num_splits > 1,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            DOT_DTYPE=compute_dtype,
            FP8_BITS=fp8_bits,
            HAS_SCALE=kv_scale is not None,
            V_TOKEN_MAJOR=v_token_major(kv_cache.dtype),
            V_RUN=min(page, cfg.block_n),
            PREFETCH_PAGES=cfg.prefetch_pages,
            HEADS_FIRST=heads_first,
            WINDOW=window_c,
            SOFTCAP=softcap_c,
            HAS_SINKS=sinks is not None,
            CHUNK=chunk_c,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
    if num_splits > 1:
        _decode_reduce_kernel[(num_decodes, num_heads)](
            seq_lens,
            part_out,
            part_lse,
            out,
            sinks if sinks is not None else seq_lens,  # not read without sinks
            num_splits,
            cfg.block_n,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_S=triton.next_power_of_2(num_splits),
            WINDOW=window_c,
            ALIGN=min(page, cfg.block_n),
            HAS_SINKS=sinks is not None,
            CHUNK=chunk_c,
            num_warps=4,
        )
