"""Batched LoRA: every token row adds (x @ A[slot]^T) @ B[slot]^T of its own adapter's slot to the base
layer's output, for all adapters of a step in one launch per op (Punica / S-LoRA).

    x [T, in] ──shrink──► h [T, n, R] (float32) ──expand──► y [T, out] += per slice s:
                  A [S, n, R, in]                   B [S, out, R]    y[:, off_s:off_{s+1}] += h[:, s] @ B[slot, off_s:off_{s+1}]^T

S device slots, n output slices of a fused layer (q/k/v: 3, gate/up: 2, else 1), R = max_lora_rank
(an adapter of lower rank sits zero-padded in its slot), out = sum of the slices' sizes (slice_offsets,
n + 1 entries). token_slots[t] is row t's slot, -1 for the base model (rows that add nothing).

One launch shape for prefill and decode: the step's adapter rows grouped by slot (SlotRows: a row
order, and per slot the start and count of its rows in it), one program per tile of BLOCK_M rows of
one slot (gathered through the order), a tensor-core dot per tile. A slot's weights are read once per
tile, not once per row (a decode step of 1,024 rows over 8 adapters reads each adapter 16 times, not
128), and the grid depends only on the slot count and `max_len`, so a CUDA graph captured at a bucket's
row count replays for any mix of slots: programs past their slot's count return at once. Each op has a
plain torch reference (`..._ref`) beside it, over token_slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the references below still work
    triton = None  # type: ignore[assignment]


@dataclass(frozen=True)
class SlotRows:
    """A step's adapter rows grouped by slot, int32 on the device: slot j's rows are
    order[starts[j] : starts[j] + lens[j]] (lens[j] 0: a slot without rows); base rows are in no group.
    max_len: the grid's tiles per slot cover this many rows, at least the largest count; None: every
    row of the input (a decode graph's bucket, so one captured launch serves every replay)."""

    order: torch.Tensor  # [>= adapter rows]
    starts: torch.Tensor  # [slots]
    lens: torch.Tensor  # [slots]
    max_len: int | None


def slot_rows_ref(token_slots: torch.Tensor, num_slots: int) -> SlotRows:
    """SlotRows of a row -> slot map (-1: base), rows of a slot in row order (what LoRABatch builds on
    the host)."""
    slots = token_slots.long()
    adapted = (slots >= 0).nonzero().squeeze(1)
    order = adapted[torch.sort(slots[adapted], stable=True).indices]
    lens = torch.bincount(slots[adapted], minlength=num_slots)[:num_slots]
    starts = torch.cumsum(lens, 0) - lens
    longest = int(lens.max()) if num_slots else 0
    return SlotRows(order.int(), starts.int(), lens.int(), max(longest, 1))


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

    @triton.jit
    def _shrink_kernel(
        x_ptr, a_ptr, order_ptr, starts_ptr, lens_ptr, h_ptr, K, R,
        stride_xt, stride_as, stride_an, stride_ar, stride_ht, stride_hn,
        PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        slot = tl.program_id(0)
        m = tl.program_id(1)
        s = tl.program_id(2)
        length = tl.load(lens_ptr + slot)
        if m * BLOCK_M < length:
            start = tl.load(starts_ptr + slot)
            idx = m * BLOCK_M + tl.arange(0, BLOCK_M)
            rmask = idx < length
            rows = tl.load(order_ptr + start + idx, mask=rmask, other=0).to(tl.int64)
            offs_r = tl.arange(0, BLOCK_R)
            acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
            x_rows = x_ptr + rows[:, None] * stride_xt
            a_base = a_ptr + slot.to(tl.int64) * stride_as + s * stride_an + offs_r[None, :] * stride_ar
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                kmask = offs_k < K
                xt = tl.load(x_rows + offs_k[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
                at = tl.load(a_base + offs_k[:, None], mask=kmask[:, None] & (offs_r < R)[None, :], other=0.0)
                acc += tl.dot(xt, at.to(xt.dtype), input_precision=PRECISION)
            h_rows = h_ptr + rows[:, None] * stride_ht + s * stride_hn
            tl.store(h_rows + offs_r[None, :], acc, mask=rmask[:, None] & (offs_r < R)[None, :])

    @triton.jit
    def _expand_kernel(
        y_ptr, h_ptr, b_ptr, order_ptr, starts_ptr, lens_ptr, offsets_ptr, R,
        stride_yt, stride_ht, stride_hn, stride_bs, stride_bn,
        NUM_SLICES: tl.constexpr, PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        slot = tl.program_id(0)
        m = tl.program_id(1)
        pid = tl.program_id(2)  # (column tile, slice)
        length = tl.load(lens_ptr + slot)
        s = pid % NUM_SLICES
        pn = pid // NUM_SLICES
        lo = tl.load(offsets_ptr + s)
        size = tl.load(offsets_ptr + s + 1) - lo
        if m * BLOCK_M < length and pn * BLOCK_N < size:
            start = tl.load(starts_ptr + slot)
            idx = m * BLOCK_M + tl.arange(0, BLOCK_M)
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

BLOCK_M = 16  # rows of one slot per program: a decode step's slots hold tens to hundreds of rows


def _block_r(r: int) -> int:
    return max(16, triton.next_power_of_2(r))


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32 models stay exact; tf32 is unused in 16-bit


def _check_rows(rows: SlotRows, num_slots: int) -> None:
    for name in ("order", "starts", "lens"):
        if getattr(rows, name).dtype != torch.int32:
            raise ValueError(f"lora: SlotRows.{name} must be int32")
    if rows.starts.shape[0] < num_slots or rows.lens.shape[0] < num_slots:
        raise ValueError(f"lora: SlotRows cover {rows.lens.shape[0]} slots, the weights {num_slots}")


def lora_shrink(
    x: torch.Tensor, a: torch.Tensor, rows: SlotRows, zero_base_rows: bool = True
) -> torch.Tensor:
    """h [T, n, R] float32 = per adapter row, A[slot] @ x (lora_shrink_ref). Other rows are zeros, or
    left unwritten without zero_base_rows (the expand never reads them; a tensor-parallel sum over the
    ranks would)."""
    if x.dim() != 2 or a.dim() != 4 or x.shape[1] != a.shape[3]:
        raise ValueError(
            f"lora shrink: x {list(x.shape)} and A {list(a.shape)} do not fit ([T, in], [S, n, R, in])"
        )
    if x.stride(1) != 1 or a.stride(3) != 1:
        raise ValueError("lora shrink: x and A must be contiguous along the input dimension")
    num_slots, n, r, k = a.shape
    _check_rows(rows, num_slots)
    h = (torch.zeros if zero_base_rows else torch.empty)(
        x.shape[0], n, r, dtype=torch.float32, device=x.device
    )
    if x.shape[0] == 0:
        return h
    grid = (num_slots, triton.cdiv(rows.max_len or x.shape[0], BLOCK_M), n)
    _shrink_kernel[grid](
        x, a, rows.order, rows.starts, rows.lens, h, k, r,
        x.stride(0), a.stride(0), a.stride(1), a.stride(2), h.stride(0), h.stride(1),
        PRECISION=_precision(x.dtype), BLOCK_M=BLOCK_M, BLOCK_R=_block_r(r),
        BLOCK_K=min(64, max(16, triton.next_power_of_2(k))),
    )  # fmt: skip
    return h


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
    _check_rows(rows, num_slots)
    if num_tokens == 0:
        return
    block_n = 64
    grid = (num_slots, triton.cdiv(rows.max_len or num_tokens, BLOCK_M), n * triton.cdiv(max_slice, block_n))
    _expand_kernel[grid](
        y, h, b, rows.order, rows.starts, rows.lens, offsets, r,
        y.stride(0), h.stride(0), h.stride(1), b.stride(0), b.stride(1),
        NUM_SLICES=n, PRECISION=_precision(b.dtype), BLOCK_M=BLOCK_M, BLOCK_R=_block_r(r), BLOCK_N=block_n,
    )  # fmt: skip
