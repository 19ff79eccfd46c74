"""Chunked local attention (Llama 4's chunked layers: a query at position p sees keys floor(p / C) * C ..
p, LayerAttention.attention_chunk) in the PyTorch reference and the Triton kernels.

The reference is checked against a dense per-position loop (fast); the kernels, under the Triton
interpreter on the CPU, against the reference: paged decode (with splits), paged prefill (fresh prompts,
chunks after a cached prefix, query tiles that straddle a chunk boundary, a window and a chunk
together), both through the backends in one mixed step, and the FP8 e4m3-dot decode against its
rounding emulation. Blocks wholly before the first key a request's rows see are NaN: the kernels must not
read them (they never need to; the engine keeps them all the same, ModelArch.layer_chunk). Chunk of 16
(8 for the small cases), contexts crossing two to three chunk boundaries; fp32, tiny shapes.
"""

from __future__ import annotations

import pytest
import torch

from overnight.attention.metadata import AttentionMetadata
from overnight.attention.spec import FULL_ATTENTION, LayerAttention
from overnight.attention.torch_backend import TorchAttentionBackend, build_metadata, paged_attention_ref
from overnight.attention.triton_backend import TritonAttentionBackend, paged_attention
from overnight.kernels.attention_fp8_ref import decode_fp8_mma_ref, prefill_fp8_mma_ref
from overnight.kernels.kv_layout import k_head_major, to_logical_layout, to_storage_layout
from overnight.kernels.paged_decode import DecodeConfig
from overnight.kernels.paged_prefill import PrefillConfig
from tests.kernel_helpers import DEVICE, assert_close, make_batch, poisoned
from tests.triton_fp8 import exact_fp8_casts

F32 = torch.float32


