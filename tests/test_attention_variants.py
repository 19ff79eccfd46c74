"""The attention kernels' variants selected by config, against the PyTorch references.

- prefetch_pages (DecodeConfig, PrefillConfig): page ids loaded one tile ahead (kernels/kv_tiles.py);
  the same arithmetic as without, so the same tolerances as tests/test_kernels_attention.py.
- fp8_mma (DecodeConfig, FP8 caches): tokens as the MMA's M, q and P rounded to e4m3
  (kernels/paged_decode_fp8.py). Checked twice: against decode_fp8_mma_ref, which makes the same
  roundings, to float32 rounding; and against the exact paged_attention_ref within what those
  roundings cost (a few percent of the largest output on random data).
- heads_first (DecodeConfig): the grid in another order; each program does the same arithmetic, so
  outputs equal the default order's bit for bit (with splits, where the workspace index must follow).

Through the interpreter on CPU (fp32 / fp16), so shapes are small.
"""

from __future__ import annotations

import pytest
import torch

from overnight.attention.torch_backend import TorchAttentionBackend, paged_attention_ref
from overnight.attention.triton_backend import TritonAttentionBackend, paged_attention
from overnight.attention.variants import variant_configs
from overnight.errors import ConfigError
from overnight.kernels.attention_fp8_ref import decode_fp8_mma_ref, prefill_fp8_mma_ref
from overnight.kernels.kv_layout import to_storage_layout
from overnight.kernels.paged_decode import DecodeConfig
from overnight.kernels.paged_prefill import PrefillConfig
from tests.kernel_helpers import DEVICE, DTYPES, assert_close, exact_in_fp8, make_batch, poisoned

pytestmark = pytest.mark.slow  # long Triton-interpreter runs

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
SEQ_LENS = [1, 15, 16, 17, 40, 97]  # on, just before and just after page boundaries
# The e4m3-dot kernels' least tile: a compiled 8-bit dot contracts at least 32 tokens (the GPU launchers
# refuse fewer, score_mods.gpu_dot_refusal); the interpreter also runs 16, which covers more tile edges.
SMALL_FP8_TILE = 16 if DEVICE == "cpu" else 32
# How far an e4m3-dot kernel may sit from its rounding emulation (fp32 sums), relative to the largest
# output, beyond the interpreter's fp32 rounding: on a GPU, Hopper's FP8 MMA adds products into an
# accumulator of about 14 significant bits across a dot's K (scores over D, values over the context's
# tiles); on an H200 the wide-head window tests' outputs moved by up to 3.3e-4 of the largest. A wrong
# tile, page, mask or head is off by the size of the output.
FP8_MMA_ACCUMULATION = 0.0 if DEVICE == "cpu" else 2**-9


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "kernel left NaN (unwritten rows?)"
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def fp8_decode_batch(
    fp8: torch.dtype, q_dtype: torch.dtype, group: int, head_dim: int, seq_lens: list[int], seed: int
):
    """Decode rows over an fp8 cache holding random values (scaled as a calibrated cache would be)."""
    hkv, bs = 2, 16
    n = len(seq_lens)
    meta, q, cache = make_batch([1] * n, seq_lens, n, hkv * group, hkv, head_dim, bs, q_dtype, seed)
    cache = (cache.float() * 40).to(fp8)  # storage layout is irrelevant for random bytes
    kv_scale = torch.tensor([0.03, 0.02], device=DEVICE)
    return meta, q, cache, kv_scale


