"""Triton attention kernels against the PyTorch reference (torch_backend.py).

On a CPU-only machine conftest.py turns on the Triton interpreter, where only fp32/fp16 are meaningful;
with a GPU the same tests also run bf16. Shapes are small because the interpreter is slow.
"""

from __future__ import annotations

import pytest
import torch

from overnight.attention.metadata import AttentionMetadata
from overnight.attention.torch_backend import (
    TorchAttentionBackend,
    paged_attention_ref,
    write_kv_ref,
)
from overnight.attention.triton_backend import TritonAttentionBackend, paged_attention
from overnight.kernels.kv_layout import to_logical_layout
from overnight.kernels.kv_write import kv_write
from overnight.kernels.paged_decode import DecodeConfig, choose_num_splits
from overnight.kernels.paged_prefill import PrefillConfig
from tests.kernel_helpers import DEVICE, DTYPES, assert_close, make_batch, poisoned

pytestmark = pytest.mark.slow  # long Triton-interpreter runs


def poison_unused_slots(cache: torch.Tensor, meta: AttentionMetadata) -> None:
    """NaN in every slot past a request's length: the engine allocates the cache uninitialized."""
    block_size = cache.shape[2]
    used = torch.zeros(cache.shape[1] * block_size, dtype=torch.bool)
    for i, seq_len in enumerate(meta.seq_lens_cpu.tolist()):
        pos = torch.arange(seq_len)
        used[meta.block_tables[i].cpu().long()[pos // block_size] * block_size + pos % block_size] = True
    cache.view(2, -1, *cache.shape[3:])[:, ~used.to(cache.device)] = float("nan")


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_write_matches_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    num_tokens, hq, hkv, d, bs, nb = 13, 4, 2, 64, 16, 6
    # k and v as views into a fused qkv projection output: row stride larger than Hkv * D.
    qkv = torch.randn(num_tokens, hq + 2 * hkv, d, generator=gen).to(DEVICE, dtype)
    k, v = qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
    slots = torch.randperm(nb * bs, generator=gen)[:num_tokens]
    slots[[2, 7, 12]] = -1  # padding rows
    slots = slots.to(DEVICE)
    cache = torch.randn(2, nb, bs, hkv, d, generator=gen).to(DEVICE, dtype)
    expected = cache.clone()
    write_kv_ref(k, v, expected, slots)
    kv_write(k, v, cache, slots)
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_kv_write_fp8_scales_and_saturates(fp8: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    num_tokens, hkv, d, bs, nb, k_scale, v_scale = 9, 2, 32, 16, 2, 0.5, 2.0
    # Values that are exact in fp8 after scaling (powers of two): the interpreter's fp32 -> fp8 cast
    # rounds wrongly when the mantissa carries into the exponent, the GPU's cvt does not; so this test
    # checks the scaling, saturation and placement, not the rounding.
    k = torch.randn(num_tokens, hkv, d, generator=gen).mul(3).to(fp8).float() * k_scale
    v = torch.randn(num_tokens, hkv, d, generator=gen).mul(3).to(fp8).float() * v_scale
    k[0, 0, :4] = torch.tensor([1e6, -1e6, 1e5, -1e5])  # beyond either format's range after scaling
    k, v = k.to(DEVICE), v.to(DEVICE)
    slots = torch.randperm(nb * bs, generator=gen)[:num_tokens].to(DEVICE)
    slots[4] = -1
    cache = torch.zeros(2, nb, bs, hkv, d, dtype=fp8, device=DEVICE)
    kv_write(k, v, cache, slots, kv_scale=torch.tensor([k_scale, v_scale], device=DEVICE))
    limit = torch.finfo(fp8).max
    expected = torch.zeros(2, nb, bs, hkv, d, device=DEVICE)
    write_kv_ref((k / k_scale).clamp(-limit, limit), (v / v_scale).clamp(-limit, limit), expected, slots)
    assert torch.equal(to_logical_layout(cache).float(), expected)
    assert cache.float()[0, :, :, 0, 0].abs().max() == limit


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_matches_reference(dtype: torch.dtype, group: int, num_splits: int) -> None:
    hkv, d, bs = 2, 64, 16
    seq_lens = [1, 15, 16, 17, 40, 97]  # on, just before and just after page boundaries
    meta, q, cache = make_batch([1] * 6, seq_lens, 6, hkv * group, hkv, d, bs, dtype, seed=10 + group)
    out = paged_attention(
        q,
        cache,
        meta,
        scale=d**-0.5,
        out=poisoned(q),
        num_splits=num_splits,
        decode_config=DecodeConfig(block_n=32),
    )
    assert_close(out, paged_attention_ref(q, cache, meta, d**-0.5), dtype)


def test_decode_many_splits_and_odd_head_dim() -> None:
    """More splits than a short context has tiles (empty splits exit), head_dim not a power of two."""
    hkv, group, d, bs = 1, 4, 80, 16
    seq_lens = [3, 50, 200]
    meta, q, cache = make_batch([1] * 3, seq_lens, 3, hkv * group, hkv, d, bs, torch.float32, seed=3)
    out = paged_attention(
        q, cache, meta, 0.1, out=poisoned(q), num_splits=8, decode_config=DecodeConfig(block_n=16)
    )
    assert_close(out, paged_attention_ref(q, cache, meta, 0.1), torch.float32)


def test_decode_empty_context_gives_zeros() -> None:
    """A padded decode request (seq_len 0) must yield zeros, not NaN, with and without splitting."""
    meta, q, cache = make_batch([1, 1], [20, 1], 2, 4, 2, 32, 16, torch.float32, seed=4)
    ref = paged_attention_ref(q, cache, meta, 0.2)
    meta.seq_lens[1] = 0
    for num_splits in (1, 4):
        out = paged_attention(q, cache, meta, 0.2, out=poisoned(q), num_splits=num_splits)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        torch.testing.assert_close(out[0], ref[0], rtol=1e-4, atol=1e-4)


PREFILL_CASES = [
    # block_size, head_dim, PrefillConfig
    (16, 64, PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)),
    (32, 128, PrefillConfig(block_m=32, block_n=16, num_warps=4, num_stages=1)),
    (16, 128, PrefillConfig(block_m=16, block_n=64, num_warps=4, num_stages=1)),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,head_dim,config", PREFILL_CASES)
def test_prefill_matches_reference(
    dtype: torch.dtype, block_size: int, head_dim: int, config: PrefillConfig
) -> None:
    # Fresh prompts, chunks after cached prefixes (seq_len > q_len) and single-token chunks.
    query_lens = [33, 1, 20, 7, 1, 40]
    seq_lens = [33, 18, 84, 7, 1, 71]
    meta, q, cache = make_batch(
        query_lens, seq_lens, 0, 4, 2, head_dim, block_size, dtype, seed=block_size + head_dim
    )
    out = paged_attention(q, cache, meta, head_dim**-0.5, out=poisoned(q), prefill_config=config)
    assert_close(out, paged_attention_ref(q, cache, meta, head_dim**-0.5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_backend_mixed_batch_equals_torch_backend(dtype: torch.dtype) -> None:
    """Decodes and prefill chunks in one step: same cache contents and outputs as the CPU backend."""
    hq, hkv, d, bs = 8, 2, 64, 16
    query_lens = [1, 1, 1, 12, 30, 1]
    seq_lens = [17, 64, 5, 12, 45, 33]
    meta, q, cache = make_batch(query_lens, seq_lens, 3, hq, hkv, d, bs, dtype, seed=7)
    poison_unused_slots(cache, meta)
    gen = torch.Generator().manual_seed(8)
    k = torch.randn(meta.num_tokens, hkv, d, generator=gen).to(DEVICE, dtype)
    v = torch.randn(meta.num_tokens, hkv, d, generator=gen).to(DEVICE, dtype)
    cache_ref = cache.clone()
    ref = TorchAttentionBackend().forward(q, k, v, cache_ref, meta, 0.125)
    backend = TritonAttentionBackend(
        hq,
        hkv,
        d,
        max_num_seqs=8,
        max_model_len=4096,
        device=DEVICE,
        decode_config=DecodeConfig(block_n=16),
        prefill_config=PrefillConfig(32, 32, 4, 1),
    )
    assert backend.num_splits(meta.num_decodes) > 1  # the split path and its preallocated workspace
    out = backend.forward(q, k, v, cache, meta, 0.125)
    torch.testing.assert_close(cache, cache_ref, rtol=0, atol=0, equal_nan=True)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_cache_matches_reference_on_dequantized_cache(fp8: torch.dtype) -> None:
    hq, hkv, d, bs, k_scale, v_scale = 4, 2, 64, 16, 0.05, 0.02
    query_lens = [1, 1, 9, 20]
    seq_lens = [30, 7, 9, 50]
    meta, q, cache = make_batch(
        query_lens, seq_lens, 2, hq, hkv, d, bs, torch.float32, seed=5, cache_dtype=fp8
    )
    deq = to_logical_layout(cache).float()
    deq[0] *= k_scale
    deq[1] *= v_scale
    out = paged_attention(
        q,
        cache,
        meta,
        0.125,
        out=poisoned(q),
        kv_scale=torch.tensor([k_scale, v_scale], device=DEVICE),
        num_splits=2,
        decode_config=DecodeConfig(block_n=16),
        prefill_config=PrefillConfig(16, 16, 4, 1),
    )
    assert_close(out, paged_attention_ref(q, deq, meta, 0.125), torch.float32)


def test_num_splits_heuristic_is_static_and_bounded() -> None:
    assert choose_num_splits(256, 8, 32768) == 1  # 2048 programs already fill an H200
    assert choose_num_splits(8, 8, 32768) > 1
    assert choose_num_splits(1, 8, 600) == 2  # never below MIN_SPLIT_TOKENS per split
    assert all(1 <= choose_num_splits(b, h, 1 << 17) <= 32 for b in (1, 3, 64) for h in (1, 8))
