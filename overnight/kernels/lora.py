"""Batched LoRA: every token row adds (x @ A[slot]^T) @ B[slot]^T of its own adapter's slot to the base
layer's output, for all adapters of a step in one launch per op (Punica / S-LoRA).

    x [T, in] ──shrink──► h [T, n, R] (float32) ──expand──► y [T, out] += per slice s:
                  A [S, n, R, in]                   B [S, out, R]    y[:, off_s:off_{s+1}] += h[:, s] @ B[slot, off_s:off_{s+1}]^T

S device slots, n output slices of a fused layer (q/k/v: 3, gate/up: 2, else 1), R = max_lora_rank
(an adapter of lower rank sits zero-padded in its slot), out = sum of the slices' sizes (slice_offsets,
n + 1 entries). token_slots[t] is row t's slot, -1 for the base model (rows that add nothing).

One launch shape for prefill and decode: the step's adapter rows grouped by slot and cut into tiles
of at most block_m rows of one slot (SlotRows: a row order and a tile table), one program per tile
(rows gathered through the order), a tensor-core dot per tile. A slot's weights are read once per
tile, not once per row (a decode step of 1,024 rows over 8 adapters reads each adapter 16 times, not
128). Decode steps cut 16-row tiles (BLOCK_M), other steps 64-row ones (PREFILL_BLOCK_M). The grid
is the table's width: a decode graph's bucket of T rows captures cdiv(T, BLOCK_M) + slots tiles, as
many as any mix of slots needs, and replays for every mix (tiles past the step's count have no rows
and return at once), so no program waits on a slot it has no rows of. Each op has a plain torch
reference (`..._ref`) beside it, over token_slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the references below still work
    triton = None  # type: ignore[assignment]


BLOCK_M = 16  # rows of one slot per tile in a decode step: its slots hold tens to hundreds of rows
# In a prefill step a slot holds thousands of rows. With 16-row tiles each program read its slot's A
# for 16 rows of x only, three times x's bytes, and the shrink took 291.5 us a layer at 4,096 rows
# on an H100 where x's ~200 MB need ~60 (session U); 64-row tiles read A a quarter as often.
PREFILL_BLOCK_M = 64


@dataclass(frozen=True)
class SlotRows:
    """A step's adapter rows grouped by slot (base rows are in none), int32 on the device. Tile i
    covers the rows order[start_i : start_i + len_i], all of slot slot_i, len_i <= block_m, with
    (slot_i, start_i, len_i) = tiles[:, i]; a tile of length 0 does nothing. The kernels' grid has a
    program for each of the first num_tiles tiles; None: max_tiles(the input's rows, the weights'
    slots), what a decode graph's bucket captures."""

    order: torch.Tensor  # [>= adapter rows]
    tiles: torch.Tensor  # [3, >= num_tiles]: slot, start, length
    num_tiles: int | None
    block_m: int = BLOCK_M  # a tile's most rows (the kernels' BLOCK_M)


