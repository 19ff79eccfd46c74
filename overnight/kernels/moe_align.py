"""The router's (token, expert) pairs sorted by expert, each expert's run padded to the GEMM's BLOCK_M.

Reference: moe_align_ref (below).

T tokens with k experts each make P = T * k pairs; pair p = t * k + j chose expert topk_ids[t, j]. The
grouped GEMMs (moe_gemm.py) want every BLOCK_M-row tile to belong to one expert, so the pairs are listed
expert by expert, each run padded with the sentinel P:

    sorted_ids  [ pairs of e0 | P P | pairs of e2 ...          | P | ... ]   max_padded entries
    expert_ids  [ e0          | e2  | e2 | ...                          ]   one per BLOCK_M tile
    num_padded  [ sum over experts of round_up(count, BLOCK_M) ]             a device scalar

Experts nobody chose get no tile. Within an expert the pairs keep their order (a stable sort; the
atomic variant below lists them in any order, with the same results). Only the first num_padded entries of sorted_ids and num_padded / BLOCK_M of
expert_ids are written; GEMM tiles past num_padded exit at once. Every size is a function of (P, E,
BLOCK_M), never of the data, and nothing is read back to the host: capturable in a CUDA graph.

Three launches, the pairs cut into chunks of CHUNK:
  1. count    (a program per chunk)  counts[c, e] = pairs of expert e in chunk c
  2. offsets  (one program)          start and end of each expert's run; counts[c, e] becomes the
                                     number of e's pairs in chunks before c; sentinels into the
                                     padding slots; num_padded
  3. scatter  (a program per chunk)  pair p of expert e goes to
                                     start[e] + counts[c, e] + (its rank among e's pairs in chunk c);
                                     and its share of expert_ids, a tile's expert being the number of
                                     runs that end at or before the tile's first row
Ranks come from a cumulative sum over a [CHUNK, E] one-hot tile: no atomics. The one program of step 2
only walks the [chunks, E] counts; everything per pair or per tile is spread over the chunks.

The "atomic" variant (the default up to ATOMIC_DEFAULT_PAIRS pairs, decode-sized steps) trades the
stable order for fewer passes over the pairs: a zeroed [E] count, then
  1. count    (a program per BLOCK pairs)  rank[p] = atomic_add(counts[e], 1): e's pairs numbered in
                                           whatever order the adds land
  2. finish   (one program)                offsets, sentinels, expert_ids, then sorted_ids[start[e] +
                                           rank[p]] = p for every pair
Within an expert the pairs then come in any order. The results do not change: moe_gemm.py computes
each row on its own and stores it at its pair's index. The one-hot cumulative sums of the stable
variant are the cost this removes. Session L's profile (docs/performance.md) put the router and the
three stable launches at ~19 us a layer, against ~5.5 us for vLLM's routing. bench/moe_gpu.py times
both variants: atomic is faster up to ~2,048 pairs, stable past them (ATOMIC_DEFAULT_PAIRS).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

TILE_ELEMENTS = 4096  # size of the 2-D tiles the offsets kernel loops over
ONEHOT_ELEMENTS = 16384  # size of the [CHUNK, E] one-hot tiles of steps 1 and 3
# "stable": the three launches above (pairs in order within an expert); "atomic": counts and ranks by
# atomic adds, one program for the rest (module docstring).
ALIGN_VARIANTS = ("stable", "atomic")
# The default (variant None): atomic up to this many pairs, stable past it. Timed from CUDA graphs on an
# H100 at Qwen3-30B-A3B's routing (128 experts, top-8, bench/moe_gpu.py, session N): atomic 6.4 / 8.7 /
# 11.2 us at 8 / 512 / 2,048 pairs against stable's 12.3 / 13.7 / 13.5; from 4,096 pairs the atomic adds
# on one counter an expert contend and stable wins (13.5 against 15.3; 22.7 against 38.8 at 16,384).
ATOMIC_DEFAULT_PAIRS = 2048
# The atomic variant's finish is one program walking every pair: past this many, the stable variant.
ATOMIC_MAX_PAIRS = 16384
ATOMIC_BLOCK = 1024  # pairs per program of its count, and per iteration of its finish


class ExpertRuns(NamedTuple):
    sorted_ids: torch.Tensor  # [max_padded] int32: pair ids, expert by expert, P in padding slots
    expert_ids: torch.Tensor  # [max_padded / block_m] int32: the expert of each tile
    num_padded: torch.Tensor  # [1] int32: entries of sorted_ids in use
    block_m: int
    num_pairs: int


def max_padded(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most entries sorted_ids can need: each of at most min(E, P) chosen experts pads its run by
    at most block_m - 1; rounded up to whole tiles."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(bound, block_m) * block_m


def _chunk(e_p2: int) -> int:
    return max(16, min(256, ONEHOT_ELEMENTS // e_p2))


# The counts change every step (paged_prefill.py says why they are not specialized on).
@triton.jit(do_not_specialize=["num_pairs"])
def _moe_align_count_kernel(
    ids_ptr, counts_ptr, num_pairs, E: tl.constexpr, E_P2: tl.constexpr, CHUNK: tl.constexpr
):
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    offs_e = tl.arange(0, E_P2)
    ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=E_P2)  # E_P2 matches no lane
    onehot = (ids[:, None] == offs_e[None, :]).to(tl.int32)
    tl.store(counts_ptr + c * E + offs_e, tl.sum(onehot, axis=0), mask=offs_e < E)


@triton.jit(do_not_specialize=["num_chunks", "num_pairs"])
def _moe_align_offsets_kernel(
    counts_ptr,
    starts_ptr,
    ends_ptr,
    sorted_ids_ptr,
    num_padded_ptr,
    num_chunks,
    num_pairs,
    E: tl.constexpr,
    E_P2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    ROWS: tl.constexpr,  # chunks per iteration
    SLOTS: tl.constexpr,  # padding slots per expert per iteration
):
    offs_e = tl.arange(0, E_P2)
    e_mask = offs_e < E
    total = tl.zeros([E_P2], dtype=tl.int32)
    for c0 in range(0, num_chunks, ROWS):
        offs_c = c0 + tl.arange(0, ROWS)
        mask = (offs_c[:, None] < num_chunks) & e_mask[None, :]
        ptrs = counts_ptr + offs_c[:, None] * E + offs_e[None, :]
        tile = tl.load(ptrs, mask=mask, other=0)
        tl.store(ptrs, total[None, :] + tl.cumsum(tile, axis=0) - tile, mask=mask)
        total += tl.sum(tile, axis=0)

    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    tl.store(starts_ptr + offs_e, starts, mask=e_mask)
    tl.store(ends_ptr + offs_e, ends, mask=e_mask)
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))

    fill_from = starts + total
    for s0 in tl.static_range(0, BLOCK_M, SLOTS):
        slot = fill_from[:, None] + s0 + tl.arange(0, SLOTS)[None, :]
        sentinel = tl.full([E_P2, SLOTS], 0, tl.int32) + num_pairs
        tl.store(sorted_ids_ptr + slot, sentinel, mask=e_mask[:, None] & (slot < ends[:, None]))


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_align_scatter_kernel(
    ids_ptr,
    counts_ptr,
    starts_ptr,
    ends_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_padded_ptr,
    num_pairs,
    E: tl.constexpr,
    E_P2: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILES: tl.constexpr,  # expert_ids entries per program (a power of two)
):
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    offs_e = tl.arange(0, E_P2)
    mask = offs < num_pairs
    ids = tl.load(ids_ptr + offs, mask=mask, other=E_P2)
    onehot = (ids[:, None] == offs_e[None, :]).to(tl.int32)
    rank = tl.sum(tl.cumsum(onehot, axis=0) * onehot, axis=1) - 1
    ids = tl.where(mask, ids, 0)
    base = tl.load(starts_ptr + ids, mask=mask, other=0) + tl.load(
        counts_ptr + c * E + ids, mask=mask, other=0
    )
    tl.store(sorted_ids_ptr + base + rank, offs, mask=mask)

    ends = tl.load(ends_ptr + offs_e, mask=offs_e < E, other=2147483647)  # padding lanes end never
    offs_b = c * TILES + tl.arange(0, TILES)
    expert = tl.sum((ends[None, :] <= offs_b[:, None] * BLOCK_M).to(tl.int32), axis=1)
    num_tiles = tl.load(num_padded_ptr) // BLOCK_M
    tl.store(expert_ids_ptr + offs_b, expert, mask=offs_b < num_tiles)


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_align_atomic_count_kernel(ids_ptr, counts_ptr, ranks_ptr, num_pairs, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_pairs
    ids = tl.load(ids_ptr + offs, mask=mask, other=0)
    rank = tl.atomic_add(counts_ptr + ids, 1, mask=mask, sem="relaxed")  # the count before this pair's
    tl.store(ranks_ptr + offs, rank, mask=mask)


@triton.jit(do_not_specialize=["num_pairs", "max_tiles"])
def _moe_align_atomic_finish_kernel(
    ids_ptr,
    counts_ptr,
    ranks_ptr,
    starts_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_padded_ptr,
    num_pairs,
    max_tiles,
    E: tl.constexpr,
    E_P2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK: tl.constexpr,  # pairs per iteration of the scatter
    TILES: tl.constexpr,  # expert_ids entries per iteration
    SLOTS: tl.constexpr,  # padding slots per expert per iteration
):
    offs_e = tl.arange(0, E_P2)
    e_mask = offs_e < E
    counts = tl.load(counts_ptr + offs_e, mask=e_mask, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    total = tl.sum(padded, axis=0)
    tl.store(starts_ptr + offs_e, starts, mask=e_mask)
    tl.store(num_padded_ptr, total)

    fill_from = starts + counts
    for s0 in tl.static_range(0, BLOCK_M, SLOTS):
        slot = fill_from[:, None] + s0 + tl.arange(0, SLOTS)[None, :]
        sentinel = tl.full([E_P2, SLOTS], 0, tl.int32) + num_pairs
        tl.store(sorted_ids_ptr + slot, sentinel, mask=e_mask[:, None] & (slot < ends[:, None]))

    last = tl.where(e_mask, ends, 2147483647)  # padding lanes end never
    num_tiles = total // BLOCK_M
    for t0 in range(0, max_tiles, TILES):
        offs_b = t0 + tl.arange(0, TILES)
        expert = tl.sum((last[None, :] <= offs_b[:, None] * BLOCK_M).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + offs_b, expert, mask=offs_b < num_tiles)

    tl.debug_barrier()  # the starts stored above are read back below, by other threads of the program
    for p0 in range(0, num_pairs, BLOCK):
        offs = p0 + tl.arange(0, BLOCK)
        mask = offs < num_pairs
        ids = tl.load(ids_ptr + offs, mask=mask, other=0)
        dest = tl.load(starts_ptr + ids, mask=mask, other=0) + tl.load(ranks_ptr + offs, mask=mask, other=0)
        tl.store(sorted_ids_ptr + dest, offs, mask=mask)


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, variant: str | None = None
) -> ExpertRuns:
    """topk_ids [T, k] int32 (contiguous) -> the pairs sorted by expert, runs padded to block_m (a
    power of two). variant: ALIGN_VARIANTS (None: "atomic" up to ATOMIC_DEFAULT_PAIRS pairs, else
    "stable"); "atomic" past ATOMIC_MAX_PAIRS pairs runs as "stable"."""
    if topk_ids.dtype != torch.int32 or not topk_ids.is_contiguous():
        raise ValueError(f"topk_ids must be contiguous int32, got {topk_ids.dtype}")
    if block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m}")
    num_pairs = topk_ids.numel()
    if variant is None:
        variant = "atomic" if num_pairs <= ATOMIC_DEFAULT_PAIRS else "stable"
    if variant not in ALIGN_VARIANTS:
        raise ValueError(f"unknown alignment variant {variant!r} ({', '.join(ALIGN_VARIANTS)})")
    device = topk_ids.device
    size = max_padded(num_pairs, num_experts, block_m)
    sorted_ids = torch.empty(size, dtype=torch.int32, device=device)
    expert_ids = torch.empty(size // block_m, dtype=torch.int32, device=device)
    num_padded = torch.zeros(1, dtype=torch.int32, device=device)
    if num_pairs == 0:
        return ExpertRuns(sorted_ids, expert_ids, num_padded, block_m, num_pairs)

    e_p2 = triton.next_power_of_2(num_experts)
    if variant == "atomic" and num_pairs <= ATOMIC_MAX_PAIRS:
        _align_atomic(topk_ids, num_experts, block_m, sorted_ids, expert_ids, num_padded)
        return ExpertRuns(sorted_ids, expert_ids, num_padded, block_m, num_pairs)
    chunk = _chunk(e_p2)
    num_chunks = triton.cdiv(num_pairs, chunk)
    counts = torch.empty(num_chunks, num_experts, dtype=torch.int32, device=device)
    starts = torch.empty(num_experts, dtype=torch.int32, device=device)
    ends = torch.empty(num_experts, dtype=torch.int32, device=device)
    warps = 8 if chunk * e_p2 >= 8192 else 4
    _moe_align_count_kernel[(num_chunks,)](
        topk_ids, counts, num_pairs, E=num_experts, E_P2=e_p2, CHUNK=chunk, num_warps=warps
    )
    rows = max(1, TILE_ELEMENTS // e_p2)
    _moe_align_offsets_kernel[(1,)](
        counts,
        starts,
        ends,
        sorted_ids,
        num_padded,
        num_chunks,
        num_pairs,
        E=num_experts,
        E_P2=e_p2,
        BLOCK_M=block_m,
        ROWS=rows,
        SLOTS=min(block_m, rows),
        num_warps=8,
    )
    tiles = triton.next_power_of_2(triton.cdiv(expert_ids.numel(), num_chunks))
    _moe_align_scatter_kernel[(num_chunks,)](
        topk_ids,
        counts,
        starts,
        ends,
        sorted_ids,
        expert_ids,
        num_padded,
        num_pairs,
        E=num_experts,
        E_P2=e_p2,
        CHUNK=chunk,
        BLOCK_M=block_m,
        TILES=tiles,
        num_warps=warps,
    )
    return ExpertRuns(sorted_ids, expert_ids, num_padded, block_m, num_pairs)


def _align_atomic(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    sorted_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_padded: torch.Tensor,
) -> None:
    num_pairs = topk_ids.numel()
    device = topk_ids.device
    e_p2 = triton.next_power_of_2(num_experts)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    ranks = torch.empty(num_pairs, dtype=torch.int32, device=device)
    starts = torch.empty(num_experts, dtype=torch.int32, device=device)
    _moe_align_atomic_count_kernel[(triton.cdiv(num_pairs, ATOMIC_BLOCK),)](
        topk_ids, counts, ranks, num_pairs, BLOCK=ATOMIC_BLOCK, num_warps=4
    )
    _moe_align_atomic_finish_kernel[(1,)](
        topk_ids,
        counts,
        ranks,
        starts,
        sorted_ids,
        expert_ids,
        num_padded,
        num_pairs,
        expert_ids.numel(),
        E=num_experts,
        E_P2=e_p2,
        BLOCK_M=block_m,
        BLOCK=ATOMIC_BLOCK,
        TILES=max(16, TILE_ELEMENTS // e_p2),
        SLOTS=min(block_m, max(1, TILE_ELEMENTS // e_p2)),
        num_warps=8,
    )


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertRuns:
    """The same, by a stable sort on the host side of PyTorch (data-dependent: not capturable)."""
    flat = topk_ids.flatten().long()
    num_pairs = flat.numel()
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    sorted_ids, expert_ids, pos = [], [], 0
    for expert, count in enumerate(counts):
        padded = -(-count // block_m) * block_m
        sorted_ids += order[pos : pos + count].tolist() + [num_pairs] * (padded - count)
        expert_ids += [expert] * (padded // block_m)
        pos += count
    size = max_padded(num_pairs, num_experts, block_m)
    device = topk_ids.device

    def padded_to(values: list[int], n: int) -> torch.Tensor:
        return torch.tensor(values + [-1] * (n - len(values)), dtype=torch.int32, device=device)

    return ExpertRuns(
        padded_to(sorted_ids, size),
        padded_to(expert_ids, size // block_m),
        torch.tensor([len(sorted_ids)], dtype=torch.int32, device=device),
        block_m,
        num_pairs,
    )
