"""The attention kernels' layer variants against the PyTorch reference: sliding windows, logit softcaps,
learned sinks, and wide heads (Gemma: 256, Gemma 4's global layers: 512).

Reference: paged_attention_ref (torch_backend.py), itself checked against a dense loop in
tests/test_attention_window_ref.py. A window's blocks that lie wholly before every query's window are
filled with NaN: the engine gives them back to the pool, so their contents are anyone's, and the kernels
must not read them. Shapes are tiny: the Triton interpreter is slow.
"""

from __future__ import annotations

import pytest
import torch

from overnight.attention.metadata import AttentionMetadata
from overnight.attention.spec import FULL_ATTENTION, LayerAttention
from overnight.attention.torch_backend import TorchAttentionBackend, paged_attention_ref
from overnight.attention.triton_backend import TritonAttentionBackend, paged_attention
from overnight.kernels.attention_fp8_ref import decode_fp8_mma_ref, prefill_fp8_mma_ref
from overnight.kernels.kv_layout import k_head_major, to_logical_layout, to_storage_layout
from overnight.kernels.paged_decode import DecodeConfig, default_decode_config
from overnight.kernels.paged_decode_fp8 import tma_supported
from overnight.kernels.paged_prefill import PrefillConfig, default_prefill_config
from overnight.kernels.score_mods import gpu_dot_refusal
from tests.kernel_helpers import DEVICE, TOL, assert_close, make_batch, poisoned
from tests.triton_fp8 import exact_fp8_casts

pytestmark = pytest.mark.slow  # long Triton-interpreter runs

DTYPES = [torch.float32, torch.float16]
TINY_DECODE = DecodeConfig(block_n=16)
TINY_PREFILL = PrefillConfig(16, 16, 4, 1)
# The least tile a compiled dot contracts (score_mods.gpu_dot_refusal): 16 tokens of 16/32-bit operands,
# 32 of e4m3. The interpreter takes smaller tiles, which keep its runs short and cover more tile edges.
SMALL_TILE = 8 if DEVICE == "cpu" else 16
SMALL_FP8_TILE = 16 if DEVICE == "cpu" else 32


def reference(q, cache, meta, scale, kv_scale=None, **kw):
    """paged_attention_ref in fp32. On a GPU it computes in q's dtype (fp16 scores and weights), which
    is less exact than the kernels (fp32 scores): on an H200 fp16 cases then differed by 4e-3."""
    return paged_attention_ref(q.float(), cache, meta, scale, kv_scale, **kw)


def assert_matches_emulation(out: torch.Tensor, emulated: torch.Tensor) -> None:
    """An e4m3-dot kernel against its rounding emulation (attention_fp8_ref.py, fp32 sums). The
    interpreter sums in fp32 too: within 1e-5. A GPU does not: Hopper's FP8 MMA adds products into an
    accumulator of about 14 significant bits across a dot's K (scores over D, values over the context's
    tiles); on an H200 the wide-head outputs moved by up to 3.3e-4 of the largest (2e-4 of 0.61). The
    bound there, 2^-9 of the largest output, stays far below what a wrong window, sink or scale does."""
    atol = 1e-5 if DEVICE == "cpu" else 2**-9 * float(emulated.abs().max())
    torch.testing.assert_close(out, emulated, rtol=1e-5, atol=atol)


def poison_outside_windows(
    cache: torch.Tensor, meta: AttentionMetadata, window: int | None, keep_block_0: bool = False
) -> int:
    """NaN in every block that no query of its request sees (what the engine may give back), and in
    every block no request uses. Returns how many blocks were poisoned among those a table names.

    keep_block_0: an FP8 cache's kernels read slots past a context's end unmasked, from block 0 past
    the last page (kv_layout.py: an FP8 cache never holds NaN, it is zeroed and written saturated);
    only the test's NaN could break that, so it spares block 0 there."""
    block_size = cache.shape[2]
    used = torch.zeros(cache.shape[1], dtype=torch.bool)
    qsl, sl = meta.query_start_loc_cpu.tolist(), meta.seq_lens_cpu.tolist()
    given_back = 0
    for i, seq_len in enumerate(sl):
        qlen = qsl[i + 1] - qsl[i]
        first = 0 if window is None else max(0, seq_len - qlen - window + 1)  # the first key any row sees
        table = meta.block_tables[i].cpu().tolist()
        num_blocks = (seq_len + block_size - 1) // block_size
        for b in range(num_blocks):
            if (b + 1) * block_size <= first:
                given_back += 1
            else:
                used[table[b]] = True
    if keep_block_0:
        used[0] = True
    logical = to_logical_layout(cache).float()  # exact for every cache dtype; fp8 has no masked_fill
    logical[:, ~used.to(cache.device)] = float("nan")
    cache.copy_(to_storage_layout(logical.to(cache.dtype), head_major_k=k_head_major(cache)))
    return given_back


