"""Batched LoRA: every token row adds (x @ A[slot]^T) @ B[slot]^T of its own adapter's slot to the base
layer's output, for all adapters of a step in one launch per op (Punica / S-LoRA).

    x [T, in] ──shrink──► h [T, n, R] (float32) ──expand──► y [T, out] += per slice s:
                  A [S, n, R, in]                   B [S, out, R]    y[:, off_s:off_{s+1}] += h[:, s] @ B[slot, off_s:off_{s+1}]^T

S device slots, n output slices of a fused layer (q/k/v: 3, gate/up: 2, else 1), R = max_lora_rank
(an adapter of lower rank sits zero-padded in its slot), out = sum of the slices' sizes (slice_offsets,
n + 1 entries). token_slots[t] is row t's slot, -1 for the base model (rows that add nothing).

Two launch shapes: BGMV (one program per row; decode steps, and the fixed grid CUDA graphs capture) and
SGMV (one program per tile of a segment of consecutive rows sharing a slot, tensor-core dots; prefill,
where a request's rows are consecutive). Each has a plain torch reference (`..._ref`) beside it.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the references below still work
    triton = None  # type: ignore[assignment]


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
    def _bgmv_shrink_kernel(
        x_ptr, a_ptr, slots_ptr, h_ptr, K, R,
        stride_xt, stride_as, stride_an, stride_ar, stride_ht, stride_hn,
        BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0)
        s = tl.program_id(1)
        slot = tl.load(slots_ptr + t)
        valid = slot >= 0
        slot = tl.maximum(slot, 0).to(tl.int64)
        offs_r = tl.arange(0, BLOCK_R)
        rmask = (offs_r < R) & valid
        acc = tl.zeros([BLOCK_R], dtype=tl.float32)
        a_row = a_ptr + slot * stride_as + s * stride_an + offs_r[:, None] * stride_ar
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            kmask = offs_k < K
            xk = tl.load(x_ptr + t.to(tl.int64) * stride_xt + offs_k, mask=kmask & valid, other=0.0)
            ak = tl.load(a_row + offs_k[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            acc += tl.sum(ak.to(tl.float32) * xk.to(tl.float32)[None, :], axis=1)
        tl.store(h_ptr + t.to(tl.int64) * stride_ht + s * stride_hn + offs_r, acc, mask=offs_r < R)

    @triton.jit
    def _bgmv_expand_kernel(
        y_ptr, h_ptr, b_ptr, slots_ptr, offsets_ptr, N, R,
        stride_yt, stride_ht, stride_hn, stride_bs, stride_bn,
        NUM_SLICES: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0)
        pn = tl.program_id(1)
        slot = tl.load(slots_ptr + t)
        valid = slot >= 0
        slot = tl.maximum(slot, 0).to(tl.int64)
        offs_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = (offs_n < N) & valid
        # The slice each output column belongs to: a tile may straddle two slices.
        sl = tl.zeros([BLOCK_N], dtype=tl.int32)
        for i in tl.static_range(1, NUM_SLICES):
            sl += (offs_n >= tl.load(offsets_ptr + i)).to(tl.int32)
        offs_r = tl.arange(0, BLOCK_R)
        mask = nmask[:, None] & (offs_r < R)[None, :]
        t64 = t.to(tl.int64)
        hv = tl.load(
            h_ptr + t64 * stride_ht + sl[:, None] * stride_hn + offs_r[None, :], mask=mask, other=0.0
        )
        bv = tl.load(
            b_ptr + slot * stride_bs + offs_n[:, None] * stride_bn + offs_r[None, :], mask=mask, other=0.0
        )
        acc = tl.sum(hv * bv.to(tl.float32), axis=1)
        y = tl.load(y_ptr + t64 * stride_yt + offs_n, mask=nmask, other=0.0)
        tl.store(y_ptr + t64 * stride_yt + offs_n, (y.to(tl.float32) + acc).to(y.dtype), mask=nmask)

    @triton.jit
    def _sgmv_shrink_kernel(
        x_ptr, a_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr, h_ptr, K, R,
        stride_xt, stride_as, stride_an, stride_ar, stride_ht, stride_hn,
        PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        seg = tl.program_id(0)
        m = tl.program_id(1)
        s = tl.program_id(2)
        start = tl.load(seg_start_ptr + seg).to(tl.int64)
        length = tl.load(seg_len_ptr + seg)
        slot = tl.load(seg_slot_ptr + seg)
        if m * BLOCK_M < length:
            # A base segment (slot -1) loads nothing and stores zeros: h is defined on every row, so a
            # tensor-parallel sum over ranks reads no garbage.
            # (a new name: the compiled language keeps a variable's type across an `if`)
            valid = slot >= 0
            slot64 = tl.maximum(slot, 0).to(tl.int64)
            rows = m * BLOCK_M + tl.arange(0, BLOCK_M)
            rmask = rows < length
            offs_r = tl.arange(0, BLOCK_R)
            acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
            x_rows = x_ptr + (start + rows)[:, None] * stride_xt
            a_base = a_ptr + slot64 * stride_as + s * stride_an + offs_r[None, :] * stride_ar
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                kmask = (offs_k < K) & valid
                xt = tl.load(x_rows + offs_k[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
                at = tl.load(a_base + offs_k[:, None], mask=kmask[:, None] & (offs_r < R)[None, :], other=0.0)
                acc += tl.dot(xt, at.to(xt.dtype), input_precision=PRECISION)
            h_rows = h_ptr + (start + rows)[:, None] * stride_ht + s * stride_hn
            tl.store(h_rows + offs_r[None, :], acc, mask=rmask[:, None] & (offs_r < R)[None, :])

    @triton.jit
    def _sgmv_expand_kernel(
        y_ptr, h_ptr, b_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr, offsets_ptr, R,
        stride_yt, stride_ht, stride_hn, stride_bs, stride_bn,
        NUM_SLICES: tl.constexpr, PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        seg = tl.program_id(0)
        m = tl.program_id(1)
        pid = tl.program_id(2)  # (column tile, slice)
        start = tl.load(seg_start_ptr + seg).to(tl.int64)
        length = tl.load(seg_len_ptr + seg)
        slot = tl.load(seg_slot_ptr + seg)
        s = pid % NUM_SLICES
        pn = pid // NUM_SLICES
        lo = tl.load(offsets_ptr + s)
        size = tl.load(offsets_ptr + s + 1) - lo
        if m * BLOCK_M < length and slot >= 0 and pn * BLOCK_N < size:
            slot64 = slot.to(tl.int64)  # a new name, as in the shrink kernel
            rows = m * BLOCK_M + tl.arange(0, BLOCK_M)
            rmask = rows < length
            cols = pn * BLOCK_N + tl.arange(0, BLOCK_N)
            cmask = cols < size
            offs_r = tl.arange(0, BLOCK_R)
            r_ok = offs_r < R
            ht = tl.load(
                h_ptr + (start + rows)[:, None] * stride_ht + s * stride_hn + offs_r[None, :],
                mask=rmask[:, None] & r_ok[None, :],
                other=0.0,
            )
            bt = tl.load(
                b_ptr + slot64 * stride_bs + (lo + cols)[None, :] * stride_bn + offs_r[:, None],
                mask=r_ok[:, None] & cmask[None, :],
                other=0.0,
            )
            acc = tl.dot(ht.to(bt.dtype), bt, input_precision=PRECISION)
            y_ptrs = y_ptr + (start + rows)[:, None] * stride_yt + (lo + cols)[None, :]
            ymask = rmask[:, None] & cmask[None, :]
            y = tl.load(y_ptrs, mask=ymask, other=0.0)
            tl.store(y_ptrs, (y.to(tl.float32) + acc.to(tl.float32)).to(y.dtype), mask=ymask)


# -- wrappers -----------------------------------------------------------------------------------------


def _block_r(r: int) -> int:
    return max(16, triton.next_power_of_2(r))


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32 models stay exact; tf32 is unused in 16-bit


def _check(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor) -> None:
    if x.dim() != 2 or a.dim() != 4 or x.shape[1] != a.shape[3]:
        raise ValueError(
            f"lora shrink: x {list(x.shape)} and A {list(a.shape)} do not fit ([T, in], [S, n, R, in])"
        )
    if x.stride(1) != 1 or a.stride(3) != 1:
        raise ValueError("lora shrink: x and A must be contiguous along the input dimension")
    if token_slots.dtype != torch.int32 or token_slots.shape[0] < x.shape[0]:
        raise ValueError("lora: token_slots must be int32 with a slot for every row")


def lora_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    token_slots: torch.Tensor,
    segments: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """h [T, n, R] float32 = per row, A[slot] @ x (lora_shrink_ref). segments: (starts, lens, slots,
    max_len) of runs of rows sharing a slot, int32 on the device, covering every row: the SGMV launch;
    None: BGMV, one program per row reading token_slots (fixed grid for a fixed T: what decode graphs
    capture). Rows of the base model (slot -1) get zeros."""
    _check(x, a, token_slots)
    num_tokens, k = x.shape
    _, n, r, _ = a.shape
    h = torch.empty(num_tokens, n, r, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return h
    block_r = _block_r(r)
    if segments is None:
        _bgmv_shrink_kernel[(num_tokens, n)](
            x, a, token_slots, h, k, r,
            x.stride(0), a.stride(0), a.stride(1), a.stride(2), h.stride(0), h.stride(1),
            BLOCK_R=block_r, BLOCK_K=min(128, triton.next_power_of_2(k)),
        )  # fmt: skip
        return h
    starts, lens, slots, max_len = segments
    block_m = 16
    grid = (starts.shape[0], triton.cdiv(max_len, block_m), n)
    _sgmv_shrink_kernel[grid](
        x, a, starts, lens, slots, h, k, r,
        x.stride(0), a.stride(0), a.stride(1), a.stride(2), h.stride(0), h.stride(1),
        PRECISION=_precision(x.dtype), BLOCK_M=block_m, BLOCK_R=block_r,
        BLOCK_K=min(64, max(16, triton.next_power_of_2(k))),
    )  # fmt: skip
    return h


def lora_expand(
    y: torch.Tensor,
    h: torch.Tensor,
    b: torch.Tensor,
    token_slots: torch.Tensor,
    offsets: torch.Tensor,
    max_slice: int,
    segments: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None,
) -> None:
    """y += per row and slice, h[:, s] @ B[slot, slice s]^T, in place (lora_expand_ref). offsets: the
    slices' column offsets, n + 1 int32 on the device; max_slice: the widest slice (host int)."""
    num_tokens, n_out = y.shape
    n = h.shape[1]
    r = b.shape[2]
    if b.dim() != 3 or b.shape[1] != n_out or h.shape[2] != r or y.stride(1) != 1 or b.stride(2) != 1:
        raise ValueError(f"lora expand: y {list(y.shape)}, h {list(h.shape)}, B {list(b.shape)} do not fit")
    if num_tokens == 0:
        return
    block_r = _block_r(r)
    if segments is None:
        block_n = 64
        _bgmv_expand_kernel[(num_tokens, triton.cdiv(n_out, block_n))](
            y, h, b, token_slots, offsets, n_out, r,
            y.stride(0), h.stride(0), h.stride(1), b.stride(0), b.stride(1),
            NUM_SLICES=n, BLOCK_R=block_r, BLOCK_N=block_n,
        )  # fmt: skip
        return
    starts, lens, slots, max_len = segments
    block_m, block_n = 16, 64
    grid = (starts.shape[0], triton.cdiv(max_len, block_m), n * triton.cdiv(max_slice, block_n))
    _sgmv_expand_kernel[grid](
        y, h, b, starts, lens, slots, offsets, r,
        y.stride(0), h.stride(0), h.stride(1), b.stride(0), b.stride(1),
        NUM_SLICES=n, PRECISION=_precision(b.dtype), BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_N=block_n,
    )  # fmt: skip
