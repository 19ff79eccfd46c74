"""How the paged attention kernels gather tiles of the cache: page ids, token-major V tiles, split ranges.

Shared by paged_decode.py, paged_decode_fp8.py and paged_prefill.py (kv_layout.py says where the bytes
sit). A tile covers BLOCK_N consecutive context tokens of one request and one KV head; it spans
BLOCK_N / PAGE pages whose physical ids come from the request's row of the block table.

Why page ids are worth a helper of their own: when a loop iteration loads its page ids and then K/V
through them, Triton's software pipeliner classes the K/V loads as indirect and issues each tile's
copies only one iteration ahead, waiting for all of them at the top of the next iteration (one buffer
in use: the load latency and the tile's arithmetic add up). Loading the *next* tile's page ids in this
iteration, as a loop-carried value, makes the K/V loads direct: the pipeliner then keeps num_stages - 1
tiles in flight and waits only for the oldest (seen in the sm_90 TTGIR: `async_wait {num = 2}` and
three buffers per operand at num_stages=4, against `{num = 0}` and one buffer).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def page_ids(bt_row, n0, end, BLOCK_N: tl.constexpr, PAGE: tl.constexpr):
    """Physical page of each token n0 .. n0 + BLOCK_N - 1 of a request (0 from `end` on)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    return tl.load(bt_row + offs_n // PAGE, mask=offs_n < end, other=0)


@triton.jit
def grid_coords(HEADS_FIRST: tl.constexpr):
    """(request, KV head, number of KV heads) of a decode program: the grid is (requests, KV heads,
    splits), or (KV heads, requests, splits) with HEADS_FIRST."""
    if HEADS_FIRST:
        return tl.program_id(1), tl.program_id(0), tl.num_programs(0)
    return tl.program_id(0), tl.program_id(1), tl.num_programs(1)


@triton.jit
def split_len(seq_len, num_splits, block_n):
    """Context tokens per split: an even share rounded up to whole tiles (0 for an empty context)."""
    return tl.cdiv(tl.cdiv(seq_len, num_splits), block_n) * block_n


@triton.jit
def decode_base(seq_len, WINDOW: tl.constexpr, ALIGN: tl.constexpr, CHUNK: tl.constexpr):
    """(lo, base) of a decode row at position seq_len - 1: lo its first visible token (0; with a window
    max(0, seq_len - WINDOW); with an attention chunk at least its chunk's start, floor((seq_len - 1) /
    CHUNK) * CHUNK), base the first token its tiles read, lo rounded down to ALIGN = min(page,
    BLOCK_N). Every page from base on holds a visible token, so a page that lies wholly before the
    window (the engine may have given it back: any contents, NaN included) is never read, and tiles
    from base stay within pages (TMA) and keep whole-page runs."""
    if WINDOW > 0:
        lo = tl.maximum(seq_len - WINDOW, 0)
    else:
        lo = seq_len * 0
    if CHUNK > 0:
        lo = tl.maximum(lo, (tl.maximum(seq_len, 1) - 1) // CHUNK * CHUNK)
    if WINDOW > 0 or CHUNK > 0:
        base = lo // ALIGN * ALIGN
    else:
        base = lo
    return lo, base


@triton.jit
def decode_range(
    seq_len,
    split,
    num_splits,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    WINDOW: tl.constexpr,
    ALIGN: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """(lo, start, end): a decode program reads tokens [start, end) and sees those >= lo. The splits
    share [base, seq_len) (decode_base) in whole tiles: a windowed layer reads at most
    min(seq_len, WINDOW + ALIGN - 1) tokens, however long the context, a chunked one at most
    CHUNK + ALIGN - 1."""
    lo, base = decode_base(seq_len, WINDOW, ALIGN, CHUNK)
    if WINDOW == 0 and CHUNK == 0:  # full attention: the expressions the kernels had before windows existed
        if SPLIT:
            per_split = split_len(seq_len, num_splits, BLOCK_N)
            start = split * per_split
            end = tl.minimum(start + per_split, seq_len)
        else:
            start = seq_len * 0
            end = seq_len
    elif SPLIT:
        per_split = split_len(seq_len - base, num_splits, BLOCK_N)
        start = base + split * per_split
        end = tl.minimum(start + per_split, seq_len)
    else:
        start = base
        end = seq_len
    return lo, start, end


@triton.jit
def active_splits(
    seq_len, num_splits, block_n, WINDOW: tl.constexpr, ALIGN: tl.constexpr, CHUNK: tl.constexpr
):
    """How many of decode_range's splits are non-empty (the others never ran)."""
    if WINDOW == 0 and CHUNK == 0:
        length = seq_len
    else:
        _, base = decode_base(seq_len, WINDOW, ALIGN, CHUNK)
        length = seq_len - base
    return tl.cdiv(length, tl.maximum(split_len(length, num_splits, block_n), 1))


@triton.jit
def load_v_token_major(
    v_base,
    page,
    offs_n,
    offs_d,
    stride_cblk,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    V_RUN: tl.constexpr,
    n_ok,
    MASK_N: tl.constexpr,
):
    """A [tokens, BLOCK_D] V tile of an FP8 cache (token-major inside each block, kv_layout.py). Runs
    of V_RUN = min(PAGE, BLOCK_N) tokens are contiguous (hinted: the page ids come from memory). No
    mask along tokens, which would split the 16-byte loads: slots past the context's end read block 0
    or stale values of a zeroed, saturated cache, and their probability is 0. A head_dim padded to
    BLOCK_D is masked (it would read the next head's values). MASK_N: only tokens with n_ok are read
    (a sliding window's edge tile, whose first pages may have been given back: any contents)."""
    v_tok = tl.max_contiguous(tl.multiple_of(page * stride_cblk + offs_n % PAGE, V_RUN), V_RUN)
    ptrs = v_base + v_tok[:, None] + offs_d[None, :] * PAGE
    if MASK_N:
        v = tl.load(ptrs, mask=n_ok[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    elif BLOCK_D == HEAD_DIM:
        v = tl.load(ptrs)
    else:
        v = tl.load(ptrs, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)
    return v


@triton.jit
def load_v_token_major_t(
    v_base,
    page,
    offs_n,
    offs_d,
    stride_cblk,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    V_RUN: tl.constexpr,
):
    """load_v_token_major's tile transposed, [BLOCK_D, tokens]: the A operand of O^T = V^T P^T, whose
    contracted dimension (tokens) is the contiguous one, as an 8-bit MMA operand must be."""
    v_tok = tl.max_contiguous(tl.multiple_of(page * stride_cblk + offs_n % PAGE, V_RUN), V_RUN)
    ptrs = v_base + v_tok[None, :] + offs_d[:, None] * PAGE
    if BLOCK_D == HEAD_DIM:
        v = tl.load(ptrs)
    else:
        v = tl.load(ptrs, mask=(offs_d < HEAD_DIM)[:, None], other=0.0)
    return v