def run(q, cache, meta, scale, layer, sinks=None, **kw):
    return paged_attention(q, cache, meta, scale, out=poisoned(q), layer=layer, sinks=sinks, **kw)


def sinks_for(num_heads: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(num_heads, generator=gen) * 2).to(DEVICE)


# Decodes: contexts shorter and longer than the window, on and off page edges.
DECODE_LENS = [3, 16, 17, 40, 61, 97]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize(
    "layer,with_sinks,group",
    [
        (LayerAttention(sliding_window=20), False, 4),
        (LayerAttention(sliding_window=7, logit_softcap=5.0), True, 1),
        (LayerAttention(logit_softcap=3.0), False, 4),
        (FULL_ATTENTION, True, 2),
    ],
    ids=["w20-g4", "w7-cap-sinks-g1", "cap-g4", "sinks-g2"],
)
def test_decode_layer_variants(dtype, num_splits, layer, with_sinks, group) -> None:
    hkv, d, bs = 2, 32, 8
    n = len(DECODE_LENS)
    meta, q, cache = make_batch([1] * n, DECODE_LENS, n, hkv * group, hkv, d, bs, dtype, seed=40 + group)
    q = q * 3  # sharper scores, so a softcap and a window's edge change the result
    clean = cache.clone()
    given_back = poison_outside_windows(cache, meta, layer.sliding_window)
    assert (given_back > 0) == (layer.sliding_window is not None)
    sinks = sinks_for(hkv * group, seed=group) if with_sinks else None
    ref = reference(q, cache, meta, d**-0.5, layer=layer, sinks=sinks)
    out = run(q, cache, meta, d**-0.5, layer, sinks, num_splits=num_splits, decode_config=TINY_DECODE)
    assert_close(out, ref, dtype)
    if layer != FULL_ATTENTION or with_sinks:  # the variant changes the answer
        assert not torch.allclose(ref, reference(q, clean, meta, d**-0.5), atol=1e-2)


def test_decode_window_reads_only_the_window() -> None:
    """With a window every block before the last page holding a visible token is poisoned, the
    block table of a long context included: the split ranges cover only the visible tokens."""
    hkv, group, d, bs, window = 1, 2, 16, 4, 6
    lens = [5, 30, 31, 64]
    meta, q, cache = make_batch([1] * 4, lens, 4, hkv * group, hkv, d, bs, torch.float32, seed=51)
    layer = LayerAttention(sliding_window=window)
    poison_outside_windows(cache, meta, window)
    ref = paged_attention_ref(q, cache, meta, 0.3, layer=layer)
    for num_splits, block_n in ((1, 16), (4, SMALL_TILE), (8, 16)):
        out = run(
            q, cache, meta, 0.3, layer, num_splits=num_splits, decode_config=DecodeConfig(block_n=block_n)
        )
        assert_close(out, ref, torch.float32)


# Prefill chunks: fresh prompts longer than the window, chunks after a cached prefix whose window starts
# mid-block, single-token chunks, a window longer than the context.
PREFILL_QUERY = [40, 1, 13, 9, 5]
PREFILL_SEQ = [40, 37, 50, 9, 29]


