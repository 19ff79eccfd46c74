"""Where a token's K and V sit inside one layer's cache tensor, and the FP8 formats it may be stored in.

The kernels and the torch reference (attention/) both read these facts from here.

    kv_cache[2, num_blocks, block_size, num_kv_heads, head_dim]

K (kv_cache[0]) and V (kv_cache[1]) of a cache in the compute dtype are stored as the shape reads: block,
slot, head, dim. An FP8 cache stores both head-major inside each block instead (the tensor keeps the
shape above as a strided view; the kernels address K through its strides):

    kv_cache[0] memory, per block:  [num_kv_heads, block_size, head_dim]   (K, see FP8_HEAD_MAJOR_K)
    kv_cache[1] memory, per block:  [num_kv_heads, head_dim, block_size]   (V, token-major)

Why: the P @ V product of attention contracts over tokens, and the tensor cores want each thread's
operand values consecutive along the contracted dimension. 16-bit values get transposed on their way
out of shared memory (ldmatrix.trans); Hopper has no such instruction for 8-bit values, so with V stored
like K the decode kernel read V from shared memory one byte at a time and an FP8 cache decoded only
1.2x faster than bf16. Token-major V makes it 1.45x (bench/kernels_gpu.py). A bf16 cache keeps the plain
layout: token-major was 6% slower there.

An FP8 cache is allocated zeroed: the kernels read V of whole pages without a mask (a mask that varies
along tokens would break the 16-byte loads). Slots past a context's end get probability 0, and 0 times
a stale value is 0 as long as no slot holds NaN or inf; zeroed memory and saturating writes ensure that.
"""

from __future__ import annotations

import torch

# The 8-bit float formats a cache (or, later, a weight) may be stored in, with their largest finite
# values: a quantizing write saturates to these (a plain cast of a larger value gives NaN).
FP8_MAX: dict[torch.dtype, float] = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


# An FP8 cache stores K head-major inside each block (new_kv_cache): one KV head's page is one 2-KB run
# instead of 16 runs of 128 bytes 1 KB apart. On the H200 the FP8 decode kernel was
# 0-1.9% faster on the seven Qwen3 cases of bench/attention_gpu.py ("hm" rows; b512 ctx2048 676 -> 665
# us) and a read-only probe of the cache (bench/kv_access_gpu.py) read 3.65 against 3.40 TB/s.
FP8_HEAD_MAJOR_K = True


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_MAX


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an 8-bit float format (448 for e4m3, 57344 for e5m2)."""
    return FP8_MAX[dtype]


def v_token_major(dtype: torch.dtype) -> bool:
    """True when V is stored [num_kv_heads, head_dim, block_size] inside each block (FP8 caches)."""
    return is_fp8(dtype)


def v_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """V as [num_blocks, block_size, num_kv_heads, head_dim] whatever the storage (a strided view:
    reading and assigning through it touches the cache itself)."""
    num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape[1:]
    v = kv_cache[1]
    if not v_token_major(kv_cache.dtype):
        return v
    # Token-major inside each block: (slot, head, dim) at head * D * block_size + dim * block_size + slot,
    # whichever order K's view gives the block's other two dimensions.
    strides = (v.stride(0), 1, head_dim * block_size, block_size)
    return v.as_strided((num_blocks, block_size, num_kv_heads, head_dim), strides, v.storage_offset())


def k_head_major(kv_cache: torch.Tensor) -> bool:
    """True when K is stored [num_kv_heads, block_size, head_dim] inside each block (see new_kv_cache)."""
    return kv_cache.shape[3] > 1 and kv_cache.stride(3) == kv_cache.shape[2] * kv_cache.shape[4]


def new_kv_cache(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, head_major_k: bool | None = None
) -> torch.Tensor:
    """One layer's cache. A plain cache is left uninitialized (every slot is written before it is
    read; touching gigabytes of pages up front costs start-up time on the CPU); an FP8 cache is zeroed,
    see the module docstring (a memset of the whole pool takes tens of milliseconds on a GPU).

    head_major_k (default FP8_HEAD_MAJOR_K for an FP8 cache, never for a plain one): K stored
    [num_kv_heads, block_size, head_dim] inside each block, returned as a strided view of the usual
    shape. The kernels address K through its strides, so only the bytes move: one KV head's 16
    tokens of a page become one run of block_size * head_dim bytes instead of 16 runs of head_dim."""
    if head_major_k is None:
        head_major_k = FP8_HEAD_MAJOR_K and is_fp8(dtype)
    two, num_blocks, block_size, num_kv_heads, head_dim = shape
    fill = torch.zeros if v_token_major(dtype) else torch.empty
    if not head_major_k:
        return fill(shape, dtype=dtype, device=device)
    storage = fill((two, num_blocks, num_kv_heads, block_size, head_dim), dtype=dtype, device=device)
    return storage.transpose(2, 3)


def new_kv_slots(
    num_blocks: int, slot_elems: int, dtype: torch.dtype, device: torch.device | str, planes: int = 2
) -> torch.Tensor:
    """A cache tensor shared by layers of different shapes: [2, num_blocks, slot_elems] (K plane, V plane),
    slot_elems = block_size x the most KV heads x head size any of its layers needs. Layers read it
    through kv_cache_view. Left uninitialized or zeroed as new_kv_cache leaves a cache. planes 1: a
    latent-attention cache, [1, num_blocks, slot_elems], one row per token (attention/mla.py)."""
    fill = torch.zeros if v_token_major(dtype) else torch.empty
    return fill((planes, num_blocks, slot_elems), dtype=dtype, device=device)


def kv_cache_view(
    slots: torch.Tensor, block_size: int, num_kv_heads: int, head_dim: int, head_major_k: bool | None = None
) -> torch.Tensor:
    """One layer's cache [2, num_blocks, block_size, Hkv, D] over a new_kv_slots tensor: the layout of
    new_kv_cache inside each block, blocks slots.stride(1) elements apart (a smaller layer leaves the
    rest of its block unused). The kernels and the torch reference address blocks through strides."""
    if head_major_k is None:
        head_major_k = FP8_HEAD_MAJOR_K and is_fp8(slots.dtype)
    two, num_blocks, slot_elems = slots.shape
    if block_size * num_kv_heads * head_dim > slot_elems:
        raise ValueError(f"a block of {block_size} x {num_kv_heads} x {head_dim} does not fit {slot_elems}")
    inner = (head_dim, block_size * head_dim, 1) if head_major_k else (num_kv_heads * head_dim, head_dim, 1)
    return slots.as_strided(
        (two, num_blocks, block_size, num_kv_heads, head_dim),
        (slots.stride(0), slots.stride(1), *inner),
        slots.storage_offset(),
    )


def to_storage_layout(logical: torch.Tensor, head_major_k: bool | None = None) -> torch.Tensor:
    """A cache whose V is given as [2, num_blocks, block_size, Hkv, D] (as tests and benches build it)
    rearranged into the storage layout of its dtype (head_major_k: as new_kv_cache)."""
    if not v_token_major(logical.dtype) and not head_major_k:
        return logical
    cache = new_kv_cache(tuple(logical.shape), logical.dtype, logical.device, head_major_k)
    cache[0].copy_(logical[0])
    v_view(cache).copy_(logical[1])
    return cache


def to_logical_layout(cache: torch.Tensor) -> torch.Tensor:
    """The inverse of to_storage_layout: [2, num_blocks, block_size, Hkv, D] with V in token order."""
    if not v_token_major(cache.dtype):
        return cache
    return torch.stack([cache[0], v_view(cache)])
