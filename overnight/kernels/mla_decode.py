"""Latent attention's decode (absorbed MLA, attention/mla.py) and its cache write, in Triton.

Reference: mla_decode_ref in attention/mla.py (and its latent_attention_ref, which the models' CPU path
runs); the wrapper takes the widths mla_decode_supported there names (the caller checks). One layer's
cache has one plane of rows, each the latent and the rotated shared key:

    cache[1, num_blocks, PAGE, 1, RANK + ROPE]       row = [ c (RANK) | k_pe (ROPE) ]

A decode row's absorbed query q_lat[h] = [W_UK[h]^T q_nope[h] | q_pe[h]] (RANK + ROPE per head) attends
to its request's rows as multi-query attention: every query head shares the one "KV head", the scores
use the whole row and the values are the row's first RANK values, read from the same tile (no second
copy of the latent, no V plane).

    grid = (rows, cdiv(num_heads, BLOCK_H))

Each query row names its request (row_req: whose block table it reads) and how many of that request's
rows it sees (row_lens): a decode row sees its whole context; a prefill row at position p sees p + 1
(causal), so the same kernel attends a prefill chunk over its cached latents and its own new rows,
absorbed like a decode (mla_rows; the `mla-prefill-kernel` attention variant routes prefills here).
Each row re-reads its context (the rows of one chunk share it through L2): a chunk of T rows reads its
context T times, where a kernel tiling BLOCK_M query rows per program would read it T / BLOCK_M times.
Whether that beats the batched decompression (kernels/mla_prefill.py) is not measured yet: a variant,
not the default.

A program holds BLOCK_H heads (>= 16 rows, so both products are tensor-core dots) and walks the context
in tiles of BLOCK_N tokens gathered through the block table, with an online softmax in fp32 (log2
domain). The latent part of a tile [BLOCK_N, RANK] feeds both dots (scores, then P @ values); the rope
part [BLOCK_N, ROPE] adds to the scores. No split over the context: the grid and everything it reads
are static per batch size, so a decode step is captured in a CUDA graph. Output [rows, H, RANK] in q's
dtype, before W_UV (applied by the caller).

DeepSeek-V3 (RANK 512, ROPE 64, 16 heads a program): the fp32 accumulator is 16 x 512, a tile of 32
tokens is 36 KB in bf16 (18 KB in fp8); tests/test_kernels_mla_sm90.py compiles the default tiles for
sm_90 (no spills, shared memory within the limit), with a bf16 and an FP8 cache.

FP8 cache (attention/mla.py: each part stored divided by its own per-tensor scale, the layer's
kv_scale[2] = (latent, rope) on the device, read through a pointer so captured graphs see new values):
the write divides (round to nearest, as torch does, so it stores the reference's bytes) and saturates.
The decode converts each 8-bit tile to fp16 in registers (q cast once; every e4m3 / e5m2 value is exact
in fp16, and sm_90 has no fp8 -> bf16 conversion), runs the same 16-bit dots, and applies the scales to
fp32 results only: the latent part's scores times the latent scale, the rope part's times the rope
scale, and the output times the latent scale once at the end (the values are the latent: its scale
factors out of sum_j p_j c_j). No 8-bit dot: with the heads on M (16 rows) Triton lowers an 8-bit dot
to mma.sync by converting its operands anyway (paged_decode_fp8.py says why that kernel puts tokens on
M instead), and q would have to be rounded to e4m3 too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from overnight.kernels.kv_layout import FP8_MAX, is_fp8
from overnight.kernels.kv_write import check_kv_scale

BLOCK_H = 16
BLOCK_N = 32
NUM_WARPS = 4
NUM_STAGES = 2
# An FP8 cache's tiles (BLOCK_N, num_warps, num_stages). At 4 warps the conversions to fp16 took 255
# registers and spilled on sm_90 (tests/test_kernels_mla_sm90.py); 8 warps hold a 32-token tile in 198.
FP8_TILES = (32, 8, 2)
LOG2E = 1.4426950408889634


@triton.jit
def _mla_decode_kernel(
    q_ptr,  # [T, H, RANK + ROPE]
    cache_ptr,  # rows of RANK + ROPE values, blocks stride_cblk apart, slots stride_cslot
    block_tables_ptr,
    row_req_ptr,  # [T] int32: the request (block-table row) of each query row
    row_lens_ptr,  # [T] int32: the cached rows each query row sees
    out_ptr,  # [T, H, RANK]
    kv_scale_ptr,  # [2] float32 (latent scale, rope scale), read when HAS_SCALE
    qk_scale,  # softmax scale * log2(e)
    num_heads,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cblk,
    stride_cslot,
    stride_bt,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_SCALE: tl.constexpr,  # an FP8 cache: tiles converted to DOT_DTYPE, scales applied to fp32 results
    DOT_DTYPE: tl.constexpr,  # the dots' operand type with HAS_SCALE (fp16, or fp32 for an fp32 q)
):
    b = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < num_heads
    offs_r = tl.arange(0, RANK)
    offs_p = tl.arange(0, ROPE)
    seq_len = tl.load(row_lens_ptr + b)
    q_row = q_ptr + b.to(tl.int64) * stride_qt + offs_h[:, None] * stride_qh
    q_lat = tl.load(q_row + offs_r[None, :], mask=h_mask[:, None], other=0.0)
    q_pe = tl.load(q_row + RANK + offs_p[None, :], mask=h_mask[:, None], other=0.0)
    if HAS_SCALE:
        q_lat = q_lat.to(DOT_DTYPE)
        q_pe = q_pe.to(DOT_DTYPE)
        lat_scale = tl.load(kv_scale_ptr)
        lat_qk_scale = qk_scale * lat_scale
        pe_qk_scale = qk_scale * tl.load(kv_scale_ptr + 1)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, RANK], dtype=tl.float32)
    table = block_tables_ptr + tl.load(row_req_ptr + b).to(tl.int64) * stride_bt
    for start in range(0, seq_len, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < seq_len
        page = tl.load(table + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
        rows = cache_ptr + page * stride_cblk + (offs_n % PAGE) * stride_cslot
        # Masked slots read as 0: the memory past a context's end may hold anything (NaN too).
        lat = tl.load(rows[:, None] + offs_r[None, :], mask=n_mask[:, None], other=0.0)
        pe = tl.load(rows[:, None] + RANK + offs_p[None, :], mask=n_mask[:, None], other=0.0)
        if HAS_SCALE:
            lat = lat.to(DOT_DTYPE)
            s = tl.dot(q_lat, tl.trans(lat), input_precision=DOT_PRECISION) * lat_qk_scale
            pe_s = tl.dot(q_pe, tl.trans(pe.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
            s += pe_s * pe_qk_scale
        else:
            s = tl.dot(q_lat, tl.trans(lat), input_precision=DOT_PRECISION)
            s = tl.dot(q_pe, tl.trans(pe), acc=s, input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(lat.dtype), lat, input_precision=DOT_PRECISION)
        m_i = m_new
    # seq_len 0 (a CUDA graph's padding row): no tile ran, the output is 0.
    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    if HAS_SCALE:
        out = acc * (lat_scale / l_i)[:, None]
    else:
        out = acc / l_i[:, None]
    o_row = out_ptr + b.to(tl.int64) * stride_ot + offs_h[:, None] * stride_oh
    tl.store(o_row + offs_r[None, :], out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None])


def mla_decode(
    q_lat: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    rank: int,
    num_decodes: int,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The first num_decodes rows of q_lat [T, H, RANK + ROPE] over their requests' cached rows (cache
    [1, num_blocks, PAGE, 1, RANK + ROPE], rows contiguous; an FP8 one with its kv_scale [2] float32
    (latent, rope) on the device); returns [num_decodes, H, RANK]."""
    rows = torch.arange(num_decodes, dtype=torch.int32, device=q_lat.device)
    lens = seq_lens[:num_decodes]
    return mla_rows(q_lat[:num_decodes], cache, block_tables, rows, lens, scale, rank, kv_scale)