OTHER_PREFILL = PrefillConfig(16, 32, 4, 1, prefetch_pages=False)  # key tiles of four pages


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "layer,with_sinks,config",
    [
        (LayerAttention(sliding_window=11), False, TINY_PREFILL),
        (LayerAttention(sliding_window=5, logit_softcap=4.0), True, OTHER_PREFILL),
        (LayerAttention(sliding_window=100), False, OTHER_PREFILL),
        (LayerAttention(sliding_window=19), False, OTHER_PREFILL),
        (LayerAttention(logit_softcap=2.0), True, TINY_PREFILL),
    ],
    ids=["w11", "w5-cap-sinks-n32", "w100-n32", "w19-n32", "cap-sinks"],
)
def test_prefill_layer_variants(dtype, layer, with_sinks, config) -> None:
    hq, hkv, d, bs = 4, 2, 32, 8
    meta, q, cache = make_batch(PREFILL_QUERY, PREFILL_SEQ, 0, hq, hkv, d, bs, dtype, seed=60)
    q = q * 3
    poison_outside_windows(cache, meta, layer.sliding_window)
    sinks = sinks_for(hq, seed=61) if with_sinks else None
    ref = reference(q, cache, meta, d**-0.5, layer=layer, sinks=sinks)
    out = run(q, cache, meta, d**-0.5, layer, sinks, prefill_config=config)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_backend_mixed_batch_with_window_softcap_and_sinks(dtype) -> None:
    """Decodes and prefill chunks in one step through both backends (same cache writes), with the
    split count the backend picks for a windowed layer."""
    hq, hkv, d, bs = 4, 2, 32, 8
    query_lens = [1, 1, 12, 7]
    seq_lens = [45, 9, 30, 7]
    meta, q, cache = make_batch(query_lens, seq_lens, 2, hq, hkv, d, bs, dtype, seed=70)
    layer = LayerAttention(sliding_window=10, logit_softcap=6.0)
    poison_outside_windows(cache, meta, layer.sliding_window)
    gen = torch.Generator().manual_seed(71)
    k = torch.randn(meta.num_tokens, hkv, d, generator=gen).to(DEVICE, dtype)
    v = torch.randn(meta.num_tokens, hkv, d, generator=gen).to(DEVICE, dtype)
    sinks = sinks_for(hq, seed=72)
    cache_ref = cache.clone()
    ref = TorchAttentionBackend().forward(q, k, v, cache_ref, meta, 0.2, layer=layer, sinks=sinks)
    backend = TritonAttentionBackend(
        hq, hkv, d, max_num_seqs=4, max_model_len=4096, device=DEVICE,
        decode_config=TINY_DECODE, prefill_config=TINY_PREFILL,
    )  # fmt: skip
    # A window's decode splits are chosen for the window's length (at least 512 tokens a split).
    assert backend.num_splits(2, window=10) == 1 < backend.num_splits(2, window=1100) < backend.num_splits(2)
    out = backend.forward(q, k, v, cache, meta, 0.2, layer=layer, sinks=sinks)
    torch.testing.assert_close(cache, cache_ref, rtol=0, atol=0, equal_nan=True)
    assert_close(out, ref, dtype)
    # A KV-shared layer: nothing written, the cache read as it is; a long window: split decodes.
    long_window = LayerAttention(sliding_window=1100, logit_softcap=6.0)
    ref = paged_attention_ref(q, cache.nan_to_num(), meta, 0.2, layer=long_window, sinks=sinks)
    again = backend.forward(q, None, None, cache.nan_to_num(), meta, 0.2, layer=long_window, sinks=sinks)
    assert_close(again, ref, dtype)


@pytest.mark.parametrize("head_dim,group", [(256, 2), (512, 1)])
def test_wide_heads(head_dim: int, group: int) -> None:
    """Gemma's 256 and Gemma 4's 512-wide heads, with their default tiles, a window and a softcap."""
    hkv, bs = 1, 16
    query_lens, seq_lens = [1, 1, 20], [33, 8, 36]
    meta, q, cache = make_batch(
        query_lens, seq_lens, 2, hkv * group, hkv, head_dim, bs, torch.float32, seed=80
    )
    layer = LayerAttention(sliding_window=18, logit_softcap=30.0)
    clean = cache.clone()
    poison_outside_windows(cache, meta, layer.sliding_window)
    scale = head_dim**-0.5
    assert default_prefill_config(torch.bfloat16, head_dim).block_m <= 64
    assert default_decode_config(torch.bfloat16, 16, head_dim).block_n * head_dim <= 64 * 128
    for num_splits in (1, 2):
        out = run(q, cache, meta, scale, layer, num_splits=num_splits)  # the default configs
        assert_close(out, paged_attention_ref(q, cache, meta, scale, layer=layer), torch.float32)
    out = run(q, clean, meta, scale, FULL_ATTENTION, sinks=sinks_for(hkv * group, seed=81), num_splits=2)
    ref = paged_attention_ref(q, clean, meta, scale, sinks=sinks_for(hkv * group, seed=81))
    assert_close(out, ref, torch.float32)