# ---------------------------------------------------------------- page prefetch (same arithmetic)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("group", "num_splits"), [(1, 1), (4, 3), (8, 1)])
def test_decode_prefetch_pages_matches_reference(dtype: torch.dtype, group: int, num_splits: int) -> None:
    hkv, d, bs = 2, 64, 16
    meta, q, cache = make_batch([1] * 6, SEQ_LENS, 6, hkv * group, hkv, d, bs, dtype, seed=30 + group)
    cfg = DecodeConfig(block_n=32, prefetch_pages=True)
    out = paged_attention(q, cache, meta, d**-0.5, out=poisoned(q), num_splits=num_splits, decode_config=cfg)
    assert_close(out, paged_attention_ref(q, cache, meta, d**-0.5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("block_size", "head_dim", "config"),
    [
        (16, 64, PrefillConfig(16, 16, 4, 1, prefetch_pages=True)),
        (16, 128, PrefillConfig(16, 32, 4, 2, prefetch_pages=True)),
    ],
)
def test_prefill_prefetch_pages_matches_reference(
    dtype: torch.dtype, block_size: int, head_dim: int, config: PrefillConfig
) -> None:
    query_lens = [33, 1, 20, 7, 1, 40]  # fresh prompts, chunks after cached prefixes, single tokens
    seq_lens = [33, 18, 84, 7, 1, 71]
    meta, q, cache = make_batch(query_lens, seq_lens, 0, 8, 2, head_dim, block_size, dtype, seed=40)
    out = paged_attention(q, cache, meta, head_dim**-0.5, out=poisoned(q), prefill_config=config)
    assert_close(out, paged_attention_ref(q, cache, meta, head_dim**-0.5), dtype)


@pytest.mark.parametrize("fp8", FP8)
def test_prefetch_pages_on_fp8_cache(fp8: torch.dtype) -> None:
    """Mixed batch (decodes, then prefill chunks after cached prefixes) over an fp8 cache: token-major
    V read through the prefetched page ids, with and without splits."""
    hq, hkv, d, bs = 8, 2, 64, 16
    meta, q, cache = make_batch(
        [1, 1, 1, 9, 20, 1], [30, 7, 77, 9, 50, 16], 3, hq, hkv, d, bs, torch.float32, 50
    )
    cache = (cache * 40).to(fp8)
    kv_scale = torch.tensor([0.03, 0.02], device=DEVICE)
    ref = paged_attention_ref(q, cache, meta, 0.125, kv_scale)
    for num_splits in (1, 3):
        out = paged_attention(
            q,
            cache,
            meta,
            0.125,
            out=poisoned(q),
            kv_scale=kv_scale,
            num_splits=num_splits,
            decode_config=DecodeConfig(block_n=32, prefetch_pages=True),
            prefill_config=PrefillConfig(16, 16, 4, 2, prefetch_pages=True),
        )
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- fp8 MMA decode (q and P in e4m3)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize(
    ("q_dtype", "group", "head_dim", "block_n", "num_splits", "precise_acc"),
    [
        (torch.float32, 4, 64, 32, 1, False),
        (torch.float32, 1, 64, SMALL_FP8_TILE, 3, True),
        (torch.float32, 8, 128, 64, 2, False),  # a 64-row warpgroup MMA on sm_90
        (torch.float32, 8, 128, 64, 2, True),
        (torch.float16, 4, 128, 32, 3, False),
        (torch.float32, 4, 48, 32, 2, False),  # head_dim padded to BLOCK_D 64 (masked along D)
    ],
)
def test_fp8_mma_decode_matches_its_rounding_reference(
    fp8: torch.dtype,
    q_dtype: torch.dtype,
    group: int,
    head_dim: int,
    block_n: int,
    num_splits: int,
    precise_acc: bool,
) -> None:
    meta, q, cache, kv_scale = fp8_decode_batch(fp8, q_dtype, group, head_dim, SEQ_LENS, seed=60 + group)
    cfg = DecodeConfig(block_n=block_n, fp8_mma=True, precise_acc=precise_acc)
    out = paged_attention(
        q, cache, meta, 0.1, out=poisoned(q), kv_scale=kv_scale, num_splits=num_splits, decode_config=cfg
    )
    emulated = decode_fp8_mma_ref(
        q, cache, meta.block_tables, meta.seq_lens, 6, 0.1, kv_scale, block_n, num_splits
    )
    exact = paged_attention_ref(q.float(), cache, meta, 0.1, kv_scale)
    if DEVICE == "cpu":
        # fp16 outputs round to 2**-11 of the largest; fp32 ones agree to accumulation order.
        assert rel_err(out, emulated) < (1e-3 if q_dtype == torch.float16 else 1e-5)
    else:
        # On a GPU exp2 is approximate, so a weight lying near an e4m3 rounding midpoint can round the
        # other way than in the emulation: one large weight one step (2**-3) off moved a 16-token
        # context's output by 1.6e-2 of the largest on the H100, with or without precise_acc, while
        # the kernel stayed as close to the exact answer as the emulation (2.88e-2 both). So on a GPU
        # the kernel must be no farther from the exact answer than its emulation is, give or take the
        # accumulation's share.
        assert rel_err(out, exact) < rel_err(emulated, exact) + FP8_MMA_ACCUMULATION
    # What rounding q and P to 3 mantissa bits costs here (1.4-2.1% measured); a wrong tile, page or
    # head would be off by the size of the output itself.
    assert rel_err(out, exact) < 5e-2


def test_fp8_mma_decode_rounding_is_what_separates_it_from_the_exact_answer() -> None:
    """With q already on the e4m3 grid (after its per-head scale) and a context of one position per
    head, neither rounding changes anything: the kernel must then equal the exact reference."""
    fp8, hkv, group, d = torch.float8_e4m3fn, 2, 4, 64
    meta, q, cache = make_batch([1, 1], [1, 1], 2, hkv * group, hkv, d, 16, torch.float32, seed=70)
    # Each row's largest |q| is 448 * 2**-5, so its scale is 2**-5 and q / scale stays on the grid.
    q = exact_in_fp8(tuple(q.shape), fp8, 1.0, seed=71) * 2.0**-5
    q[..., 0] = 448.0 * 2.0**-5
    q = q.to(DEVICE)
    cache = (cache * 40).to(fp8)
    # One key per context: p = 1 exactly, 256 after the shift, which e4m3 holds.
    out = paged_attention(q, cache, meta, 0.1, out=poisoned(q), decode_config=DecodeConfig(32, fp8_mma=True))
    # float32 rounding only (m - 8 is inexact when the scores are in the thousands, as here)
    assert rel_err(out, paged_attention_ref(q, cache, meta, 0.1)) < 1e-5


def test_fp8_mma_decode_empty_context_and_many_splits() -> None:
    """A padded request (seq_len 0) yields zeros; more splits than a short context has tiles."""
    meta, q, cache, kv_scale = fp8_decode_batch(
        torch.float8_e4m3fn, torch.float32, 4, 64, [20, 1, 3], seed=80
    )
    meta.seq_lens[1] = 0
    for num_splits in (1, 8):
        out = paged_attention(
            q,
            cache,
            meta,
            0.2,
            out=poisoned(q),
            kv_scale=kv_scale,
            num_splits=num_splits,
            decode_config=DecodeConfig(block_n=SMALL_FP8_TILE, fp8_mma=True),
        )
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        emulated = decode_fp8_mma_ref(
            q, cache, meta.block_tables, meta.seq_lens, 3, 0.2, kv_scale, SMALL_FP8_TILE, num_splits
        )
        assert rel_err(out, emulated) < 1e-5 + FP8_MMA_ACCUMULATION


def test_fp8_mma_backend_mixed_batch() -> None:
    """Through the backend: kv_write into the fp8 cache, fp8-MMA decodes, fp16-path prefill chunks."""
    fp8, hq, hkv, d = torch.float8_e4m3fn, 8, 2, 64
    meta, q, cache = make_batch([1, 1, 1, 12, 30], [17, 64, 5, 12, 45], 3, hq, hkv, d, 16, torch.float32, 90)
    cache = torch.zeros(cache.shape, dtype=fp8, device=DEVICE)
    kv_scale = torch.tensor([0.25, 0.5], device=DEVICE)
    k = exact_in_fp8((meta.num_tokens, hkv, d), fp8, 0.25, seed=91).to(DEVICE)
    v = exact_in_fp8((meta.num_tokens, hkv, d), fp8, 0.5, seed=92).to(DEVICE)
    cache_ref = cache.clone()
    ref = TorchAttentionBackend().forward(q, k, v, cache_ref, meta, 0.125, kv_scale)
    backend = TritonAttentionBackend(
        hq,
        hkv,
        d,
        max_num_seqs=8,
        max_model_len=4096,
        device=DEVICE,
        decode_config=DecodeConfig(block_n=SMALL_FP8_TILE, fp8_mma=True),
        prefill_config=PrefillConfig(32, 32, 4, 1, prefetch_pages=True),
    )
    out = backend.forward(q, k, v, cache, meta, 0.125, kv_scale)
    assert torch.equal(cache.view(torch.uint8), cache_ref.view(torch.uint8))
    nd = meta.num_decodes
    torch.testing.assert_close(out[nd:], ref[nd:], rtol=1e-4, atol=1e-4)  # prefill: exact arithmetic
    assert rel_err(out[:nd], ref[:nd]) < 5e-2  # decode: q and P rounded

    # the e4m3-dot prefill too (an FP8 cache's default): q and P rounded there as well
    backend.prefill_config = PrefillConfig(32, 32, 4, 1, fp8_mma=True)
    out8 = backend.forward(q, k, v, torch.zeros_like(cache), meta, 0.125, kv_scale)
    assert torch.equal(out8[:nd], out[:nd])
    assert 0 < rel_err(out8[nd:], ref[nd:]) < 5e-2


# ---------------------------------------------------------------- TMA decode (tiles by one copy each)


def tma_decode_batch(fp8: torch.dtype, group: int, head_dim: int, page: int, seq_lens: list[int], seed: int):
    """fp8_decode_batch's values in the stored layout the TMA kernel needs (head-major K, token-major V,
    new_kv_cache's), on pages of `page` tokens."""
    hkv, n = 2, len(seq_lens)
    meta, q, cache = make_batch([1] * n, seq_lens, n, hkv * group, hkv, head_dim, page, torch.float32, seed)
    cache = to_storage_layout((cache.float() * 40).to(fp8))
    return meta, q, cache, torch.tensor([0.03, 0.02], device=DEVICE)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize(
    ("group", "head_dim", "page", "block_n", "num_splits"),
    [
        (4, 64, 32, SMALL_FP8_TILE, 1),
        (4, 64, 32, 32, 3),
        (1, 32, 64, SMALL_FP8_TILE, 2),
        (8, 64, SMALL_FP8_TILE, SMALL_FP8_TILE, 1),  # tiles of a whole page
    ],
)
def test_tma_decode_equals_the_pointer_kernel(
    fp8: torch.dtype, group: int, head_dim: int, page: int, block_n: int, num_splits: int
) -> None:
    """The same arithmetic as the fp8-MMA kernel at the same tiles, only the copies differ: equal bit for
    bit, and within float32 rounding of the emulation (contexts on, before and after tile and page
    boundaries; more splits than a short context has tiles)."""
    seq_lens = [1, 15, 16, 17, 31, 32, 33, 97, 130]
    meta, q, cache, kv_scale = tma_decode_batch(fp8, group, head_dim, page, seq_lens, seed=100 + page)
    n = len(seq_lens)
    outs = []
    for tma in (False, True):
        cfg = DecodeConfig(block_n=block_n, fp8_mma=True, tma=tma)
        outs.append(
            paged_attention(
                q,
                cache,
                meta,
                0.1,
                out=poisoned(q),
                kv_scale=kv_scale,
                num_splits=num_splits,
                decode_config=cfg,
            )
        )
    assert torch.equal(outs[1], outs[0])
    emulated = decode_fp8_mma_ref(
        q, cache, meta.block_tables, meta.seq_lens, n, 0.1, kv_scale, block_n, num_splits
    )
    assert rel_err(outs[1], emulated) < 1e-5 + FP8_MMA_ACCUMULATION
    assert rel_err(outs[1], paged_attention_ref(q.float(), cache, meta, 0.1, kv_scale)) < 5e-2


def test_tma_decode_empty_context() -> None:
    meta, q, cache, kv_scale = tma_decode_batch(torch.float8_e4m3fn, 4, 64, 32, [20, 1, 40], seed=110)
    meta.seq_lens[1] = 0
    for num_splits in (1, 4):
        cfg = DecodeConfig(block_n=32, fp8_mma=True, tma=True)
        out = paged_attention(
            q, cache, meta, 0.2, out=poisoned(q), kv_scale=kv_scale, num_splits=num_splits, decode_config=cfg
        )
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        assert not out.isnan().any()


def test_default_decode_falls_back_to_pointer_gathers() -> None:
    """With no config, a cache the TMA copies cannot read (here K not head-major) gets the same tiles by
    pointers: the same numbers, no error."""
    from overnight.kernels.kv_layout import to_logical_layout

    meta, q, cache, kv_scale = tma_decode_batch(torch.float8_e4m3fn, 4, 64, 64, [20, 70, 130], seed=112)
    plain_k = to_storage_layout(to_logical_layout(cache), head_major_k=False)
    out = paged_attention(q, cache, meta, 0.2, out=poisoned(q), kv_scale=kv_scale)
    out_plain = paged_attention(q, plain_k, meta, 0.2, out=poisoned(q), kv_scale=kv_scale)
    assert torch.equal(out, out_plain)


def test_tma_decode_refuses_what_it_cannot_read() -> None:
    from overnight.kernels.kv_layout import new_kv_cache
    from overnight.kernels.paged_decode_fp8 import tma_supported

    e4m3 = torch.float8_e4m3fn
    assert tma_supported(new_kv_cache((2, 4, 64, 2, 64), e4m3, DEVICE), 64) is None
    assert "multiple" in tma_supported(new_kv_cache((2, 4, 16, 2, 64), e4m3, DEVICE), 64)
    assert "power of two" in tma_supported(new_kv_cache((2, 4, 64, 2, 48), e4m3, DEVICE), 64)
    assert "head-major" in tma_supported(
        new_kv_cache((2, 4, 64, 2, 64), e4m3, DEVICE, head_major_k=False), 64
    )
    assert "FP8" in tma_supported(new_kv_cache((2, 4, 64, 2, 64), torch.float16, DEVICE), 64)
    # Through paged_decode: a clear error, not a wrong answer
    meta, q, cache, kv_scale = tma_decode_batch(e4m3, 4, 64, 16, [20], seed=111)
    with pytest.raises(ValueError, match="DecodeConfig.tma: block_size 16"):
        paged_attention(q, cache, meta, 0.2, out=poisoned(q), kv_scale=kv_scale,
                        decode_config=DecodeConfig(block_n=32, fp8_mma=True, tma=True))  # fmt: skip


# ---------------------------------------------------------------- grid order (heads first)


@pytest.mark.parametrize(
    ("cache_dtype", "fp8_mma", "num_splits"),
    [
        (torch.float32, False, 1),
        (torch.float32, False, 3),
        (torch.float8_e4m3fn, False, 3),
        (torch.float8_e5m2, False, 1),
        (torch.float8_e4m3fn, True, 1),
        (torch.float8_e4m3fn, True, 3),
    ],
)
def test_heads_first_grid_equals_the_default_order(
    cache_dtype: torch.dtype, fp8_mma: bool, num_splits: int
) -> None:
    from dataclasses import replace

    hkv, group, d = 3, 2, 64  # 3 KV heads: a wrong head count in the split index shows
    meta, q, cache = make_batch([1] * 6, SEQ_LENS, 6, hkv * group, hkv, d, 16, torch.float32, seed=95)
    kv_scale = None
    if cache_dtype != torch.float32:
        cache = (cache * 40).to(cache_dtype)
        kv_scale = torch.tensor([0.03, 0.02], device=DEVICE)
    cfg = DecodeConfig(block_n=32, fp8_mma=fp8_mma)
    outs = [
        paged_attention(
            q, cache, meta, 0.1, out=poisoned(q), kv_scale=kv_scale, num_splits=num_splits, decode_config=c
        )
        for c in (cfg, replace(cfg, heads_first=True))
    ]
    assert torch.equal(outs[0], outs[1])
    exact = paged_attention_ref(q, cache, meta, 0.1, kv_scale)
    assert rel_err(outs[1], exact) < (5e-2 if fp8_mma else 1e-5)


# ---------------------------------------------------------------- the named variants (--attention-variant)


def test_attention_variants_by_name() -> None:
    assert variant_configs("default", fp8_cache=True) == (None, None)
    decode, prefill = variant_configs("fp16-dots", fp8_cache=True)
    assert not decode.fp8_mma and decode.block_n == 128 and not prefill.fp8_mma
    assert variant_configs("fp16-dots", fp8_cache=False) == (None, None)  # a bf16 cache has no fp8 dots
    decode, _ = variant_configs("prefetch", fp8_cache=True)
    assert decode.prefetch_pages and not decode.fp8_mma
    decode, prefill = variant_configs("heads-first", fp8_cache=True)
    assert decode is not None and decode.heads_first and decode.block_n == 128 and prefill is None
    decode, _ = variant_configs("heads-first", fp8_cache=False)
    assert decode is not None and decode.heads_first and decode.block_n == 64
    for name, block_n in (("tma", 64), ("tma-n128", 128)):
        decode, prefill = variant_configs(name, fp8_cache=True)
        assert decode.tma and decode.fp8_mma and decode.block_n == block_n and prefill is None
        assert variant_configs(name, fp8_cache=False) == (None, None)
    with pytest.raises(ValueError, match="unknown attention variant 'fast'"):
        variant_configs("fast", fp8_cache=False)


def test_fp8_caches_default_to_e4m3_dots() -> None:
    """Both kernels' defaults for an FP8 cache run the dots on e4m3 (faster on the H200, bench/attention_gpu.py); 16-bit caches
    keep theirs."""
    from overnight.kernels.paged_decode import default_decode_config
    from overnight.kernels.paged_prefill import default_prefill_config

    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        assert default_decode_config(fp8, 16).fp8_mma
        # Pages of 64 (an FP8 cache's default block size): TMA tiles of 64; pages of 16: the pointer
        # gathers of 128-token tiles (bench/decode_pages_gpu.py on the H200)
        assert default_decode_config(fp8, 64).tma and default_decode_config(fp8, 64).block_n == 64
        assert not default_decode_config(fp8, 16).tma and default_decode_config(fp8, 16).block_n == 128
    assert default_prefill_config(torch.float8_e4m3fn).fp8_mma
    assert not default_prefill_config(torch.float8_e5m2).fp8_mma  # not yet checked on the GPU
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert not default_decode_config(dtype, 16).fp8_mma and not default_prefill_config(dtype).fp8_mma


def test_engine_args_accept_the_variants() -> None:
    import argparse

    from overnight.options import add_engine_args, options_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--model", "m", "--attention-variant", "fp16-dots"])
    assert options_from_args(args, "offline").attention_variant == "fp16-dots"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--attention-variant", "fast"])


def test_engine_hands_the_variant_to_the_triton_backend(tmp_path) -> None:
    """The option reaches the kernels' configs (generating through the interpreter would take a minute;
    the kernels themselves are checked above)."""
    from overnight import LLM
    from tests.tiny_models import make_tiny_checkpoint

    folder = make_tiny_checkpoint(tmp_path, "qwen3", seed=3)
    engine = dict(skip_tokenizer_init=True, dtype="float32", device="cpu", kv_cache_memory_bytes=1 << 20)
    llm = LLM(
        str(folder), kv_cache_dtype="fp8", attention_backend="triton", attention_variant="fp16-dots", **engine
    )
    backend = llm.engine.runner.backend
    assert not backend.decode_config.fp8_mma and not backend.prefill_config.fp8_mma
    with pytest.raises(ValueError, match="unknown attention variant"):
        LLM(str(folder), attention_variant="fast", **engine)
    # A TMA variant needs pages of a multiple of its tile: refused before any weight loads
    with pytest.raises(ConfigError, match="set --block-size to a multiple of 64"):
        LLM(str(folder), kv_cache_dtype="fp8", attention_variant="tma", block_size=16, **engine)
    with pytest.raises(ConfigError, match="set --block-size to a multiple of 128 \\(got 64\\)"):
        LLM(str(folder), kv_cache_dtype="fp8", attention_variant="tma-n128", **engine)
    llm = LLM(
        str(folder), kv_cache_dtype="fp8", attention_backend="triton", attention_variant="tma", **engine
    )
    assert llm.engine.runner.backend.decode_config.tma


def test_block_size_defaults_by_cache(tmp_path) -> None:
    """16 tokens a block, 64 with an FP8 cache (options.block_size_for); a given size wins; nonsense is
    refused with the option's name."""
    from overnight import LLM
    from tests.tiny_models import make_tiny_checkpoint

    folder = make_tiny_checkpoint(tmp_path, "qwen3", seed=3)
    engine = dict(skip_tokenizer_init=True, dtype="float32", device="cpu", kv_cache_memory_bytes=1 << 20)
    for kw, expected in (
        ({}, 16),
        ({"kv_cache_dtype": "fp8"}, 64),
        ({"kv_cache_dtype": "fp8", "block_size": 32}, 32),
    ):
        assert LLM(str(folder), **kw, **engine).engine.config.cache.block_size == expected
    with pytest.raises(ConfigError, match="block_size must be at least 1"):
        LLM(str(folder), block_size=0, **engine)


# ---------------------------------------------------------------- fp8 MMA prefill (q and P in e4m3)


def fp8_prefill_batch(
    fp8: torch.dtype, q_dtype: torch.dtype, group: int, head_dim: int, seed: int, bs: int = 16
):
    """Two decodes, then prefill chunks after cached prefixes (whole, partial and none), over an fp8
    cache of random values scaled as a calibrated cache would be, on pages of bs tokens."""
    hkv = 2
    query_lens = [1, 1, 9, 20, 33, 1]
    seq_lens = [30, 7, 9, 50, 97, 16]  # chunk without prefix, after 30, after 64; a 1-row chunk
    meta, q, cache = make_batch(query_lens, seq_lens, 2, hkv * group, hkv, head_dim, bs, q_dtype, seed)
    cache = (cache.float() * 40).to(fp8)
    kv_scale = torch.tensor([0.03, 0.02], device=DEVICE)
    return meta, q, cache, kv_scale


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize(
    ("q_dtype", "group", "head_dim", "block_m", "block_n", "page"),
    [
        (torch.float32, 4, 64, 16, SMALL_FP8_TILE, 16),
        (torch.float32, 1, 64, 32, SMALL_FP8_TILE, 16),
        (torch.float16, 4, 128, 16, 32, 16),
        (torch.float32, 2, 48, 16, SMALL_FP8_TILE, 16),  # head_dim padded to BLOCK_D 64 (masked along D)
        (torch.float32, 4, 64, 16, 32, 64),  # pages of 64, an FP8 cache's default: tiles inside a page
    ],
)
def test_fp8_mma_prefill_matches_its_rounding_reference(
    fp8: torch.dtype, q_dtype: torch.dtype, group: int, head_dim: int, block_m: int, block_n: int, page: int
) -> None:
    meta, q, cache, kv_scale = fp8_prefill_batch(fp8, q_dtype, group, head_dim, 100 + group, page)
    cfg = PrefillConfig(block_m, block_n, 4, 2, fp8_mma=True)
    out = paged_attention(q, cache, meta, 0.1, out=poisoned(q), kv_scale=kv_scale, prefill_config=cfg)
    rows = slice(meta.num_decodes, meta.num_tokens)  # the decodes take the decode kernel
    emulated = prefill_fp8_mma_ref(
        q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 2, meta.num_reqs, 0.1, kv_scale,
        block_n,
    )  # fmt: skip
    exact = paged_attention_ref(q.float(), cache, meta, 0.1, kv_scale)
    tol = (1e-3 if q_dtype == torch.float16 else 1e-5) + FP8_MMA_ACCUMULATION
    assert rel_err(out[rows], emulated[rows]) < tol
    # rounding q and P to 3 mantissa bits costs a few percent of the largest output here; a wrong
    # tile, page, mask or head would be off by the size of the output itself
    assert rel_err(out[rows], exact[rows]) < 5e-2
    # the decode rows are the decode kernel's, untouched by the prefill config
    default = paged_attention(q, cache, meta, 0.1, out=poisoned(q), kv_scale=kv_scale)
    assert torch.equal(out[: meta.num_decodes], default[: meta.num_decodes])


def test_fp8_mma_prefill_rounding_is_what_separates_it_from_the_exact_answer() -> None:
    """With q on the e4m3 grid after its per-row scale and one key per request (p = 1, 256 after the
    shift, which e4m3 holds), neither rounding changes anything: the kernel equals the exact answer."""
    fp8, hkv, group, d = torch.float8_e4m3fn, 2, 4, 64
    meta, q, cache = make_batch([1, 1], [1, 1], 0, hkv * group, hkv, d, 16, torch.float32, seed=110)
    q = exact_in_fp8(tuple(q.shape), fp8, 1.0, seed=111) * 2.0**-5
    q[..., 0] = 448.0 * 2.0**-5  # each row's largest |q|: its scale is 2**-5, q / scale stays on the grid
    q = q.to(DEVICE)
    cache = (cache * 40).to(fp8)
    cfg = PrefillConfig(16, SMALL_FP8_TILE, 4, 1, fp8_mma=True)
    out = paged_attention(q, cache, meta, 0.1, out=poisoned(q), prefill_config=cfg)
    assert rel_err(out, paged_attention_ref(q, cache, meta, 0.1)) < 1e-5


def test_fp8_mma_prefill_needs_an_fp8_cache() -> None:
    meta, q, cache = make_batch([5], [5], 0, 4, 2, 64, 16, torch.float32, seed=120)
    with pytest.raises(ValueError, match="needs an FP8 cache"):
        paged_attention(q, cache, meta, 0.1, prefill_config=PrefillConfig(16, 16, 4, 1, fp8_mma=True))