def _dense(q, k, v, scale, chunk, window):
    """One request whose rows sit at positions 0..n-1: q [n, Hq, D], k/v [n, Hkv, D]."""
    hq, hkv = q.shape[1], k.shape[1]
    out = torch.empty_like(q)
    for p in range(q.shape[0]):
        lo = p // chunk * chunk
        if window is not None:
            lo = max(lo, p - window + 1)
        for h in range(hq):
            kh, vh = k[lo : p + 1, h // (hq // hkv)], v[lo : p + 1, h // (hq // hkv)]
            out[p, h] = ((kh @ q[p, h]) * scale).softmax(0) @ vh
    return out


@pytest.mark.parametrize("window", [None, 5, 30])
def test_reference_against_dense_loop(window):
    """Prefill chunks of 9, 11 and 3 rows then one decode row over 24 positions (chunk 8: the prefill
    chunks cross chunk boundaries mid-way), blocks before the current chunk poisoned as they fall
    behind: NaN never leaks in."""
    torch.manual_seed(0)
    hq, hkv, d, bs, length, chunk = 4, 2, 8, 4, 24, 8
    q, k, v = torch.randn(length, hq, d), torch.randn(length, hkv, d), torch.randn(length, hkv, d)
    layer = LayerAttention(sliding_window=window, attention_chunk=chunk)
    cache = torch.full((2, 8, bs, hkv, d), float("nan"))
    table = [[5, 2, 7, 0, 3, 6]]
    ref = _dense(q, k, v, 0.3, chunk, window)
    backend = TorchAttentionBackend()
    got = []
    for lo, hi in [(0, 9), (9, 20), (20, 23)]:
        meta = build_metadata([hi - lo], [hi], table, bs)
        got.append(backend.forward(q[lo:hi], k[lo:hi], v[lo:hi], cache, meta, 0.3, layer=layer))
    cache[:, [5, 2, 7, 0]] = float("nan")  # positions 0..15: before the decode row's chunk (16..23)
    meta = build_metadata([1], [length], table, bs, num_decodes=1)
    got.append(backend.forward(q[23:], k[23:], v[23:], cache, meta, 0.3, layer=layer))
    torch.testing.assert_close(torch.cat(got), ref, rtol=1e-5, atol=1e-5)
    full = _dense(q, k, v, 0.3, length, window)  # one chunk of everything: plain causal attention
    assert not torch.allclose(full[8:], ref[8:], atol=1e-3)


def test_bad_chunk_refused():
    with pytest.raises(ValueError, match="attention_chunk must be >= 1"):
        LayerAttention(attention_chunk=0)


def poison_before_chunks(cache: torch.Tensor, meta: AttentionMetadata, chunk: int, keep_block_0=False) -> int:
    """NaN in every block wholly before the first key any row of its request sees (the first row's
    chunk start), and in every block no request uses. Returns how many blocks of the tables were
    poisoned."""
    block_size = cache.shape[2]
    used = torch.zeros(cache.shape[1], dtype=torch.bool)
    qsl, sl = meta.query_start_loc_cpu.tolist(), meta.seq_lens_cpu.tolist()
    poisoned_blocks = 0
    for i, seq_len in enumerate(sl):
        first = (seq_len - (qsl[i + 1] - qsl[i])) // chunk * chunk
        table = meta.block_tables[i].cpu().tolist()
        for b in range((seq_len + block_size - 1) // block_size):
            if (b + 1) * block_size <= first:
                poisoned_blocks += 1
            else:
                used[table[b]] = True
    if keep_block_0:  # an FP8 cache's V tiles read past the end unmasked (test_kernels_attention_window.py)
        used[0] = True
    logical = to_logical_layout(cache).float()
    logical[:, ~used.to(cache.device)] = float("nan")
    cache.copy_(to_storage_layout(logical.to(cache.dtype), head_major_k=k_head_major(cache)))
    return poisoned_blocks


# Decode contexts: inside the first chunk, on and just past chunk edges, two to three chunks in.
DECODE_LENS = [3, 16, 17, 33, 40, 48, 49]


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("block_n", [8, 16])
def test_decode_chunk(num_splits, block_n):
    if block_n < 16 and torch.cuda.is_available():
        pytest.skip("8-token tiles are for the interpreter: a GPU dot contracts at least 16")
    hkv, group, d, bs, chunk = 2, 2, 16, 8, 16
    n = len(DECODE_LENS)
    meta, q, cache = make_batch([1] * n, DECODE_LENS, n, hkv * group, hkv, d, bs, F32, seed=7)
    q = q * 3  # sharp scores: a wrong first key shows
    clean = cache.clone()
    assert poison_before_chunks(cache, meta, chunk) > 0
    layer = LayerAttention(attention_chunk=chunk)
    ref = paged_attention_ref(q, cache, meta, d**-0.5, layer=layer)
    out = paged_attention(
        q, cache, meta, d**-0.5, out=poisoned(q), layer=layer, num_splits=num_splits,
        decode_config=DecodeConfig(block_n=block_n),
    )  # fmt: skip
    assert_close(out, ref, F32)
    assert not torch.allclose(ref, paged_attention_ref(q, clean, meta, d**-0.5), atol=1e-2)


# Prefill: a fresh prompt of three chunks, chunks after cached prefixes (starting mid-chunk and on a
# chunk edge), a single-token chunk, a prompt within one chunk.
PREFILL_QUERY = [40, 13, 16, 1, 9]
PREFILL_SEQ = [40, 37, 48, 35, 9]


@pytest.mark.parametrize(
    "layer,config",
    [
        (LayerAttention(attention_chunk=16), PrefillConfig(16, 16, 4, 1)),
        (LayerAttention(attention_chunk=8), PrefillConfig(16, 16, 4, 1)),  # tiles straddle chunk edges
        (LayerAttention(attention_chunk=16), PrefillConfig(32, 16, 4, 1, prefetch_pages=False)),
        (LayerAttention(sliding_window=6, attention_chunk=16), PrefillConfig(16, 32, 4, 1)),
    ],
    ids=["c16", "c8-straddle", "c16-m32", "w6-c16"],
)
def test_prefill_chunk(layer, config):
    hq, hkv, d, bs = 4, 2, 16, 8
    meta, q, cache = make_batch(PREFILL_QUERY, PREFILL_SEQ, 0, hq, hkv, d, bs, F32, seed=9)
    q = q * 3
    clean = cache.clone()
    chunk = layer.attention_chunk
    assert chunk is not None and poison_before_chunks(cache, meta, chunk) > 0
    ref = paged_attention_ref(q, cache, meta, d**-0.5, layer=layer)
    out = paged_attention(q, cache, meta, d**-0.5, out=poisoned(q), layer=layer, prefill_config=config)
    assert_close(out, ref, F32)
    window_only = LayerAttention(sliding_window=layer.sliding_window)
    assert not torch.allclose(ref, paged_attention_ref(q, clean, meta, d**-0.5, layer=window_only), atol=1e-2)


def test_backend_mixed_step_with_chunk():
    """Decodes and prefill chunks in one step through both backends (same cache writes); the backend's
    decode splits for a chunked layer are chosen for the chunk's length."""
    hq, hkv, d, bs, chunk = 4, 2, 16, 8, 16
    query_lens, seq_lens = [1, 1, 20, 7], [45, 17, 36, 7]
    meta, q, cache = make_batch(query_lens, seq_lens, 2, hq, hkv, d, bs, F32, seed=11)
    gen = torch.Generator().manual_seed(12)
    k = torch.randn(meta.num_tokens, hkv, d, generator=gen).to(DEVICE)
    v = torch.randn(meta.num_tokens, hkv, d, generator=gen).to(DEVICE)
    layer = LayerAttention(attention_chunk=chunk)
    cache_ref = cache.clone()
    ref = TorchAttentionBackend().forward(q, k, v, cache_ref, meta, 0.25, layer=layer)
    backend = TritonAttentionBackend(
        hq, hkv, d, max_num_seqs=4, max_model_len=8192, device=DEVICE,
        decode_config=DecodeConfig(block_n=16), prefill_config=PrefillConfig(16, 16, 4, 1),
    )  # fmt: skip
    assert backend.num_splits(2, chunk=16) == 1 < backend.num_splits(2, chunk=2048) < backend.num_splits(2)
    out = backend.forward(q, k, v, cache, meta, 0.25, layer=layer)
    torch.testing.assert_close(cache, cache_ref, rtol=0, atol=0, equal_nan=True)
    assert_close(out, ref, F32)
    full = TorchAttentionBackend().forward(q, None, None, cache_ref, meta, 0.25, layer=FULL_ATTENTION)
    assert not torch.allclose(ref, full, atol=1e-2)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_fp8_mma_decode_chunk(num_splits, tma):
    """The e4m3-dot decode (the FP8 caches' default kernel), tiles by pointers and by TMA copies, with
    a chunk, against its rounding emulation, blocks before each row's chunk NaN."""
    page, d, hkv, group, chunk = 32, 32, 2, 2, 32
    lens = [6, 33, 64, 97]
    meta, q, cache = make_batch(
        [1] * 4, lens, 4, hkv * group, hkv, d, page, F32, seed=13, cache_dtype=torch.float8_e4m3fn
    )
    cache = to_storage_layout(to_logical_layout(cache), head_major_k=True)
    kv_scale = torch.tensor([0.5, 0.25], device=DEVICE)
    q = q * 2
    poison_before_chunks(cache, meta, chunk, keep_block_0=True)
    layer = LayerAttention(attention_chunk=chunk)
    with exact_fp8_casts():
        out = paged_attention(
            q, cache, meta, 0.2, out=poisoned(q), layer=layer, kv_scale=kv_scale, num_splits=num_splits,
            decode_config=DecodeConfig(block_n=32, fp8_mma=True, tma=tma),
        )  # fmt: skip
    emulated = decode_fp8_mma_ref(
        q, cache, meta.block_tables, meta.seq_lens, 4, 0.2, kv_scale, 32, num_splits, chunk=chunk
    )
    torch.testing.assert_close(out, emulated, rtol=1e-5, atol=1e-5 if DEVICE == "cpu" else 5e-3)
    exact = paged_attention_ref(q, cache, meta, 0.2, kv_scale, layer=layer)
    assert ((out - exact).abs().max() / exact.abs().max()).item() < 0.1  # e4m3's roundings of q and P


def test_fp8_mma_prefill_chunk():
    """The e4m3-dot prefill (the e4m3 caches' default) with a chunk of 16 and query tiles of 16 rows
    starting mid-chunk after cached prefixes, against its rounding emulation."""
    query_lens, seq_lens, hkv, group, d, page, chunk = [40, 19, 9], [40, 45, 9], 2, 2, 32, 16, 16
    meta, q, cache = make_batch(
        query_lens, seq_lens, 0, hkv * group, hkv, d, page, F32, seed=15, cache_dtype=torch.float8_e4m3fn
    )
    cache = to_storage_layout(to_logical_layout(cache), head_major_k=True)
    kv_scale = torch.tensor([0.5, 0.25], device=DEVICE)
    q = q * 2
    poison_before_chunks(cache, meta, chunk, keep_block_0=True)
    layer = LayerAttention(attention_chunk=chunk)
    cfg = PrefillConfig(16, 16 if DEVICE == "cpu" else 32, 4, 1, fp8_mma=True)
    with exact_fp8_casts():
        out = paged_attention(
            q, cache, meta, 0.2, out=poisoned(q), layer=layer, kv_scale=kv_scale, prefill_config=cfg
        )
    emulated = prefill_fp8_mma_ref(
        q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0, 3, 0.2, kv_scale, cfg.block_n,
        chunk=chunk,
    )  # fmt: skip
    torch.testing.assert_close(out, emulated, rtol=1e-5, atol=1e-5 if DEVICE == "cpu" else 5e-3)
    exact = paged_attention_ref(q, cache, meta, 0.2, kv_scale, layer=layer)
    assert ((out - exact).abs().max() / exact.abs().max()).item() < 0.1