def test_refuses_bad_inputs() -> None:
    meta, q, cache = make_batch([1], [5], 1, 2, 1, 16, 8, torch.float32, seed=90)
    with pytest.raises(ValueError, match="sinks must be float32"):
        run(q, cache, meta, 0.1, FULL_ATTENTION, sinks=torch.zeros(3, device=DEVICE))
    with pytest.raises(ValueError, match="sinks must be float32"):
        run(q, cache, meta, 0.1, FULL_ATTENTION, sinks=torch.zeros(2, dtype=torch.float16, device=DEVICE))
    big = torch.zeros(2, 2, 8, 1, 640, device=DEVICE)
    with pytest.raises(ValueError, match="head_dim 640"):
        run(torch.zeros(1, 2, 640, device=DEVICE), big, meta, 0.1, FULL_ATTENTION)


def test_gpu_dot_sizes() -> None:
    """What compiled dots contract at least (16 elements of 16/32-bit operands, 32 of e4m3), over the
    head and over the tile's tokens; on a GPU the launchers refuse smaller explicit configs and move a
    default FP8 config on narrow heads to the fp16-dot kernels."""
    assert gpu_dot_refusal(64, 64, True) is None and gpu_dot_refusal(16, 16, False) is None
    assert "head_dim 16 is below 32" in gpu_dot_refusal(16, 64, True)
    assert "tiles of 16 tokens are below 32" in gpu_dot_refusal(64, 16, True)
    assert "head_dim 5 is below 16" in gpu_dot_refusal(5, 64, False)
    assert "tiles of 8 tokens are below 16" in gpu_dot_refusal(32, 8, False)
    if DEVICE != "cuda":
        return
    meta, q, cache, kv_scale = fp8_window_case(torch.float8_e4m3fn, torch.float16, 64, 16, seed=95)
    out = run(q, cache, meta, 0.25, FULL_ATTENTION, kv_scale=kv_scale)  # default: fp16 dots
    ref = reference(q, cache, meta, 0.25, kv_scale)
    assert ((out.float() - ref).abs().max() / ref.abs().max()).item() < 2e-3
    with pytest.raises(ValueError, match="DecodeConfig: head_dim 16 is below 32"):
        run(
            q,
            cache,
            meta,
            0.25,
            FULL_ATTENTION,
            kv_scale=kv_scale,
            decode_config=DecodeConfig(64, fp8_mma=True),
        )


# -- FP8 caches -------------------------------------------------------------------------------------


def fp8_window_case(fp8, q_dtype, page, head_dim, seed, lens=None, query_lens=None, num_decodes=None):
    """A batch over an FP8 cache in its storage layout (head-major K, token-major V), scaled."""
    lens = lens or [6, 64, 97, 150]
    query_lens = query_lens or [1] * len(lens)
    num_decodes = len(lens) if num_decodes is None else num_decodes
    hkv, group = 2, 2
    meta, q, cache = make_batch(
        query_lens, lens, num_decodes, hkv * group, hkv, head_dim, page, q_dtype, seed=seed, cache_dtype=fp8
    )
    cache = to_storage_layout(to_logical_layout(cache), head_major_k=True)
    kv_scale = torch.tensor([0.5, 0.25], device=DEVICE)
    return meta, q * 2, cache, kv_scale