def mla_rows(
    q_lat: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    row_req: torch.Tensor,
    row_lens: torch.Tensor,
    scale: float,
    rank: int,
    kv_scale: torch.Tensor | None = None,
    tiles: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """Every row r of q_lat [R, H, RANK + ROPE] over the first row_lens[r] cached rows of request
    row_req[r] (int32 [R] each); returns [R, H, RANK]. kv_scale: as mla_decode's. tiles: (BLOCK_N,
    num_warps, num_stages), by default the cache kind's (benchmarks compare others)."""
    num_decodes = q_lat.shape[0]
    if row_req.shape[0] != num_decodes or row_lens.shape[0] != num_decodes:
        raise ValueError(f"row_req and row_lens must have one entry per query row ({num_decodes})")
    width = q_lat.shape[-1]
    if cache.dim() != 5 or cache.shape[0] != 1 or cache.shape[3] != 1 or cache.shape[4] != width:
        raise ValueError(f"cache {tuple(cache.shape)} is no one-plane latent cache of {width}-value rows")
    if any(d < 16 or d & (d - 1) for d in (rank, width - rank)):
        raise ValueError(f"latent widths {rank} + {width - rank} are not powers of two of at least 16")
    fp8 = check_latent_scale(cache, kv_scale)
    if q_lat.stride(-1) != 1 or cache.stride(-1) != 1 or (cache.dtype != q_lat.dtype and not fp8):
        raise ValueError(
            "q_lat and the cache must share a dtype (or the cache be FP8) and be contiguous along a row"
        )
    heads = q_lat.shape[1]
    out = torch.empty(num_decodes, heads, rank, dtype=q_lat.dtype, device=q_lat.device)
    if num_decodes == 0:
        return out
    block_n, num_warps, num_stages = tiles or (FP8_TILES if fp8 else (BLOCK_N, NUM_WARPS, NUM_STAGES))
    grid = (num_decodes, triton.cdiv(heads, BLOCK_H))
    _mla_decode_kernel[grid](
        q_lat,
        cache,
        block_tables,
        row_req,
        row_lens,
        out,
        kv_scale if kv_scale is not None else row_lens,  # not read without a scale
        scale * LOG2E,
        heads,
        q_lat.stride(0),
        q_lat.stride(1),
        out.stride(0),
        out.stride(1),
        cache.stride(1),
        cache.stride(2),
        block_tables.stride(0),
        RANK=rank,
        ROPE=width - rank,
        BLOCK_H=BLOCK_H,
        PAGE=cache.shape[2],
        BLOCK_N=block_n,
        DOT_PRECISION="ieee" if q_lat.dtype == torch.float32 else "tf32",
        HAS_SCALE=fp8,
        DOT_DTYPE=tl.float32 if q_lat.dtype == torch.float32 else tl.float16,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


@triton.jit(do_not_specialize_on_alignment=["slot_mapping_ptr"])  # as kv_write.py's slots
def _latent_write_kernel(
    rows_ptr,
    cache_ptr,
    slot_mapping_ptr,
    kv_scale_ptr,  # [2] float32 (latent scale, rope scale), read when HAS_SCALE
    stride_rt,
    stride_cblk,
    stride_cslot,
    PAGE: tl.constexpr,
    RANK: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    SAT_MAX: tl.constexpr,  # the FP8 format's largest value: stores saturate (a plain cast gives NaN)
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t)
    if slot >= 0:  # -1: a padding row, written nowhere
        offs = tl.arange(0, BLOCK)
        mask = offs < WIDTH
        x = tl.load(rows_ptr + t.to(tl.int64) * stride_rt + offs, mask=mask)
        if HAS_SCALE:
            part_scale = tl.where(offs < RANK, tl.load(kv_scale_ptr), tl.load(kv_scale_ptr + 1))
            x = tl.math.div_rn(x.to(tl.float32), part_scale)
            x = tl.minimum(tl.maximum(x, -SAT_MAX), SAT_MAX)
        dst = cache_ptr + (slot // PAGE) * stride_cblk + (slot % PAGE) * stride_cslot
        tl.store(dst + offs, x.to(cache_ptr.dtype.element_ty), mask=mask)


def check_latent_scale(cache: torch.Tensor, kv_scale: torch.Tensor | None) -> bool:
    """Whether the cache is FP8; raises ValueError unless an FP8 cache comes with its [2] float32
    (latent, rope) scales on its device and a 16-bit or fp32 one without."""
    fp8 = is_fp8(cache.dtype)
    if fp8 != (kv_scale is not None):
        raise ValueError(
            f"a {cache.dtype} latent cache takes {'its' if fp8 else 'no'} kv_scale (latent, rope scales)"
        )
    check_kv_scale(kv_scale, cache)
    return fp8


def latent_write(
    rows: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
    rank: int | None = None,
) -> None:
    """Store each row of rows [T, W] at its flat slot of cache [1, num_blocks, PAGE, 1, W]. Into an FP8
    cache (with kv_scale [2] float32 on the device, and rank = the latent width) as rows[:, :rank] /
    latent scale and rows[:, rank:] / rope scale, saturated."""
    n, width = slot_mapping.shape[0], rows.shape[-1]
    if cache.shape[0] != 1 or cache.shape[3] != 1 or cache.shape[4] != width or rows.shape[0] < n:
        raise ValueError(f"rows {tuple(rows.shape)} do not fit the latent cache {tuple(cache.shape)}")
    if rows.stride(-1) != 1 or cache.stride(-1) != 1:
        raise ValueError("rows and cache must be contiguous along a row")
    fp8 = check_latent_scale(cache, kv_scale)
    if fp8 and (rank is None or not 0 < rank < width):
        raise ValueError(f"a scaled latent write needs the latent width within the row's {width}, got {rank}")
    if n == 0:
        return
    _latent_write_kernel[(n,)](
        rows,
        cache,
        slot_mapping,
        kv_scale if kv_scale is not None else slot_mapping,  # not read without a scale
        rows.stride(0),
        cache.stride(1),
        cache.stride(2),
        PAGE=cache.shape[2],
        RANK=rank or 0,
        WIDTH=width,
        BLOCK=triton.next_power_of_2(width),
        HAS_SCALE=fp8,
        SAT_MAX=FP8_MAX.get(cache.dtype, 0.0),
    )
