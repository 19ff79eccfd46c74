"""Decode attention over an FP8 cache with the tokens as the MMA's M dimension and both dots in 8 bits.

Reference: the decode branch of paged_attention_ref (overnight/attention/torch_backend.py) over the
dequantized cache, and decode_fp8_mma_ref (attention_fp8_ref.py) with this kernel's roundings.
Selected by DecodeConfig.fp8_mma, launched from paged_decode.paged_decode, which owns the grid, the
splits and their reduce (same workspace rows, same meaning).

Why: paged_decode.py's kernel puts a KV head's G query heads on M (zero-padded to 16 rows) and converts
every K and V tile to fp16 before its dots: 136 conversions and ~130 register moves among ~790
instructions per 128-token tile on sm_90, 122 registers. Triton lowers an 8-bit dot with M = 16 by
converting too (mma.sync has no 8-bit form it uses on sm_90); only a warpgroup MMA (M a multiple of
64) reads 8-bit operands as stored. So this kernel computes the transposed products

    S^T [BLOCK_N, G] = K [BLOCK_N, D] . q8^T [D, G]          (A = the K tile, straight from shared memory)
    O^T [D, G]      += V^T [D, BLOCK_N] . P8^T [BLOCK_N, G]  (A = the token-major V tile, likewise)

where both A operands have their contracted dimension contiguous, as 8-bit MMA operands must: D for K,
tokens for V (kv_layout.py's token-major V). In the sm_90 SASS at 128-token tiles: 16 QGMMA and no
conversion of K or V per tile (8 F2FP round P), 534 instructions, 103 registers, three K/V buffers (the
page ids come one tile ahead, kv_tiles.py). The softmax runs along M: a cross-warp reduction through
shared memory.

With DecodeConfig.tma (the default on pages of 64 tokens) the same kernel fetches each K and V tile by
one TMA copy through host-side descriptors of the layer's K and V planes: no per-thread addresses or
masks, so each tile must lie inside one page (tma_supported says what else it needs). On the H200 the
page size was what mattered (bench/decode_pages_gpu.py: 4.2 TB/s on pages of 64 against 3.3 on pages of 16, with the
pointer gathers too); the copies added 1-3%.

Two roundings that the fp16 path does not make, both as FlashAttention-3's FP8 path does:
- q is quantized to e4m3 once per program, each head row with its own scale (its largest |value| maps
  to 448), so scores carry q's rounding (relative 2**-4) besides K's;
- P is quantized to e4m3 after scaling by 2**8 (exp2(s - m + 8) lies in [0, 256]): unscaled, weights
  below 2**-9 would flush to zero, which a long uniform context would feel. The row sums l are taken
  from the unrounded fp32 weights; log2-sum-exp removes the 8 again for the split reduce.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from overnight.kernels.kv_layout import is_fp8, k_head_major
from overnight.kernels.kv_tiles import decode_range, grid_coords, load_v_token_major_t, page_ids
from overnight.kernels.score_mods import sink_init, softcap

Q_MAX = 448.0  # e4m3's largest finite value: each q row's largest |value| maps onto it
P_SHIFT = 8.0  # log2 of the scale that moves P from [0, 1] to [0, 256] before its rounding to e4m3
# Hopper's 8-bit warpgroup MMA adds products into an accumulator of about 14 significant bits, and by
# Triton's sm_90 default a whole dot (128 head dims for a score, a tile's 64 tokens for O) sums there.
# With DecodeConfig.precise_acc each MMA K step's 32 products are summed there and then added to an fp32
# sum (tl.dot's max_num_imprecise_acc). Compiled for sm_90 at 64-token tiles this keeps the same 8 wgmma
# and 2 waits a tile and adds ~40 FADD to ~710 instructions (tests/test_kernels_attention_sm90.py);
# max_num_imprecise_acc=0 would instead drop the 8-bit wgmma altogether.
PRECISE_ACC_STEP = 32


@triton.jit
def to_e4m3(x, EXACT_CAST: tl.constexpr):
    """x (fp32, |x| <= 448) rounded to nearest e4m3. The GPU's cvt rounds correctly; the Triton
    interpreter halves values whose rounding carries into the next power of two (0.49 -> 0.25), so
    under it (EXACT_CAST) x is first rounded in fp32 (3 mantissa bits; steps of 2**-9 below 2**-6,
    e4m3's subnormals) and the cast is exact."""
    if EXACT_CAST:
        bits = x.to(tl.uint32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
        x = tl.where(tl.abs(x) < 0.015625, tl.floor(x * 512.0 + 0.5) / 512.0, normal)
    return x.to(tl.float8e4nv)


@triton.jit
def _decode_fp8_mma_kernel(
    q_ptr,
    cache_ptr,
    k_desc,  # TMA: K as [num_blocks * Hkv * PAGE, D] rows (head-major K), boxes of [BLOCK_N, D]; else None
    v_desc,  # TMA: token-major V as [num_blocks * Hkv * D, PAGE] rows, boxes of [D, BLOCK_N]; else None
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,  # [B, Hq, num_splits, D] fp32, used when SPLIT
    part_lse_ptr,  # [B, Hq, num_splits] fp32, log2 domain
    kv_scale_ptr,  # [2] float32 (k_scale, v_scale), read when HAS_SCALE
    sinks_ptr,  # [Hq] float32 sink logits, read when HAS_SINKS and not SPLIT (else the reduce adds them)
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
    SPLIT: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    V_RUN: tl.constexpr,  # min(PAGE, BLOCK_N)
    Q_MAX: tl.constexpr,
    P_SHIFT: tl.constexpr,
    EXACT_CAST: tl.constexpr,  # under the interpreter (see to_e4m3)
    HEADS_FIRST: tl.constexpr,  # grid (kv heads, requests, splits): DecodeConfig.heads_first
    TMA: tl.constexpr,  # tiles by TMA copies (DecodeConfig.tma): PAGE % BLOCK_N == 0, BLOCK_D == HEAD_DIM
    WINDOW: tl.constexpr,  # sliding window in tokens, 0: none (score_mods.py)
    SOFTCAP: tl.constexpr,  # logit softcap in log2 units, 0.0: none
    HAS_SINKS: tl.constexpr,
    MAX_IMPRECISE_ACC: tl.constexpr,  # None (Triton's sm_90 default) or PRECISE_ACC_STEP: see there
    CHUNK: tl.constexpr,  # attention chunk in tokens, 0: none (score_mods.py)
):
    b, kvh, num_kv_heads = grid_coords(HEADS_FIRST)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    # With a window the tiles start at a page (TMA: a tile) holding the first visible token: no page
    # wholly before the window is read (kv_tiles.decode_base), and the slots before it in that page are
    # this request's own finite values, masked out of the scores like the slots past the end.
    lo, start, end = decode_range(seq_len, split, num_splits, BLOCK_N, SPLIT, WINDOW, V_RUN, CHUNK)
    if SPLIT:
        if start >= end:
            return

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + b * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    amax = tl.max(tl.abs(q), 1)
    q_scale = tl.where(amax > 0.0, amax / Q_MAX, 1.0)  # padding rows are all zero: scale 1
    q8 = to_e4m3(q / q_scale[:, None], EXACT_CAST)
    col_scale = q_scale * qk_scale  # per query head: its q scale times the softmax scale
    if HAS_SCALE:
        col_scale = col_scale * tl.load(kv_scale_ptr)
        v_scale = tl.load(kv_scale_ptr + 1)
    else:
        v_scale = 1.0

    m_i, l_i = sink_init(sinks_ptr, heads, g_mask, BLOCK_G, HAS_SINKS and not SPLIT)
    l_i = l_i * tl.exp2(tl.zeros_like(l_i) + P_SHIFT)  # a sink's weight carries the same 2**P_SHIFT as p_t's
    acc = tl.zeros([BLOCK_D, BLOCK_G], tl.float32)  # O^T
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    k_base = cache_ptr + kvh * stride_ch
    v_base = cache_ptr + stride_ckv + kvh * (HEAD_DIM * PAGE)  # token-major V (kv_layout.py)
    # The page ids one tile ahead (kv_tiles.py says why); with TMA a tile has one page
    if TMA:
        page_next = tl.load(bt_row + start // PAGE, mask=start < end, other=0)
    else:
        page_next = page_ids(bt_row, start, end, BLOCK_N, PAGE)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        if WINDOW > 0 or CHUNK > 0:
            n_mask = n_mask & (offs_n >= lo)
        if TMA:
            head_page = page_next * num_kv_heads + kvh  # this (page, KV head)'s index among all of them
            page_next = tl.load(bt_row + (n0 + BLOCK_N) // PAGE, mask=n0 + BLOCK_N < end, other=0)
            # Slots past the context's end hold zeros or stale finite values (kv_layout.py): their
            # scores are masked and their probabilities are 0, so the copies need no mask.
            k = k_desc.load([head_page * PAGE + n0 % PAGE, 0])
            v_t = v_desc.load([head_page * HEAD_DIM, n0 % PAGE])
        else:
            page = page_next.to(tl.int64)
            page_next = page_ids(bt_row, n0 + BLOCK_N, end, BLOCK_N, PAGE)
            tok = page * stride_cblk + (offs_n % PAGE) * stride_cslot  # int64: a layer can exceed 2**31
            k = tl.load(
                k_base + tok[:, None] + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0
            )
            v_t = load_v_token_major_t(
                v_base, page, offs_n, offs_d, stride_cblk, HEAD_DIM, BLOCK_D, PAGE, V_RUN
            )
        s_t = tl.dot(k, tl.trans(q8), max_num_imprecise_acc=MAX_IMPRECISE_ACC) * col_scale[None, :]
        if SOFTCAP > 0:
            s_t = softcap(s_t, SOFTCAP)
        s_t = tl.where(n_mask[:, None], s_t, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s_t, 0))
        alpha = tl.exp2(m_i - m_new)
        p_t = tl.exp2(s_t - (m_new - P_SHIFT)[None, :])
        l_i = l_i * alpha + tl.sum(p_t, 0)
        acc = acc * alpha[None, :] + tl.dot(
            v_t, to_e4m3(p_t, EXACT_CAST), max_num_imprecise_acc=MAX_IMPRECISE_ACC
        )
        m_i = m_new

    # l_i == 0 only for an empty context (a padded request): write zeros, not NaN.
    out = acc * (v_scale / tl.where(l_i == 0.0, 1.0, l_i))[None, :]
    io_mask = d_mask[:, None] & g_mask[None, :]
    if not SPLIT:
        dst = out_ptr + b * stride_ot + heads[None, :] * stride_oh + offs_d[:, None]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        part = (b * (GROUP * num_kv_heads) + heads) * num_splits + split
        tl.store(part_out_ptr + part[None, :] * HEAD_DIM + offs_d[:, None], out, mask=io_mask)
        tl.store(part_lse_ptr + part, m_i - P_SHIFT + tl.log2(l_i), mask=g_mask)


def launch_decode_fp8_mma(
    grid: tuple[int, int, int],
    q,
    kv_cache,
    block_tables,
    seq_lens,
    out,
    part_out,
    part_lse,
    kv_scale,
    qk_scale: float,
    num_splits: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
    heads_first: bool = False,
    tma: bool = False,
    *,
    precise_acc: bool = False,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    chunk: int = 0,
) -> None:
    """The launch for paged_decode (which has checked every argument); same grid and workspace.
    tma: the K / V tiles by TMA copies (tma_supported must hold). window, softcap: the kernel's
    WINDOW / SOFTCAP constexprs (score_mods.layer_constexprs); sinks: [Hq] float32 or None; chunk: the
    CHUNK constexpr (score_mods.chunk_constexpr)."""
    _, num_blocks, page, num_kv_heads, head_dim = kv_cache.shape
    group = q.shape[1] // num_kv_heads
    k_desc = v_desc = None
    if tma:
        # Host-side descriptors of the layer's K and V planes: built at launch, captured by value in
        # a CUDA graph (the cache never moves).
        rows = num_blocks * num_kv_heads
        k_desc = TensorDescriptor(kv_cache[0], [rows * page, head_dim], [head_dim, 1], [block_n, head_dim])
        v_desc = TensorDescriptor(kv_cache[1], [rows * head_dim, page], [page, 1], [head_dim, block_n])
    _decode_fp8_mma_kernel[grid](
        q,
        kv_cache,
        k_desc,
        v_desc,
        block_tables,
        seq_lens,
        out,
        part_out,
        part_lse,
        kv_scale if kv_scale is not None else seq_lens,  # not read without a scale
        sinks if sinks is not None else seq_lens,  # not read without sinks
        qk_scale,
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
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        PAGE=page,
        BLOCK_N=block_n,
        SPLIT=num_splits > 1,
        HAS_SCALE=kv_scale is not None,
        V_RUN=min(page, block_n),
        Q_MAX=Q_MAX,
        P_SHIFT=P_SHIFT,
        EXACT_CAST=q.device.type == "cpu",  # only the interpreter runs on CPU tensors
        HEADS_FIRST=heads_first,
        TMA=tma,
        WINDOW=window,
        SOFTCAP=softcap,
        HAS_SINKS=sinks is not None,
        MAX_IMPRECISE_ACC=min(PRECISE_ACC_STEP, block_n) if precise_acc else None,  # K >= the step
        CHUNK=chunk,
        num_warps=num_warps,
        num_stages=num_stages,
    )


def tma_supported(kv_cache: torch.Tensor, block_n: int) -> str | None:
    """Why the TMA kernel cannot read this cache with tiles of block_n tokens (None: it can).

    It needs each tile inside one page and one KV head's K page and V page as single runs of the
    layer's K and V planes (head-major K, token-major V, blocks back to back: new_kv_cache's layout),
    a power-of-two head_dim, and row indices within int32."""
    _, num_blocks, page, num_kv_heads, head_dim = kv_cache.shape
    if not is_fp8(kv_cache.dtype):
        return "it reads FP8 caches only"
    if page % block_n:
        return f"block_size {page} is not a multiple of the tile's {block_n} tokens"
    if head_dim & (head_dim - 1) or head_dim < 16:
        return f"head_dim {head_dim} is not a power of two >= 16"
    if head_dim > 256 or block_n > 256:
        return f"a TMA box is at most 256 elements a side (head_dim {head_dim}, tile {block_n})"
    if not k_head_major(kv_cache) or kv_cache.stride()[1:] != (
        num_kv_heads * page * head_dim,
        head_dim,
        page * head_dim,
        1,
    ):
        return "K is not stored head-major with blocks back to back"
    if num_blocks * num_kv_heads * max(page, head_dim) >= 2**31:
        return "the cache has too many rows for int32 tile coordinates"
    return None