@pytest.mark.parametrize(
    "fp8,q_dtype",
    [
        (torch.float8_e4m3fn, torch.float32),
        (torch.float8_e5m2, torch.float32),
        (torch.float8_e4m3fn, torch.float16),
    ],
)
def test_fp8_cache_fp16_dots_with_layer_variants(fp8, q_dtype) -> None:
    """The fp16-dot kernels on an FP8 cache (exact arithmetic for fp32 q; fp16 q: the GPU's dots):
    decode with splits and the prefill, window and softcap and sinks, blocks outside the window NaN."""
    meta, q, cache, kv_scale = fp8_window_case(
        fp8, q_dtype, 16, 32, seed=100, lens=[70, 9, 40, 33], query_lens=[1, 1, 17, 33], num_decodes=2
    )
    layer = LayerAttention(sliding_window=21, logit_softcap=8.0)
    poison_outside_windows(cache, meta, layer.sliding_window, keep_block_0=True)
    sinks = sinks_for(4, seed=101)
    ref = paged_attention_ref(q.float(), cache, meta, 0.2, kv_scale, layer=layer, sinks=sinks)
    for num_splits in (1, 3):
        out = run(
            q, cache, meta, 0.2, layer, sinks, kv_scale=kv_scale, num_splits=num_splits,
            decode_config=DecodeConfig(block_n=32), prefill_config=TINY_PREFILL,
        )  # fmt: skip
        assert not out.isnan().any()
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        assert err < (1e-5 if q_dtype == torch.float32 else 2e-3), err


@pytest.mark.parametrize(
    "fp8,tma",
    [(torch.float8_e4m3fn, False), (torch.float8_e4m3fn, True), (torch.float8_e5m2, True)],
    ids=["e4m3-pointers", "e4m3-tma", "e5m2-tma"],
)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_fp8_mma_decode_with_layer_variants(fp8: torch.dtype, tma: bool, num_splits: int) -> None:
    """The e4m3-dot decode (paged_decode_fp8.py, the FP8 caches' default), by pointers and by TMA,
    against its rounding reference: windows shorter than the contexts, softcap and sinks, NaN before
    the window."""
    page = 32
    meta, q, clean, kv_scale = fp8_window_case(fp8, torch.float32, page, 32, seed=110)
    cfg = DecodeConfig(block_n=32, fp8_mma=True, tma=tma)
    assert tma_supported(clean, 32) is None
    sinks = sinks_for(4, seed=111)
    for layer in (LayerAttention(sliding_window=40, logit_softcap=10.0), LayerAttention(sliding_window=70)):
        cache = clean.clone()
        poison_outside_windows(cache, meta, layer.sliding_window, keep_block_0=True)
        with exact_fp8_casts():
            out = run(
                q, cache, meta, 0.2, layer, sinks, kv_scale=kv_scale, num_splits=num_splits, decode_config=cfg
            )
        emulated = decode_fp8_mma_ref(
            q, cache, meta.block_tables, meta.seq_lens, 4, 0.2, kv_scale, 32, num_splits,
            window=layer.sliding_window, softcap=layer.logit_softcap, sinks=sinks,
        )  # fmt: skip
        assert_matches_emulation(out, emulated)
        exact = paged_attention_ref(q, cache, meta, 0.2, kv_scale, layer=layer, sinks=sinks)
        assert ((out - exact).abs().max() / exact.abs().max()).item() < 0.1  # e4m3's roundings of q and P


def test_fp8_mma_prefill_with_layer_variants() -> None:
    """The e4m3-dot prefill against its rounding reference: a window whose edge falls mid-block in a
    chunk after a cached prefix, softcap, sinks."""
    meta, q, cache, kv_scale = fp8_window_case(
        torch.float8_e4m3fn,
        torch.float32,
        16,
        32,
        seed=120,
        lens=[40, 45, 9],
        query_lens=[40, 19, 9],
        num_decodes=0,
    )
    layer = LayerAttention(sliding_window=13, logit_softcap=7.0)
    poison_outside_windows(cache, meta, layer.sliding_window, keep_block_0=True)
    sinks = sinks_for(4, seed=121)
    cfg = PrefillConfig(16, SMALL_FP8_TILE, 4, 1, fp8_mma=True)
    with exact_fp8_casts():
        out = run(q, cache, meta, 0.2, layer, sinks, kv_scale=kv_scale, prefill_config=cfg)
    emulated = prefill_fp8_mma_ref(
        q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0, 3, 0.2, kv_scale, cfg.block_n,
        window=layer.sliding_window, softcap=layer.logit_softcap, sinks=sinks,
    )  # fmt: skip
    assert_matches_emulation(out, emulated)
    exact = paged_attention_ref(q, cache, meta, 0.2, kv_scale, layer=layer, sinks=sinks)
    assert ((out - exact).abs().max() / exact.abs().max()).item() < 0.1


