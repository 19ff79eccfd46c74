"""Every prefill request's cached latent rows gathered into one contiguous buffer, for latent
attention's batched prefill (attention/mla_prefill.py; reference: load_rows in attention/mla.py).

Request first_req + i's first seq_len rows (its context, this chunk's own rows included)
land at rows kv_loc[i] .. kv_loc[i + 1] of out, dequantized from an FP8 cache (x * scale in fp32, then
rounded to out's dtype: load_rows's arithmetic, so the same bytes):

    cache[1, num_blocks, PAGE, 1, RANK + ROPE]   --block table-->   out[sum L, RANK + ROPE]
    grid = (cdiv(max_seq_len, BLOCK_T), num_reqs)      (tiles past a request's length exit)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from overnight.kernels.mla_decode import check_latent_scale

GATHER_TOKENS = 32  # rows per gather program


# first_req is the step's decode count: specializing on it (== 1, a multiple of 16) would compile a
# new variant mid-run.
@triton.jit(do_not_specialize=["first_req"])
def _latent_gather_kernel(
    cache_ptr,  # rows of RANK + ROPE values, blocks stride_cblk apart, slots stride_cslot
    block_tables_ptr,
    seq_lens_ptr,
    kv_loc_ptr,  # [num_reqs + 1] int32: request first_req + i's rows start at out row kv_loc[i]
    out_ptr,  # [sum L, >= RANK + ROPE], rows stride_ot apart
    kv_scale_ptr,  # [2] float32 (latent scale, rope scale), read when HAS_SCALE
    first_req,
    stride_cblk,
    stride_cslot,
    stride_bt,
    stride_ot,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HAS_SCALE: tl.constexpr,
):
    t0 = tl.program_id(0) * BLOCK_T
    i = tl.program_id(1)
    req = first_req + i
    seq_len = tl.load(seq_lens_ptr + req)
    if t0 >= seq_len:
        return
    offs_t = t0 + tl.arange(0, BLOCK_T)
    t_mask = offs_t < seq_len
    page = tl.load(block_tables_ptr + req.to(tl.int64) * stride_bt + offs_t // PAGE, mask=t_mask, other=0)
    src = cache_ptr + page.to(tl.int64) * stride_cblk + (offs_t % PAGE) * stride_cslot
    dst = out_ptr + (tl.load(kv_loc_ptr + i) + offs_t).to(tl.int64) * stride_ot
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = t_mask[:, None] & (offs_r < RANK)[None, :]
    lat = tl.load(src[:, None] + offs_r[None, :], mask=r_mask)
    offs_p = tl.arange(0, BLOCK_P)
    p_mask = t_mask[:, None] & (offs_p < ROPE)[None, :]
    pe = tl.load(src[:, None] + RANK + offs_p[None, :], mask=p_mask)
    if HAS_SCALE:  # as load_rows: the exact 8-bit value times its part's scale in fp32, then rounded
        lat = lat.to(tl.float32) * tl.load(kv_scale_ptr)
        pe = pe.to(tl.float32) * tl.load(kv_scale_ptr + 1)
    tl.store(dst[:, None] + offs_r[None, :], lat.to(out_ptr.dtype.element_ty), mask=r_mask)
    tl.store(dst[:, None] + RANK + offs_p[None, :], pe.to(out_ptr.dtype.element_ty), mask=p_mask)


def latent_gather(
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_loc: torch.Tensor,
    first_req: int,
    num_reqs: int,
    max_seq_len: int,
    rank: int,
    out: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Requests first_req .. first_req + num_reqs - 1's cached rows (cache [1, num_blocks, PAGE, 1, W])
    into out [kv_loc[num_reqs], W] (rows contiguous, any row stride) at rows kv_loc[i] ..
    kv_loc[i + 1] = their seq_lens (int32 [num_reqs + 1] on the device); max_seq_len bounds every
    seq_len (it sizes the grid). An FP8 cache comes with kv_scale [2] float32 (latent, rope) and is
    dequantized; any other is copied as stored. Returns out."""
    width = cache.shape[-1]
    if cache.dim() != 5 or cache.shape[0] != 1 or cache.shape[3] != 1 or not 0 < rank < width:
        raise ValueError(f"cache {tuple(cache.shape)} is no one-plane latent cache of {rank} + more values")
    if out.dim() != 2 or out.shape[1] != width or out.stride(1) != 1 or cache.stride(-1) != 1:
        raise ValueError(f"out {tuple(out.shape)} must hold contiguous rows of the cache's {width} values")
    fp8 = check_latent_scale(cache, kv_scale)
    for name, x in (("block_tables", block_tables), ("seq_lens", seq_lens), ("kv_loc", kv_loc)):
        if x.dtype != torch.int32 or x.stride(-1) != 1 or x.device != cache.device:
            raise ValueError(f"{name} must be int32 with unit last stride on the cache's device")
    if kv_loc.shape[0] != num_reqs + 1:
        raise ValueError(f"kv_loc needs num_reqs + 1 = {num_reqs + 1} entries, got {kv_loc.shape[0]}")
    if num_reqs == 0 or max_seq_len <= 0:
        return out
    grid = (triton.cdiv(max_seq_len, GATHER_TOKENS), num_reqs)
    _latent_gather_kernel[grid](
        cache,
        block_tables,
        seq_lens,
        kv_loc,
        out,
        kv_scale if kv_scale is not None else kv_loc,  # not read without a scale
        first_req,
        cache.stride(1),
        cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        RANK=rank,
        ROPE=width - rank,
        BLOCK_R=triton.next_power_of_2(rank),
        BLOCK_P=triton.next_power_of_2(width - rank),
        PAGE=cache.shape[2],
        BLOCK_T=GATHER_TOKENS,
        HAS_SCALE=fp8,
    )
    return out
