"""Tier (b): the Triton attention kernels on a cache view whose blocks lie further apart than a block's
elements (kernels/kv_layout.kv_cache_view: a tensor shared with layers of a larger shape, Gemma 4's
KV cache groups), against the PyTorch reference on a plain cache. The padding between blocks holds NaN:
a kernel reading or writing there fails the test."""

from __future__ import annotations

import pytest
import torch

from overnight.attention.torch_backend import TorchAttentionBackend, paged_attention_ref
from overnight.attention.triton_backend import TritonAttentionBackend, paged_attention
from overnight.kernels.kv_layout import kv_cache_view, new_kv_slots, to_logical_layout, v_view
from overnight.kernels.paged_decode import DecodeConfig
from overnight.kernels.paged_prefill import PrefillConfig
from tests.kernel_helpers import DEVICE, assert_close, make_batch, poisoned

pytestmark = pytest.mark.slow  # Triton-interpreter runs

HQ, HKV, D, BS = 4, 1, 32, 16
SLOT = BS * 2 * 64  # the slot of a layer with 2 KV heads x 64: four times this layer's block


def padded_copy(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots, view): the same cache contents in a view over NaN-filled slots of SLOT elements."""
    slots = new_kv_slots(cache.shape[1], SLOT, cache.dtype, DEVICE)
    slots.view(torch.uint8).fill_(0xFF) if slots.dtype.itemsize == 1 else slots.fill_(float("nan"))
    view = kv_cache_view(slots, BS, HKV, D)
    view[0].copy_(cache[0])
    v_view(view).copy_(v_view(cache))
    return slots, view


def test_view_strides_and_shape():
    slots = new_kv_slots(5, SLOT, torch.float32, "cpu")
    view = kv_cache_view(slots, BS, HKV, D)
    assert view.shape == (2, 5, BS, HKV, D) and view.stride() == (5 * SLOT, SLOT, HKV * D, D, 1)
    assert view.data_ptr() == slots.data_ptr()
    fp8 = kv_cache_view(new_kv_slots(5, SLOT, torch.float8_e4m3fn, "cpu"), BS, 2, D)
    assert fp8.stride() == (5 * SLOT, SLOT, D, BS * D, 1)  # head-major K, as new_kv_cache makes it
    with pytest.raises(ValueError, match="does not fit"):
        kv_cache_view(slots, BS, 8, 64)


def test_mixed_batch_on_a_padded_view_equals_the_reference():
    query_lens = [1, 1, 12, 30]
    seq_lens = [17, 40, 12, 45]
    meta, q, cache = make_batch(query_lens, seq_lens, 2, HQ, HKV, D, BS, torch.float32, seed=3)
    slots, view = padded_copy(cache)
    gen = torch.Generator().manual_seed(4)
    k = torch.randn(meta.num_tokens, HKV, D, generator=gen).to(DEVICE)
    v = torch.randn(meta.num_tokens, HKV, D, generator=gen).to(DEVICE)
    ref = TorchAttentionBackend().forward(q, k, v, cache, meta, 0.125)
    backend = TritonAttentionBackend(
        HQ,
        HKV,
        D,
        max_num_seqs=4,
        max_model_len=256,
        device=DEVICE,
        decode_config=DecodeConfig(block_n=16),
        prefill_config=PrefillConfig(16, 16, 4, 1),
    )
    out = backend.forward(q, k, v, view, meta, 0.125)
    assert_close(out, ref, torch.float32)
    torch.testing.assert_close(view, cache, rtol=0, atol=0)  # K/V written where the reference wrote
    block = BS * HKV * D
    assert slots[:, :, block:].isnan().all()  # the padding untouched


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn])
def test_fp8_padded_view_matches_the_reference(fp8: torch.dtype):
    meta, q, cache = make_batch(
        [1, 1, 9], [30, 7, 9], 2, HQ, HKV, D, BS, torch.float32, seed=5, cache_dtype=fp8
    )
    _, view = padded_copy(cache)
    scale = torch.tensor([0.05, 0.02], device=DEVICE)
    deq = to_logical_layout(cache).float()
    deq[0] *= 0.05
    deq[1] *= 0.02
    out = paged_attention(
        q,
        view,
        meta,
        0.125,
        out=poisoned(q),
        kv_scale=scale,
        num_splits=2,
        decode_config=DecodeConfig(block_n=16),
        prefill_config=PrefillConfig(16, 16, 4, 1),
    )
    assert_close(out, paged_attention_ref(q, deq, meta, 0.125), torch.float32)


def test_layers_of_two_pages_over_one_tensor_equal_the_reference():
    """Block scales (engine/kv_groups.py): a layer of 1 KV head x D in slots of 2 x D reads pages of
    2 x BS tokens, a layer of 2 x D pages of BS, both over one tensor, each through its own group's
    block ids (disjoint: a block belongs to one group at a time). Each layer's writes and attention
    equal the reference on a plain cache of its own page; blocks no group holds stay NaN."""
    from overnight.attention.torch_backend import build_metadata, write_kv_ref

    query_lens, seq_lens, nd = [1, 1, 12, 30], [17, 40, 12, 45], 2
    num_blocks, slot = 20, BS * 2 * D
    gen = torch.Generator().manual_seed(6)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    slots = new_kv_slots(num_blocks, slot, torch.float32, DEVICE).fill_(float("nan"))
    backend = TritonAttentionBackend(
        HQ,
        2,
        D,
        max_num_seqs=4,
        max_model_len=256,
        device=DEVICE,
        decode_config=DecodeConfig(block_n=16),
        prefill_config=PrefillConfig(16, 16, 4, 1),
    )
    held: list[int] = []
    for heads, page in ((2, BS), (1, 2 * BS)):  # the two groups' layers, one after the other
        tables = []
        for s in seq_lens:
            n = -(-s // page)
            tables.append(perm[len(held) : len(held) + n])
            held += tables[-1]
        view = kv_cache_view(slots, page, heads, D)
        assert view.shape[2] == page and view.stride(1) == slot
        plain = torch.full((2, num_blocks, page, heads, D), float("nan"), device=DEVICE)
        # The context before this step's queries, in both caches.
        past = [s - q for q, s in zip(query_lens, seq_lens, strict=True)]
        ctx = build_metadata(past, past, tables, page, device=DEVICE)
        k0 = torch.randn(ctx.num_tokens, heads, D, generator=gen).to(DEVICE)
        v0 = torch.randn(ctx.num_tokens, heads, D, generator=gen).to(DEVICE)
        write_kv_ref(k0, v0, plain, ctx.slot_mapping)
        write_kv_ref(k0, v0, view, ctx.slot_mapping)
        meta = build_metadata(query_lens, seq_lens, tables, page, num_decodes=nd, device=DEVICE)
        q = torch.randn(meta.num_tokens, HQ, D, generator=gen).to(DEVICE)
        k = torch.randn(meta.num_tokens, heads, D, generator=gen).to(DEVICE)
        v = torch.randn(meta.num_tokens, heads, D, generator=gen).to(DEVICE)
        ref = TorchAttentionBackend().forward(q, k, v, plain, meta, 0.125)
        out = backend.forward(q, k, v, view, meta, 0.125)
        assert_close(out, ref, torch.float32)
        ids = [b for t in tables for b in t]
        torch.testing.assert_close(view[:, ids], plain[:, ids], rtol=0, atol=0, equal_nan=True)
    free = [b for b in range(num_blocks) if b not in held]
    assert slots[:, free].isnan().all()