def test_tolerances_cover_dtypes() -> None:
    assert set(DTYPES) <= set(TOL)


@pytest.mark.parametrize("head_dim", [256, 512])
def test_wide_heads_on_fp8_cache(head_dim: int) -> None:
    """The FP8 defaults for wide heads on 64-token pages: e4m3-dot decode (TMA at 256, pointer gathers
    at 512, where a TMA box would pass 256) and prefill (e4m3 dots at 256, fp16 dots at 512)."""
    meta, q, cache, kv_scale = fp8_window_case(
        torch.float8_e4m3fn, torch.float32, 64, head_dim, seed=130, lens=[70, 5, 20], query_lens=[1, 1, 20],
        num_decodes=2,
    )  # fmt: skip
    decode_cfg = default_decode_config(torch.float8_e4m3fn, 64, head_dim)
    assert decode_cfg.fp8_mma and (tma_supported(cache, decode_cfg.block_n) is None) == (head_dim == 256)
    assert default_prefill_config(torch.float8_e4m3fn, head_dim).fp8_mma == (head_dim == 256)
    layer = LayerAttention(sliding_window=9, logit_softcap=20.0)
    sinks = sinks_for(4, seed=131)
    with exact_fp8_casts():
        out = run(q, cache, meta, head_dim**-0.5, layer, sinks, kv_scale=kv_scale, num_splits=1)
    emulated = decode_fp8_mma_ref(
        q, cache, meta.block_tables, meta.seq_lens, 2, head_dim**-0.5, kv_scale, decode_cfg.block_n,
        window=9, softcap=20.0, sinks=sinks,
    )  # fmt: skip
    assert_matches_emulation(out[:2], emulated)
    exact = paged_attention_ref(q, cache, meta, head_dim**-0.5, kv_scale, layer=layer, sinks=sinks)
    assert ((out - exact).abs().max() / exact.abs().max()).item() < 0.1


@pytest.mark.parametrize("fp8_mma", [False, True])
def test_empty_context_with_sinks_gives_zeros(fp8_mma: bool) -> None:
    """A padded decode request (seq_len 0) under a window with sinks: zeros, split or not (the sink
    alone in the denominator, no value)."""
    cache_dtype = torch.float8_e4m3fn if fp8_mma else None
    meta, q, cache = make_batch(
        [1, 1], [20, 1], 2, 4, 2, 32, 16, torch.float32, seed=140, cache_dtype=cache_dtype
    )
    layer, sinks = LayerAttention(sliding_window=8), sinks_for(4, seed=141)
    ref = paged_attention_ref(q, cache, meta, 0.2, layer=layer, sinks=sinks)
    meta.seq_lens[1] = 0
    cfg = DecodeConfig(block_n=SMALL_FP8_TILE if fp8_mma else 16, fp8_mma=fp8_mma)
    for num_splits in (1, 4):
        with exact_fp8_casts():
            out = run(q, cache, meta, 0.2, layer, sinks, num_splits=num_splits, decode_config=cfg)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        if not fp8_mma:
            torch.testing.assert_close(out[0], ref[0], rtol=1e-4, atol=1e-4)
        else:
            assert ((out[0] - ref[0]).abs().max() / ref[0].abs().max()).item() < 0.1


def test_backend_gives_wider_layers_their_own_workspace() -> None:
    """Gemma 4's global layers have wider heads than the model's head_dim: their split decodes get a
    workspace of their own, made once and reused (a captured graph keeps its pointer)."""
    backend = TritonAttentionBackend(4, 1, 16, max_num_seqs=2, max_model_len=2048, device=DEVICE)
    meta, q, cache = make_batch([1, 1], [40, 7], 2, 4, 1, 32, 8, torch.float32, seed=150)
    assert backend.num_splits(2) > 1
    out = backend.forward(q, None, None, cache, meta, 0.2)
    assert_close(out, paged_attention_ref(q, cache, meta, 0.2), torch.float32)
    wide = backend.workspace_for(4, 32)
    assert wide is not backend.workspace and backend.workspace_for(4, 32) is wide
    assert wide.part_out.numel() == backend.max_split_rows * 4 * 32
