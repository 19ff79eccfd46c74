"""Latent attention's batched prefill (kernels/latent_gather.py, kernels/mla_prefill.py,
attention/mla_prefill.py) against the PyTorch references, through the Triton interpreter on the CPU in
fp32 / fp16 (bf16 too on a GPU), at small widths: a 32-value latent and 16 rope values, 3 heads, key
widths that are no powers of two (24 nope values, 40 value values), tiles of 16 so that contexts up to
45 tokens span several query and key tiles. Batches are ragged: a decode first, a chunk starting mid-context (cached rows before it), a
whole prompt, a one-token chunk, and NaN in every cache slot nothing wrote (the engine allocates the
cache uninitialized). FP8 caches: the gather's dequantized rows bit for bit against load_rows's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from overnight.attention.kv_quant import new_kv_scales
from overnight.attention.metadata import AttentionMetadata
from overnight.attention.mla import latent_prefill_ref, load_rows, split_kv_b
from overnight.attention.mla_prefill import kv_b_weight, latent_prefill, prefill_groups
from overnight.attention.torch_backend import build_metadata
from overnight.kernels.latent_gather import latent_gather
from overnight.kernels.mla_prefill import MlaPrefillConfig, mla_prefill_attention
from tests.kernel_helpers import DEVICE, DTYPES, TOL, assert_close

RANK, ROPE, HEADS, NOPE, V_DIM, PAGE = 32, 16, 3, 24, 40, 4
TILES = MlaPrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
# (query lens, seq lens): a decode, a chunk after 20 cached rows, a whole prompt, one row after 29
QUERY_LENS, SEQ_LENS = [1, 25, 18, 1], [13, 45, 18, 30]


def _batch(dtype: torch.dtype, seed: int, cache_dtype: torch.dtype | None = None):
    """Metadata over scattered blocks (spare ones in the pool), and a cache whose unwritten slots are NaN
    (zero for an FP8 one: e4m3 has no NaN to poison with but its own)."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // PAGE) for n in SEQ_LENS]
    num_blocks = sum(need) + 3
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [ids[sum(need[:i]) : sum(need[: i + 1])] for i in range(len(need))]
    meta = build_metadata(QUERY_LENS, SEQ_LENS, tables, PAGE, num_decodes=1, device=DEVICE)
    cache = torch.full((1, num_blocks, PAGE, 1, RANK + ROPE), float("nan"))
    for table, n in zip(tables, SEQ_LENS):
        for p in range(n):
            cache[0, table[p // PAGE], p % PAGE, 0] = torch.randn(RANK + ROPE, generator=gen)
    if cache_dtype is not None and cache_dtype.itemsize == 1:
        cache = (cache.nan_to_num(0.0) * 4).to(cache_dtype)
    return meta, cache.to(DEVICE, cache_dtype or dtype), gen


def _scales(latent: float, rope: float) -> torch.Tensor:
    scales = new_kv_scales(1, DEVICE)[0]
    scales.copy_(torch.tensor([latent, rope]))
    return scales


def _kv_loc(meta: AttentionMetadata, first: int) -> torch.Tensor:
    lens = meta.seq_lens[first:].long()
    return F.pad(lens.cumsum(0), (1, 0)).to(torch.int32)


@pytest.mark.parametrize("fp8", [None, torch.float8_e4m3fn, torch.float8_e5m2])
def test_gather_matches_load_rows(fp8: torch.dtype | None) -> None:
    """Every prefill request's rows in order, contiguous, as load_rows reads them (dequantized: the same
    bytes); the decode's rows are not gathered."""
    dtype = torch.float16
    meta, cache, _ = _batch(dtype, 1, fp8)
    kv_scale = _scales(0.375, 3.0) if fp8 else None
    loc = _kv_loc(meta, 1)
    out = torch.full((int(loc[-1]), RANK + ROPE), float("nan"), dtype=dtype, device=DEVICE)
    latent_gather(cache, meta.block_tables, meta.seq_lens, loc, 1, 3, max(SEQ_LENS), RANK, out, kv_scale)
    for i, n in enumerate(SEQ_LENS[1:], start=1):
        blocks = meta.block_tables[i, : -(-n // PAGE)].long()
        ref = load_rows(cache[0, blocks].flatten(0, 1)[:n, 0], dtype, kv_scale, RANK)
        got = out[int(loc[i - 1]) : int(loc[i])]
        assert torch.equal(got.view(torch.int16), ref.view(torch.int16)), i
    assert out.float().std() > 0.5  # varied values: a wrong gather would show


def _sdpa_ref(q_nope, q_pe, k_nope, k_pe, v, qsl, loc, first, scale) -> torch.Tensor:
    """Per request: [q_nope | q_pe] against [k_nope | k_pe per head], causal from the chunk's offset."""
    out = torch.zeros(q_nope.shape[0], q_nope.shape[1], v.shape[-1])
    for i in range(len(loc) - 1):
        start, end = int(qsl[first + i]), int(qsl[first + i + 1])
        k0, k1 = int(loc[i]), int(loc[i + 1])
        q = torch.cat([q_nope[start:end], q_pe[start:end]], -1).float().transpose(0, 1)
        k_pe_h = k_pe[k0:k1, None].expand(-1, q_nope.shape[1], -1)
        k = torch.cat([k_nope[k0:k1], k_pe_h], -1).float().transpose(0, 1)
        pos = torch.arange(k1 - k0 - (end - start), k1 - k0)
        mask = torch.arange(k1 - k0)[None, :] <= pos[:, None]
        o = F.scaled_dot_product_attention(
            q, k, v[k0:k1].float().transpose(0, 1), attn_mask=mask, scale=scale
        )
        out[start:end] = o.transpose(0, 1)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_matches_sdpa(dtype: torch.dtype) -> None:
    """Contiguous keys of widths 24 + 16 and values of 40 (strided views, as the GEMM's halves are):
    ragged chunks, some after cached keys, several query and key tiles; the decode's row untouched."""
    gen = torch.Generator().manual_seed(2)
    meta, _, _ = _batch(dtype, 2)
    t, keys = sum(QUERY_LENS), sum(SEQ_LENS[1:])
    q = torch.randn(t, HEADS, NOPE + ROPE, generator=gen).to(DEVICE, dtype)
    q_nope, q_pe = q[..., :NOPE], q[..., NOPE:]
    kv = torch.randn(keys, HEADS, NOPE + V_DIM, generator=gen).to(DEVICE, dtype)
    k_pe = torch.randn(keys, 2 * ROPE, generator=gen).to(DEVICE, dtype)[:, ROPE:]
    loc = _kv_loc(meta, 1)
    out = torch.full((t, HEADS, V_DIM), float("nan"), dtype=dtype, device=DEVICE)
    args = (
        q_nope,
        q_pe,
        kv[..., :NOPE],
        k_pe,
        kv[..., NOPE:],
        meta.query_start_loc,
        loc,
        1,
        3,
        t - 1,
        0.2,
        out,
    )
    mla_prefill_attention(*args, TILES)
    ref = _sdpa_ref(q_nope.cpu(), q_pe.cpu(), kv[..., :NOPE].cpu(), k_pe.cpu(), kv[..., NOPE:].cpu(),
                    meta.query_start_loc.cpu(), loc.cpu(), 1, 0.2)  # fmt: skip
    assert out[0].isnan().all()  # the decode's row is not written
    assert_close(out[1:], ref[1:].to(DEVICE, dtype), dtype)
    with pytest.raises(ValueError, match="k_pe"):
        mla_prefill_attention(q_nope, q_pe, kv[..., :NOPE], k_pe[:, :8], *args[4:])


def _weights(gen: torch.Generator, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    w = (torch.randn(HEADS * (NOPE + V_DIM), RANK, generator=gen) / RANK**0.5).to(DEVICE, dtype)
    return split_kv_b(w, HEADS, NOPE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("max_bytes", [None, 1])  # 1: every request its own group
def test_latent_prefill_matches_reference(dtype: torch.dtype, max_bytes: int | None) -> None:
    """The whole batched path (gather, one GEMM, attention) against latent_prefill_ref, the decode and
    a padding row past the step's tokens left zero."""
    meta, cache, gen = _batch(dtype, 3)
    t = sum(QUERY_LENS)
    q_nope = torch.randn(t + 1, HEADS, NOPE, generator=gen).to(DEVICE, dtype)
    q_pe = torch.randn(t + 1, HEADS, ROPE, generator=gen).to(DEVICE, dtype)
    w_uk, w_uv = _weights(gen, dtype)
    extra = {} if max_bytes is None else {"max_bytes": max_bytes}
    out = latent_prefill(q_nope, q_pe, cache, meta, 0.2, w_uk, w_uv, config=TILES, **extra)
    ref = latent_prefill_ref(q_nope, q_pe, cache, meta, 0.2, w_uk, w_uv)
    assert out.shape == (t + 1, HEADS, V_DIM) and out.dtype == dtype
    assert_close(out, ref, dtype)
    assert out[0].abs().max() == 0 and out[t].abs().max() == 0
    assert ref[1:t].float().std() > 0.05  # varied values: a wrong key or mask would show


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_latent_prefill_over_an_fp8_cache_matches_reference(fp8: torch.dtype) -> None:
    """Rows dequantized with each part's own scale: the same output as the reference's, and the rope
    scale counts (scaling only it moves the result)."""
    dtype = torch.float32
    meta, cache, gen = _batch(dtype, 4, fp8)
    t = sum(QUERY_LENS)
    q_nope = torch.randn(t, HEADS, NOPE, generator=gen).to(DEVICE, dtype)
    q_pe = torch.randn(t, HEADS, ROPE, generator=gen).to(DEVICE, dtype)
    w_uk, w_uv = _weights(gen, dtype)
    kv_scale = _scales(0.125, 0.5)
    out = latent_prefill(q_nope, q_pe, cache, meta, 0.2, w_uk, w_uv, kv_scale, config=TILES)
    ref = latent_prefill_ref(q_nope, q_pe, cache, meta, 0.2, w_uk, w_uv, kv_scale)
    assert_close(out, ref, dtype)
    other = latent_prefill(q_nope, q_pe, cache, meta, 0.2, w_uk, w_uv, _scales(0.125, 1.0), config=TILES)
    assert (other - out).abs().max() > 100 * TOL[dtype]


def test_kv_b_weight_is_the_weight_itself_when_it_can_be() -> None:
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(HEADS * (NOPE + V_DIM), RANK, generator=gen)
    w_uk, w_uv = split_kv_b(w, HEADS, NOPE)
    same = kv_b_weight(w_uk, w_uv)
    assert same.data_ptr() == w.data_ptr() and torch.equal(same, w)
    copied = kv_b_weight(w_uk.clone(), w_uv.clone())  # separate tensors: interleaved per head again
    assert copied.data_ptr() != w.data_ptr() and torch.equal(copied, w)


def test_prefill_groups_bound_the_rows_of_each_group() -> None:
    lens = torch.tensor([1, 5, 3, 9, 2, 2, 20, 1], dtype=torch.int32)
    assert prefill_groups(lens, 1, 8, 10) == [(1, 3), (3, 4), (4, 6), (6, 7), (7, 8)]
    assert prefill_groups(lens, 1, 8, 1000) == [(1, 8)]
    assert prefill_groups(lens, 2, 2, 10) == []


def test_bad_input_is_refused() -> None:
    meta, cache, gen = _batch(torch.float32, 6)
    t = sum(QUERY_LENS)
    q_nope = torch.randn(t, HEADS, NOPE, generator=gen).to(DEVICE)
    q_pe = torch.randn(t, HEADS, ROPE, generator=gen).to(DEVICE)
    w_uk, w_uv = _weights(gen, torch.float32)
    with pytest.raises(ValueError, match="do not fit W_UK"):
        latent_prefill(q_nope[..., :8], q_pe, cache, meta, 0.2, w_uk, w_uv)
    with pytest.raises(ValueError, match="takes its kv_scale"):
        latent_prefill(q_nope, q_pe, cache.to(torch.float8_e4m3fn), meta, 0.2, w_uk, w_uv)
    loc = _kv_loc(meta, 1)
    rows = torch.empty(int(loc[-1]), RANK, device=DEVICE)
    with pytest.raises(ValueError, match="contiguous rows"):
        latent_gather(cache, meta.block_tables, meta.seq_lens, loc, 1, 3, 45, RANK, rows)