def max_tiles(num_rows: int, num_slots: int, block_m: int = BLOCK_M) -> int:
    """Tiles any grouping of num_rows rows over num_slots slots needs: each slot's last tile may be short."""
    return -(-num_rows // block_m) + num_slots


def tile_table(counts: np.ndarray, width: int | None = None, block_m: int = BLOCK_M) -> np.ndarray:
    """int32 [3, width] tiles of at most block_m rows of slots with counts[j] rows each, grouped in slot
    order (slot j's rows start at sum(counts[:j]) in the order); width None: exactly as many tiles as
    the rows need, else padded with empty tiles (a decode graph's fixed grid)."""
    per = -(-counts // block_m)
    total = int(per.sum())
    width = total if width is None else width
    if total > width:
        raise ValueError(f"lora: {total} tiles do not fit a table of {width}")
    out = np.zeros((3, width), dtype=np.int32)
    slot = np.repeat(np.arange(len(counts)), per)
    within = np.arange(total) - np.repeat(np.cumsum(per) - per, per)  # tile index inside its slot
    out[0, :total] = slot
    out[1, :total] = (np.cumsum(counts) - counts)[slot] + block_m * within
    out[2, :total] = np.minimum(block_m, counts[slot] - block_m * within)
    return out


def slot_rows_ref(
    token_slots: torch.Tensor, num_slots: int, padded: bool = False, block_m: int | None = None
) -> SlotRows:
    """SlotRows of a row -> slot map (-1: base), rows of a slot in row order, as LoRABatch builds them
    on the host; padded: as a decode graph's (BLOCK_M rows a tile, num_tiles None, the table padded
    with empty tiles), else a prefill step's (PREFILL_BLOCK_M rows a tile); block_m: other tiles (the
    bench's comparison)."""
    slots = token_slots.long()
    adapted = (slots >= 0).nonzero().squeeze(1)
    order = adapted[torch.sort(slots[adapted], stable=True).indices]
    counts = torch.bincount(slots[adapted], minlength=num_slots)[:num_slots].cpu().numpy()
    block_m = block_m or (BLOCK_M if padded else PREFILL_BLOCK_M)
    width = max_tiles(len(slots), num_slots) if padded else None
    tiles = torch.from_numpy(tile_table(counts, width, block_m)).to(token_slots.device)
    return SlotRows(order.int(), tiles, None if padded else tiles.shape[1], block_m)


# -- references ---------------------------------------------------------------------------------------


def lora_shrink_ref(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """h [T, n, R] float32: h[t, s] = A[slot_t, s] @ x[t] (zero for base rows). Loops over the slots in
    use (one host sync): the CPU path and the kernels' reference."""
    num_tokens = x.shape[0]
    _, n, r, _ = a.shape
    h = torch.zeros(num_tokens, n, r, dtype=torch.float32, device=x.device)
    slots = token_slots[:num_tokens].long()
    for slot in torch.unique(slots).tolist():
        if slot < 0:
            continue
        rows = (slots == slot).nonzero().squeeze(1)
        h[rows] = (x[rows].float() @ a[slot].reshape(n * r, -1).float().t()).view(-1, n, r)
    return h


def lora_expand_ref(
    y: torch.Tensor,
    h: torch.Tensor,
    b: torch.Tensor,
    token_slots: torch.Tensor,
    slice_offsets: tuple[int, ...],
) -> None:
    """y[t, off_s:off_{s+1}] += h[t, s] @ B[slot_t, off_s:off_{s+1}]^T for rows with a slot, in place."""
    slots = token_slots[: y.shape[0]].long()
    for slot in torch.unique(slots).tolist():
        if slot < 0:
            continue
        rows = (slots == slot).nonzero().squeeze(1)
        delta = torch.empty(len(rows), y.shape[1], dtype=torch.float32, device=y.device)
        for s in range(len(slice_offsets) - 1):
            lo, hi = slice_offsets[s], slice_offsets[s + 1]
            delta[:, lo:hi] = h[rows, s] @ b[slot, lo:hi].float().t()
        y[rows] += delta.to(y.dtype)


# -- kernels ------------------------------------------------------------------------------------------

if triton is not None:
    # The split count and its width change with the step's row count: specializing on them would
    # compile a variant mid-run.
    @triton.jit(do_not_specialize=["K_SPLIT", "NUM_SPLITS"])
    def _shrink_kernel(
        x_ptr, a_ptr, order_ptr, tiles_ptr, h_ptr, K, R, K_SPLIT, NUM_SPLITS,
        stride_xt, stride_as, stride_an, stride_ar, stride_hp, stride_ht, stride_hn, stride_tiles,
        PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        tile = tl.program_id(0)
        pid = tl.program_id(1)  # (slice, split of K)
        s = pid // NUM_SPLITS
        p = pid % NUM_SPLITS
        length = tl.load(tiles_ptr + 2 * stride_tiles + tile)
        if length > 0:
            slot = tl.load(tiles_ptr + tile)
            start = tl.load(tiles_ptr + stride_tiles + tile)
            idx = tl.arange(0, BLOCK_M)
            rmask = idx < length
            rows = tl.load(order_ptr + start + idx, mask=rmask, other=0).to(tl.int64)
            offs_r = tl.arange(0, BLOCK_R)
            acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
            x_rows = x_ptr + rows[:, None] * stride_xt
            a_base = a_ptr + slot.to(tl.int64) * stride_as + s * stride_an + offs_r[None, :] * stride_ar
            k_lo = p * K_SPLIT  # K_SPLIT is a multiple of BLOCK_K: no block crosses into the next split
            for k0 in range(k_lo, tl.minimum(k_lo + K_SPLIT, K), BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                kmask = offs_k < K
                xt = tl.load(x_rows + offs_k[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
                at = tl.load(a_base + offs_k[:, None], mask=kmask[:, None] & (offs_r < R)[None, :], other=0.0)
                acc += tl.dot(xt, at.to(xt.dtype), input_precision=PRECISION)
            h_rows = h_ptr + p.to(tl.int64) * stride_hp + rows[:, None] * stride_ht + s * stride_hn
            tl.store(h_rows + offs_r[None, :], acc, mask=rmask[:, None] & (offs_r < R)[None, :])

    @triton.jit
    def _expand_kernel(
        y_ptr, h_ptr, b_ptr, order_ptr, tiles_ptr, offsets_ptr, R,
        stride_yt, stride_ht, stride_hn, stride_bs, stride_bn, stride_tiles,
        NUM_SLICES: tl.constexpr, PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        tile = tl.program_id(0)
        pid = tl.program_id(1)  # (column tile, slice)
        length = tl.load(tiles_ptr + 2 * stride_tiles + tile)
        s = pid % NUM_SLICES
        pn = pid // NUM_SLICES
        lo = tl.load(offsets_ptr + s)
        size = tl.load(offsets_ptr + s + 1) - lo
        if length > 0 and pn * BLOCK_N < size:
            slot = tl.load(tiles_ptr + tile)
            start = tl.load(tiles_ptr + stride_tiles + tile)
            idx = tl.arange(0, BLOCK_M)
            rmask = idx < length
            rows = tl.load(order_ptr + start + idx, mask=rmask, other=0).to(tl.int64)
            cols = pn * BLOCK_N + tl.arange(0, BLOCK_N)
            cmask = cols < size
            offs_r = tl.arange(0, BLOCK_R)
            r_ok = offs_r < R
            ht = tl.load(
                h_ptr + rows[:, None] * stride_ht + s * stride_hn + offs_r[None, :],
                mask=rmask[:, None] & r_ok[None, :],
                other=0.0,
            )
            bt = tl.load(
                b_ptr + slot.to(tl.int64) * stride_bs + (lo + cols)[None, :] * stride_bn + offs_r[:, None],
                mask=r_ok[:, None] & cmask[None, :],
                other=0.0,
            )
            acc = tl.dot(ht.to(bt.dtype), bt, input_precision=PRECISION)
            y_ptrs = y_ptr + rows[:, None] * stride_yt + (lo + cols)[None, :]
            ymask = rmask[:, None] & cmask[None, :]
            y = tl.load(y_ptrs, mask=ymask, other=0.0)
            tl.store(y_ptrs, (y.to(tl.float32) + acc.to(tl.float32)).to(y.dtype), mask=ymask)


# -- wrappers -----------------------------------------------------------------------------------------

_SHRINK_BLOCK_K = 64
# Output columns a program adds to: bench/lora_gpu.py's 128 against 64 took 1-13% off the expand in all
# eight of its cases on an H200 (session V; decode 256 rows 32.5 -> 29.5 us a layer, prefill 4,096 rows
# 326.4 -> 311.6) and 2% at prefill on an H100 (session U); 256 columns lost in every case (up to 2.2x slower).
EXPAND_BLOCK_N = 128
_SHRINK_PROGRAMS = 1024  # ~8 a streaming multiprocessor on an H100 / H200 (132)
_MIN_K_SPLIT = 256


def _block_r(r: int) -> int:
    return max(16, triton.next_power_of_2(r))


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32 models stay exact; tf32 is unused in 16-bit


def _grid_tiles(rows: SlotRows, num_rows: int, num_slots: int) -> int:
    """The programs along the tiles: the checked table's count, or a decode graph's for this input."""
    for name in ("order", "tiles"):
        if getattr(rows, name).dtype != torch.int32:
            raise ValueError(f"lora: SlotRows.{name} must be int32")
    if rows.tiles.dim() != 2 or rows.tiles.shape[0] != 3 or rows.tiles.stride(1) != 1:
        raise ValueError(f"lora: SlotRows.tiles {list(rows.tiles.shape)} is not [3, tiles] by columns")
    count = max_tiles(num_rows, num_slots, rows.block_m) if rows.num_tiles is None else rows.num_tiles
    if count > rows.tiles.shape[1]:
        raise ValueError(f"lora: {count} tiles for a table of {rows.tiles.shape[1]}")
    return count


def shrink_splits(k: int, num_rows: int, n: int, block_m: int = BLOCK_M) -> tuple[int, int]:
    """(splits, width) of the input dimension: a decode step's adapter rows make few 16-row tiles
    (1,024 rows: 64), and one program per tile walking all of K (4,096 to 12,288) leaves most SMs idle
    and each program waiting on its loads, so K is split until the grid has about _SHRINK_PROGRAMS
    programs, each split at least _MIN_K_SPLIT wide. Depends only on the shapes: a graph's bucket
    replays the split it was captured with."""
    tiles = triton.cdiv(num_rows, block_m) * n
    return _split(k, max(1, min(triton.cdiv(_SHRINK_PROGRAMS, tiles), k // _MIN_K_SPLIT)))


def _split(k: int, splits: int) -> tuple[int, int]:
    """(parts, width): K cut into at most `splits` parts of a whole number of BLOCK_K columns (so no
    block crosses into the next part); the last may be short."""
    width = triton.cdiv(triton.cdiv(k, splits), _SHRINK_BLOCK_K) * _SHRINK_BLOCK_K
    return triton.cdiv(k, width), width


def lora_shrink(
    x: torch.Tensor, a: torch.Tensor, rows: SlotRows, zero_base_rows: bool = True, splits: int | None = None
) -> torch.Tensor:
    """h [T, n, R] float32 = per adapter row, A[slot] @ x (lora_shrink_ref). Other rows are zeros, or
    left unwritten without zero_base_rows (the expand never reads them; a tensor-parallel sum over the
    ranks would). splits: how many parts K is cut into (None: shrink_splits; the parts' partial sums
    are added in a fixed order, so a row's h does not depend on the split's timing)."""
    if x.dim() != 2 or a.dim() != 4 or x.shape[1] != a.shape[3]:
        raise ValueError(
            f"lora shrink: x {list(x.shape)} and A {list(a.shape)} do not fit ([T, in], [S, n, R, in])"
        )
    if x.stride(1) != 1 or a.stride(3) != 1:
        raise ValueError("lora shrink: x and A must be contiguous along the input dimension")
    num_slots, n, r, k = a.shape
    num_tiles = _grid_tiles(rows, x.shape[0], num_slots)
    parts_shape = (x.shape[0], n, r)
    # A fused layer's slices lie back to back in its A (LoRALinear's buffers do): one dot of n * R
    # columns covers them all, so each tile reads its rows of x once, not once a slice.
    if n > 1 and a.stride(1) == r * a.stride(2):
        a, n, r = a.view(num_slots, 1, n * r, k), 1, n * r
    splits, width = shrink_splits(k, x.shape[0], n, rows.block_m) if splits is None else _split(k, splits)
    parts = (torch.zeros if zero_base_rows else torch.empty)(
        splits, x.shape[0], n, r, dtype=torch.float32, device=x.device
    )
    if x.shape[0] > 0 and num_tiles > 0:
        _shrink_kernel[(num_tiles, n * splits)](
            x, a, rows.order, rows.tiles, parts, k, r, width, splits,
            x.stride(0), a.stride(0), a.stride(1), a.stride(2), parts.stride(0), parts.stride(1),
            parts.stride(2), rows.tiles.stride(0),
            PRECISION=_precision(x.dtype), BLOCK_M=rows.block_m, BLOCK_R=_block_r(r), BLOCK_K=_SHRINK_BLOCK_K,
        )  # fmt: skip
    return (parts[0] if splits == 1 else parts.sum(0)).view(parts_shape)


def lora_expand(
    y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, max_slice: int, rows: SlotRows
) -> None:
    """y += per adapter row and slice, h[:, s] @ B[slot, slice s]^T, in place (lora_expand_ref).
    offsets: the slices' column offsets, n + 1 int32 on the device; max_slice: the widest slice."""
    num_tokens, n_out = y.shape
    n = h.shape[1]
    num_slots, _, r = b.shape
    if b.dim() != 3 or b.shape[1] != n_out or h.shape[2] != r or y.stride(1) != 1 or b.stride(2) != 1:
        raise ValueError(f"lora expand: y {list(y.shape)}, h {list(h.shape)}, B {list(b.shape)} do not fit")
    num_tiles = _grid_tiles(rows, num_tokens, num_slots)
    if num_tokens == 0 or num_tiles == 0:
        return
    grid = (num_tiles, n * triton.cdiv(max_slice, EXPAND_BLOCK_N))
    _expand_kernel[grid](
        y, h, b, rows.order, rows.tiles, offsets, r,
        y.stride(0), h.stride(0), h.stride(1), b.stride(0), b.stride(1), rows.tiles.stride(0),
        NUM_SLICES=n, PRECISION=_precision(b.dtype), BLOCK_M=rows.block_m, BLOCK_R=_block_r(r),
        BLOCK_N=EXPAND_BLOCK_N,
    )  # fmt: skip
