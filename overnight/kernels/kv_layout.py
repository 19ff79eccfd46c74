"""Where a token's K and V sit inside one layer's cache tensor, and the FP8 formats it may be stored in.

The kernels and the torch reference (attention/) both read these facts from here.

    kv_cache[2, num_blocks, block_size, num_kv_heads, head_dim]

K (kv_cache[0]) is stored as the shape reads: block, slot, head, dim. So is V (kv_cache[1]) in a cache
of the compute dtype. V of an FP8 cache is stored token-major inside each block instead:

    kv_cache[1] memory, per block:  [num_kv_heads, head_dim, block_size]

Why: the P @ V product of attention contracts over tokens, and the tensor cores want each thread's
operand values consecutive along the contracted dimension. 16-bit values get transposed on their way
out of shared memory (ldmatrix.trans); Hopper has no such instruction for 8-bit values, so with V stored
like K the decode kernel read V from shared memory one byte at a time and an FP8 cache decoded only
1.2x faster than bf16. Token-major V makes it 1.45x (docs/benchmarks.md). A bf16 cache keeps the plain
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
    if not v_token_major(kv_cache.dtype):
        return kv_cache[1]
    return kv_cache[1].view(num_blocks, num_kv_heads, head_dim, block_size).permute(0, 3, 1, 2)


def new_kv_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """One layer's cache. A plain cache is left uninitialized (every slot is written before it is
    read; touching gigabytes of pages up front costs start-up time on the CPU); an FP8 cache is zeroed,
    see the module docstring (a memset of the whole pool takes tens of milliseconds on a GPU)."""
    if v_token_major(dtype):
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def to_storage_layout(logical: torch.Tensor) -> torch.Tensor:
    """A cache whose V is given as [2, num_blocks, block_size, Hkv, D] (as tests and benches build it)
    rearranged into the storage layout of its dtype."""
    if not v_token_major(logical.dtype):
        return logical
    cache = logical.clone()
    v_view(cache).copy_(logical[1])
    return cache


def to_logical_layout(cache: torch.Tensor) -> torch.Tensor:
    """The inverse of to_storage_layout: [2, num_blocks, block_size, Hkv, D] with V in token order."""
    if not v_token_major(cache.dtype):
        return cache
    return torch.stack([cache[0], v_view(cache)])
