"""Latent attention's Triton kernels (kernels/mla_decode.py) against the PyTorch reference (attention/mla.py),
through the Triton interpreter on the CPU in fp32 / fp16 (bf16 too on a GPU), at small widths: 20 heads
(two head blocks, the second partly masked), a 32-value latent and 16 rope values, pages of 4 and 16
tokens, contexts up to 45 tokens (several tiles), a padding row of length 0, and NaN in every cache slot
nothing wrote (the engine allocates the cache uninitialized). Then the whole GPU backend's forward_mla
on a batch of decodes and prefill chunks over cached latents, against the CPU backend's. Last, an FP8
cache (latent and rope parts each over its own scale, attention/mla.py): the write's bytes against the
reference's (saturation included), the decode over a dequantized cache against the reference's, and
the whole FP8 path against unquantized attention within e4m3's rounding.
"""

from __future__ import annotations

import pytest
import torch

from overnight.attention.kv_quant import new_kv_scales
from overnight.attention.mla import absorb_query, mla_decode_ref, write_latent_ref
from overnight.attention.torch_backend import TorchAttentionBackend, build_metadata
from overnight.attention.triton_backend import TritonAttentionBackend
from overnight.kernels.kv_layout import fp8_max
from overnight.kernels.mla_decode import latent_write, mla_decode
from tests.kernel_helpers import DEVICE, DTYPES, TOL, assert_close
from tests.triton_fp8 import exact_fp8_casts

RANK, ROPE, HEADS = 32, 16, 20


