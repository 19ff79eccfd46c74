"""Store this step's K/V rows into the paged cache: one launch for K and V of every row.

Reference: write_kv_ref in overnight/attention/torch_backend.py (cache layout in metadata.py and,
for an FP8 cache's token-major V, kv_layout.py).

Row t of k/v ([T, Hkv, D]) goes to flat slot s = slot_mapping[t], i.e. block s // block_size, slot
s % block_size of kv_cache[0] (K) and kv_cache[1] (V); rows with s == -1 (CUDA-graph padding) are skipped.
The launch depends only on shapes and device pointers, so it can be captured in a CUDA graph.

For a quantized cache (fp8) each value is divided by its layer's scale, read on the device from
kv_scale ([2] float32: k_scale, v_scale; see overnight/attention/kv_quant.py), and saturated to the
format's range before the cast; the attention kernels multiply the scale back in after loading. The
division rounds to nearest, as torch's does, so the kernel stores the reference's bytes exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from overnight.kernels.kv_layout import FP8_MAX, v_token_major

# Largest finite value of each 8-bit float format: stores saturate instead of turning into NaN/inf.

# One program stores one row; warps per program for that row's Hkv * D elements (bench/kernels_gpu.py
# compares 1, 2 and 4).
KV_WRITE_NUM_WARPS = 4


# A model with several KV cache groups reads group g's slots at g * rows of one packed buffer, so the
# pointer's 16-byte alignment changes with a step's row count: not specialized on (its loads are scalar),
# or each new alignment would compile a variant mid-run.
@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])
def _kv_write_kernel(
    k_ptr,
    v_ptr,
    cache_ptr,
    slot_ptr,
    kv_scale_ptr,  # [2] float32 (k_scale, v_scale), read when HAS_SCALE
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ckv,
    stride_cblk,
    stride_cslot,
    stride_ch,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SAT_MAX: tl.constexpr,  # 0.0: no saturation (cache not fp8)
    HAS_SCALE: tl.constexpr,
    V_TOKEN_MAJOR: tl.constexpr,  # V stored [Hkv, D, BLOCK_SIZE] per block (kv_layout.py)
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    k = k.to(tl.float32)
    v = v.to(tl.float32)
    if HAS_SCALE:
        k = tl.math.div_rn(k, tl.load(kv_scale_ptr))
        v = tl.math.div_rn(v, tl.load(kv_scale_ptr + 1))
    if SAT_MAX > 0.0:
        k = tl.minimum(tl.maximum(k, -SAT_MAX), SAT_MAX)
        v = tl.minimum(tl.maximum(v, -SAT_MAX), SAT_MAX)

    # int64: one layer's cache can hold more than 2**31 elements.
    dst = cache_ptr + blk * stride_cblk + off * stride_cslot
    dst = dst + offs_h[:, None].to(tl.int64) * stride_ch + offs_d[None, :]
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    if V_TOKEN_MAJOR:
        dst = cache_ptr + stride_ckv + blk * stride_cblk + off
        dst = dst + (offs_h[:, None] * HEAD_DIM + offs_d[None, :]).to(tl.int64) * BLOCK_SIZE
    else:
        dst = dst + stride_ckv
    tl.store(dst, v.to(cache_ptr.dtype.element_ty), mask=mask)


def check_kv_cache(kv_cache: torch.Tensor) -> None:
    """kv_cache[2, num_blocks, block_size, Hkv, D] with unit stride along D (the kernels vectorize there);
    an FP8 cache (token-major V, kv_layout.py) contiguous within each block."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache must be [2, num_blocks, block_size, Hkv, D], got {tuple(kv_cache.shape)}")
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must have unit stride along head_dim")
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    per_block = block_size * num_kv_heads * head_dim
    slot_major = (num_kv_heads * head_dim, head_dim, 1)
    head_major = (head_dim, block_size * head_dim, 1)  # kv_layout.new_kv_cache(head_major_k)
    # Blocks may lie further apart than a block's elements (kv_layout.kv_cache_view: a slot shared
    # with layers of a larger shape), never closer.
    if v_token_major(kv_cache.dtype) and (
        kv_cache.stride()[2:] not in (slot_major, head_major) or kv_cache.stride(1) < per_block
    ):
        raise ValueError(
            "an fp8 kv_cache must be contiguous within each block, as kv_layout.new_kv_cache makes it"
        )


def check_kv_scale(kv_scale: torch.Tensor | None, kv_cache: torch.Tensor) -> None:
    """A layer's scales: [2] float32 (k_scale, v_scale), contiguous, on the cache's device."""
    if kv_scale is None:
        return
    if kv_scale.shape != (2,) or kv_scale.dtype != torch.float32 or kv_scale.stride(0) != 1:
        raise ValueError(
            f"kv_scale must be a contiguous [2] float32 tensor, got {kv_scale.dtype} {tuple(kv_scale.shape)}"
        )
    if kv_scale.device != kv_cache.device:
        raise ValueError("kv_scale must be on the cache's device")


def kv_write(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
    num_warps: int = KV_WRITE_NUM_WARPS,
) -> None:
    """kv_cache[0/1] at slot_mapping[t] = k[t] / k_scale, v[t] / v_scale (cast to the cache dtype).

    k, v: [T, Hkv, D] with unit stride along D (views into a fused qkv tensor are fine);
    slot_mapping: [T] int64, -1 = skip the row; kv_scale: [2] float32 (k_scale, v_scale) on the
    device, None = store unscaled. An fp8 cache saturates either way.
    """
    check_kv_cache(kv_cache)
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_tokens = slot_mapping.shape[0]
    for name, x in (("k", k), ("v", v)):
        if x.dim() != 3 or x.shape[1:] != (num_kv_heads, head_dim) or x.shape[0] < num_tokens:
            raise ValueError(
                f"{name} must be [>= {num_tokens}, {num_kv_heads}, {head_dim}], got {tuple(x.shape)}"
            )
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride along head_dim")
    if slot_mapping.dtype != torch.int64 or slot_mapping.dim() != 1:
        raise ValueError("slot_mapping must be a 1-D int64 tensor")
    if not (k.device == v.device == kv_cache.device == slot_mapping.device):
        raise ValueError("k, v, kv_cache and slot_mapping must be on one device")
    check_kv_scale(kv_scale, kv_cache)
    if num_tokens == 0:
        return
    _kv_write_kernel[(num_tokens,)](
        k,
        v,
        kv_cache,
        slot_mapping,
        kv_scale if kv_scale is not None else slot_mapping,  # not read without a scale
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        BLOCK_SIZE=block_size,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        SAT_MAX=FP8_MAX.get(kv_cache.dtype, 0.0),
        HAS_SCALE=kv_scale is not None,
        V_TOKEN_MAJOR=v_token_major(kv_cache.dtype),
        num_warps=num_warps,
    )