def _tables(seq_lens: list[int], page: int, gen: torch.Generator) -> tuple[list[list[int]], int]:
    """Scattered block tables over a pool with spare blocks."""
    need = [-(-n // page) for n in seq_lens]
    num_blocks = sum(need) + 5
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(ids[at : at + n])
        at += n
    return tables, num_blocks


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page", [4, 16])
def test_decode_matches_reference(dtype: torch.dtype, page: int) -> None:
    gen = torch.Generator().manual_seed(page)
    seq_lens = [1, 45, 17, 0, 32]  # 0: a CUDA graph's padding row
    tables, num_blocks = _tables(seq_lens, page, gen)
    tables[3] = [num_blocks - 1]  # the padding row's table points somewhere; it must read nothing
    meta = build_metadata(
        [1] * len(seq_lens), [max(n, 1) for n in seq_lens], tables, page, len(seq_lens), DEVICE
    )
    meta.seq_lens[3] = 0
    cache = torch.full((1, num_blocks, page, 1, RANK + ROPE), float("nan"))
    for table, n in zip(tables, seq_lens):
        for p in range(n):
            cache[0, table[p // page], p % page, 0] = torch.randn(RANK + ROPE, generator=gen)
    cache = cache.to(DEVICE, dtype)
    q_lat = torch.randn(len(seq_lens), HEADS, RANK + ROPE, generator=gen).to(DEVICE, dtype)
    n = len(seq_lens)
    out = mla_decode(q_lat, cache, meta.block_tables, meta.seq_lens, 0.15, RANK, n)
    ref = mla_decode_ref(q_lat, cache, meta.block_tables, meta.seq_lens, 0.15, RANK, n)
    assert out.shape == (n, HEADS, RANK)
    assert_close(out, ref, dtype)
    assert out[3].abs().max() == 0  # an empty context gives 0, not NaN
    assert ref[1].float().std() > 0.05  # varied values: a wrong gather would show


@pytest.mark.parametrize("dtype", DTYPES)
def test_latent_write_matches_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(9, RANK + ROPE, generator=gen).to(DEVICE, dtype)
    slots = torch.randperm(6 * 4, generator=gen)[:9]
    slots[[1, 5]] = -1  # padding rows
    cache = torch.randn(1, 6, 4, 1, RANK + ROPE, generator=gen).to(DEVICE, dtype)
    expected = cache.clone()
    write_latent_ref(rows, expected, slots.to(DEVICE))
    latent_write(rows, cache, slots.to(DEVICE))
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_backend_matches_cpu_backend_on_a_mixed_batch(dtype: torch.dtype) -> None:
    """Two decodes and two prefill chunks after cached context (the chunk's queries attend to cached
    latents and to each other causally): the Triton backend (kernel write, batched prefill and decode)
    against the PyTorch backend, the same cache afterwards."""
    gen = torch.Generator().manual_seed(7)
    nope, v_dim, page = 16, 24, 4
    query_lens, seq_lens = [1, 1, 6, 9], [13, 30, 11, 9]
    tables, num_blocks = _tables(seq_lens, page, gen)
    meta = build_metadata(query_lens, seq_lens, tables, page, num_decodes=2, device=DEVICE)
    t = sum(query_lens)
    cache = torch.randn(1, num_blocks, page, 1, RANK + ROPE, generator=gen).to(DEVICE, dtype)
    q_nope = torch.randn(t, HEADS, nope, generator=gen).to(DEVICE, dtype)
    q_pe = torch.randn(t, HEADS, ROPE, generator=gen).to(DEVICE, dtype)
    rows = torch.randn(t, RANK + ROPE, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(HEADS * (nope + v_dim), RANK, generator=gen) / RANK**0.5).to(DEVICE, dtype)
    w_uk, w_uv = w.view(HEADS, -1, RANK).split([nope, v_dim], dim=1)
    ref_cache = cache.clone()
    ref = TorchAttentionBackend().forward_mla(q_nope, q_pe, rows, ref_cache, meta, 0.2, w_uk, w_uv)
    backend = TritonAttentionBackend(HEADS, 1, ROPE, max_num_seqs=4, max_model_len=64, device=DEVICE)
    out = backend.forward_mla(q_nope, q_pe, rows, cache, meta, 0.2, w_uk, w_uv)
    assert torch.equal(cache, ref_cache)
    assert_close(out, ref, dtype)
    assert absorb_query(q_nope, q_pe, w_uk).shape == (t, HEADS, RANK + ROPE)


def test_widths_without_a_kernel_take_the_pytorch_path(caplog) -> None:
    """A rope width the kernel does not take (8: below a tensor-core dot's 16) runs the reference, with
    one warning; the runner then captures no decode graphs (model_runner.capture_graphs)."""
    gen = torch.Generator().manual_seed(9)
    heads, nope, rope, rank, page = 4, 16, 8, RANK, 4
    meta = build_metadata([1, 3], [5, 3], [[1, 0], [2]], page, num_decodes=1, device=DEVICE)
    cache = torch.randn(1, 3, page, 1, rank + rope, generator=gen).to(DEVICE)
    q_nope = torch.randn(4, heads, nope, generator=gen).to(DEVICE)
    q_pe = torch.randn(4, heads, rope, generator=gen).to(DEVICE)
    rows = torch.randn(4, rank + rope, generator=gen).to(DEVICE)
    w_uk, w_uv = (
        torch.randn(heads * 2 * nope, rank, generator=gen).to(DEVICE).view(heads, -1, rank).split(nope, 1)
    )
    ref_cache = cache.clone()
    ref = TorchAttentionBackend().forward_mla(q_nope, q_pe, rows, ref_cache, meta, 0.3, w_uk, w_uv)
    backend = TritonAttentionBackend(heads, 1, rope, max_num_seqs=2, max_model_len=16, device=DEVICE)
    with caplog.at_level("WARNING", logger="overnight"):
        for _ in range(2):
            out = backend.forward_mla(q_nope, q_pe, rows, cache.clone(), meta, 0.3, w_uk, w_uv)
    assert torch.equal(out, ref)
    assert sum("has no Triton kernel" in r.message for r in caplog.records) == 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_kernel_variant_matches_cpu_backend(dtype: torch.dtype) -> None:
    """The mla-prefill-kernel variant: prefill chunks after cached context attended row by row in the
    kernel (each row its causal share of its request's rows, absorbed), with the decodes in the same
    launch, and a padding row past the step's tokens left 0."""
    gen = torch.Generator().manual_seed(11)
    nope, v_dim, page = 16, 24, 4
    query_lens, seq_lens = [1, 5, 9], [14, 12, 9]
    tables, num_blocks = _tables(seq_lens, page, gen)
    meta = build_metadata(query_lens, seq_lens, tables, page, num_decodes=1, device=DEVICE)
    t = sum(query_lens)
    meta.slot_mapping = torch.cat([meta.slot_mapping, torch.tensor([-1], device=DEVICE)])  # a padding row
    meta.num_tokens = t + 1
    cache = torch.randn(1, num_blocks, page, 1, RANK + ROPE, generator=gen).to(DEVICE, dtype)
    q_nope = torch.randn(t + 1, HEADS, nope, generator=gen).to(DEVICE, dtype)
    q_pe = torch.randn(t + 1, HEADS, ROPE, generator=gen).to(DEVICE, dtype)
    rows = torch.randn(t + 1, RANK + ROPE, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(HEADS * (nope + v_dim), RANK, generator=gen) / RANK**0.5).to(DEVICE, dtype)
    w_uk, w_uv = w.view(HEADS, -1, RANK).split([nope, v_dim], dim=1)
    ref_cache = cache.clone()
    ref = TorchAttentionBackend().forward_mla(q_nope, q_pe, rows, ref_cache, meta, 0.2, w_uk, w_uv)
    backend = TritonAttentionBackend(
        HEADS, 1, ROPE, max_num_seqs=4, max_model_len=64, device=DEVICE, mla_prefill_kernel=True
    )
    out = backend.forward_mla(q_nope, q_pe, rows, cache, meta, 0.2, w_uk, w_uv)
    assert torch.equal(cache, ref_cache)
    assert_close(out[:t], ref[:t], dtype)
    assert out[t].abs().max() == 0


# ---------------------------------------------------------------- an FP8 cache

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _scales(latent: float, rope: float) -> torch.Tensor:
    scales = new_kv_scales(1, DEVICE)[0]
    scales.copy_(torch.tensor([latent, rope]))
    return scales


@pytest.mark.parametrize("fp8", FP8)
def test_fp8_latent_write_stores_the_references_bytes(fp8: torch.dtype) -> None:
    """Each part divided by its own scale and rounded as torch rounds (the interpreter's fp8 casts
    routed through torch, tests/triton_fp8.py), values past the format's range saturated, padding rows
    and other slots untouched."""
    gen = torch.Generator().manual_seed(5)
    rows = torch.randn(9, RANK + ROPE, generator=gen) * 3
    rows[0, 3], rows[2, RANK + 1] = 1e5, -1e6  # past the largest value x scale: saturate, never NaN
    kv_scale = _scales(0.37, 1.9)
    slots = torch.randperm(6 * 4, generator=gen)[:9]
    slots[[1, 5]] = -1
    cache = torch.zeros(1, 6, 4, 1, RANK + ROPE, dtype=fp8, device=DEVICE)
    expected = cache.clone()
    write_latent_ref(rows.to(DEVICE), expected, slots.to(DEVICE), kv_scale, RANK)
    with exact_fp8_casts():
        latent_write(rows.to(DEVICE), cache, slots.to(DEVICE), kv_scale, RANK)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    block, slot = divmod(int(slots[0]), 4)
    assert cache[0, block, slot, 0, 3].float() == fp8_max(fp8)
    block, slot = divmod(int(slots[2]), 4)
    assert cache[0, block, slot, 0, RANK + 1].float() == -fp8_max(fp8)
    assert (cache.float().abs() > 0).sum() > 6 * (RANK + ROPE)  # written rows hold varied values
    with pytest.raises(ValueError, match="takes its kv_scale"):
        latent_write(rows.to(DEVICE), cache, slots.to(DEVICE))
    with pytest.raises(ValueError, match="takes no kv_scale"):
        latent_write(rows.to(DEVICE), cache.float(), slots.to(DEVICE), kv_scale, RANK)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_decode_matches_reference(dtype: torch.dtype) -> None:
    """Over an e4m3 cache (contexts of several tiles, a padding row, scales of each part): the kernel's
    scaled fp32 dots against the reference's dequantized rows. Powers of two as scales and q exact in
    dtype, so both sides compute the same products: the comparison is tight."""
    gen = torch.Generator().manual_seed(13)
    page, seq_lens = 4, [1, 45, 17, 0, 32]
    tables, num_blocks = _tables(seq_lens, page, gen)
    tables[3] = [num_blocks - 1]
    n = len(seq_lens)
    meta = build_metadata([1] * n, [max(s, 1) for s in seq_lens], tables, page, n, DEVICE)
    meta.seq_lens[3] = 0
    cache = (torch.randn(1, num_blocks, page, 1, RANK + ROPE, generator=gen) * 4).to(torch.float8_e4m3fn)
    cache = cache.to(DEVICE)
    kv_scale = _scales(0.125, 4.0)
    q_lat = torch.randn(n, HEADS, RANK + ROPE, generator=gen).to(DEVICE, dtype)
    out = mla_decode(q_lat, cache, meta.block_tables, meta.seq_lens, 0.15, RANK, n, kv_scale)
    # The reference in float32 on every device: on a GPU it would compute in q's dtype, and this
    # cache's scores (values up to ~16 x 4) lose too much in fp16 / bf16 for a tight comparison.
    ref = mla_decode_ref(q_lat.float(), cache, meta.block_tables, meta.seq_lens, 0.15, RANK, n, kv_scale)
    assert_close(out, ref.to(dtype), dtype)
    assert out[3].abs().max() == 0
    # The rope scale counts: scaling only it changes the scores
    other = mla_decode(q_lat, cache, meta.block_tables, meta.seq_lens, 0.15, RANK, n, _scales(0.125, 1.0))
    assert (other - out).abs().max() > 10 * TOL[dtype]


@pytest.mark.parametrize("prefill_kernel", [False, True])
def test_fp8_backend_stays_within_e4m3_rounding_of_full_precision(prefill_kernel: bool) -> None:
    """Random rows (no value exact in e4m3) through the GPU backend into an FP8 cache with calibrated
    scales, then decodes and prefill chunks over it: the same cache bytes as the CPU backend writes,
    outputs equal to its FP8 path, and within e4m3's relative step (2**-4) of the attention over the
    unquantized rows."""
    gen = torch.Generator().manual_seed(17)
    nope, v_dim, page, scale = 16, 24, 4, 0.2
    query_lens, seq_lens = [1, 1, 6, 9], [13, 30, 11, 9]
    tables, num_blocks = _tables(seq_lens, page, gen)
    meta = build_metadata(query_lens, seq_lens, tables, page, num_decodes=2, device=DEVICE)
    t = sum(query_lens)
    context = torch.randn(1, num_blocks, page, 1, RANK + ROPE, generator=gen).to(DEVICE)
    context[..., RANK:] *= 20  # the rope part's range differs from the latent's
    rows = torch.randn(t, RANK + ROPE, generator=gen).to(DEVICE)
    rows[:, RANK:] *= 20
    kv_scale = _scales(
        float(context[..., :RANK].abs().amax()) / 448, float(context[..., RANK:].abs().amax()) / 448
    )
    q_nope = torch.randn(t, HEADS, nope, generator=gen).to(DEVICE)
    q_pe = torch.randn(t, HEADS, ROPE, generator=gen).to(DEVICE) / 20
    w = (torch.randn(HEADS * (nope + v_dim), RANK, generator=gen) / RANK**0.5).to(DEVICE)
    w_uk, w_uv = w.view(HEADS, -1, RANK).split([nope, v_dim], dim=1)
    full_cache = context.clone()
    full = TorchAttentionBackend().forward_mla(q_nope, q_pe, rows, full_cache, meta, scale, w_uk, w_uv)
    fp8_cache = torch.zeros(context.shape, dtype=torch.float8_e4m3fn, device=DEVICE)
    write_latent_ref(
        context.flatten(0, 3), fp8_cache, torch.arange(num_blocks * page, device=DEVICE), kv_scale, RANK
    )
    ref_cache = fp8_cache.clone()
    ref = TorchAttentionBackend().forward_mla(
        q_nope, q_pe, rows, ref_cache, meta, scale, w_uk, w_uv, kv_scale
    )
    backend = TritonAttentionBackend(
        HEADS, 1, ROPE, max_num_seqs=4, max_model_len=64, device=DEVICE, mla_prefill_kernel=prefill_kernel
    )
    with exact_fp8_casts():
        out = backend.forward_mla(q_nope, q_pe, rows, fp8_cache, meta, scale, w_uk, w_uv, kv_scale)
    assert torch.equal(fp8_cache.view(torch.uint8), ref_cache.view(torch.uint8))
    assert_close(out, ref, torch.float32)
    # e4m3 rounds each cached value by at most 2**-4 relative (root mean square about 2**-4 / sqrt(3)
    # over a binade), and the output carries an error of that order: measured 0.033 here. A scale
    # applied to the wrong part, or not at all, moves it by order 1.
    rel = float((out - full).norm() / full.norm())
    assert 2.0**-8 < rel <= 2.0**-4, rel
