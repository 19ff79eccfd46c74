"""The FP8 KV cache: the reference arithmetic, the Triton kernels against it, and the engine end to end.

The Triton interpreter rounds fp32 -> fp8 wrongly on store (when the mantissa carries into the
exponent), so kv_write is checked on values that are exact in fp8 after scaling, and attention on
caches written by the torch reference; the GPU's rounding is checked by bench/kernels_gpu.py.
"""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from overnight import LLM
from overnight.attention.kv_quant import (
    calibrate_kv_scale_,
    dequantize_kv,
    kv_cache_torch_dtype,
    new_kv_scales,
    quantize_kv,
)
from overnight.attention.metadata import AttentionBatch
from overnight.attention.torch_backend import TorchAttentionBackend, paged_attention_ref, write_kv_ref
from overnight.attention.triton_backend import TritonAttentionBackend, paged_attention
from overnight.kernels.kv_layout import (
    fp8_max,
    k_head_major,
    new_kv_cache,
    to_logical_layout,
    to_storage_layout,
    v_token_major,
    v_view,
)
from overnight.kernels.kv_write import kv_write
from overnight.kernels.paged_decode import DecodeConfig
from overnight.kernels.paged_prefill import PrefillConfig
from tests.kernel_helpers import (
    DEVICE,
    ENGINE,
    NEAR_TIE,
    agreement,
    exact_in_fp8,
    greedy,
    make_batch,
    poisoned,
)
from tests.tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.slow  # long Triton-interpreter runs and real models

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# Half the distance between neighbouring normal values, relative: 3 and 2 mantissa bits.
REL_STEP = {torch.float8_e4m3fn: 2.0**-4, torch.float8_e5m2: 2.0**-3}


# ---------------------------------------------------------------- the reference arithmetic


def test_kv_cache_dtype_names() -> None:
    assert kv_cache_torch_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert kv_cache_torch_dtype("fp8", torch.bfloat16) is torch.float8_e4m3fn
    assert kv_cache_torch_dtype("fp8_e4m3", torch.float32) is torch.float8_e4m3fn
    assert kv_cache_torch_dtype("fp8_e5m2", torch.float16) is torch.float8_e5m2
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_cache_torch_dtype("int8", torch.bfloat16)


@pytest.mark.parametrize("fp8", FP8)
def test_quantize_round_trip_within_half_a_step(fp8: torch.dtype) -> None:
    scale = torch.tensor(0.037)
    # Magnitudes across the normal range after scaling (well above the smallest normal, below max).
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 0.037 * 40
    x = x[(x / scale).abs() > 0.1]
    q = quantize_kv(x, scale, fp8)
    assert q.dtype == fp8
    back = dequantize_kv(q, scale, torch.float32)
    rel = ((back - x).abs() / x.abs()).max().item()
    assert 0 < rel <= REL_STEP[fp8] * 1.0001
    # Values already on the fp8 grid survive exactly.
    exact = exact_in_fp8((512,), fp8, 0.25, seed=1)
    assert torch.equal(dequantize_kv(quantize_kv(exact, 0.25, fp8), 0.25, torch.float32), exact)


@pytest.mark.parametrize("fp8", FP8)
def test_quantize_saturates_instead_of_nan(fp8: torch.dtype) -> None:
    limit = fp8_max(fp8)
    assert limit == {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}[fp8]
    x = torch.tensor([1e9, -1e9, limit * 2.0, -limit * 2.02, 3.0])
    back = dequantize_kv(quantize_kv(x, 2.0, fp8), 2.0, torch.float32)
    assert back.isfinite().all()
    assert back[:4].tolist() == [2 * limit, -2 * limit, 2 * limit, -2 * limit]
    assert back[4].item() == 3.0


def test_reference_write_and_read_apply_the_scales() -> None:
    """write_kv_ref stores x / scale; paged_attention_ref over that cache with its scales equals the
    reference over the dequantized float cache."""
    fp8, hkv, d, bs = torch.float8_e4m3fn, 2, 16, 4
    meta, q, cache = make_batch([1, 6], [9, 6], 1, 4, hkv, d, bs, torch.float32, seed=3, cache_dtype=fp8)
    gen = torch.Generator().manual_seed(4)
    scales = torch.tensor([0.05, 0.02], device=DEVICE)
    # Fill every context position: one row per slot of each request.
    for i, seq_len in enumerate(meta.seq_lens_cpu.tolist()):
        table = meta.block_tables[i].cpu()
        slots = torch.tensor([int(table[p // bs]) * bs + p % bs for p in range(seq_len)], device=DEVICE)
        k = (torch.randn(seq_len, hkv, d, generator=gen) * 0.3).to(DEVICE)
        v = (torch.randn(seq_len, hkv, d, generator=gen) * 0.1).to(DEVICE)
        write_kv_ref(k, v, cache, slots, scales)
        assert torch.equal(cache.view(2, -1, hkv, d)[0, slots], quantize_kv(k, 0.05, fp8))
    deq = torch.stack(
        [dequantize_kv(cache[0], 0.05, torch.float32), dequantize_kv(v_view(cache), 0.02, torch.float32)]
    )
    out = paged_attention_ref(q, cache, meta, 0.25, scales)
    torch.testing.assert_close(out, paged_attention_ref(q, deq, meta, 0.25), rtol=1e-6, atol=1e-6)


def test_calibration_maps_amax_to_the_format_max() -> None:
    scales = new_kv_scales(3, "cpu")
    k = torch.tensor([[1.0, -8.96]])
    v = torch.tensor([[0.5, 0.25]])
    calibrate_kv_scale_(scales[1], k, v, torch.float8_e4m3fn)
    torch.testing.assert_close(scales[1], torch.tensor([8.96 / 448, 0.5 / 448]))
    assert scales[0].tolist() == [1.0, 1.0] and scales[2].tolist() == [1.0, 1.0]
    calibrate_kv_scale_(scales[2], torch.zeros(2, 2), v, torch.float8_e5m2)
    assert scales[2, 0].item() == 1.0  # all-zero K keeps scale 1, never 0


def test_attention_batch_calibrates_then_writes_with_the_new_scale() -> None:
    fp8, hkv, d, bs = torch.float8_e4m3fn, 2, 16, 4
    meta, q, cache = make_batch([7], [7], 0, 4, hkv, d, bs, torch.float32, seed=5, cache_dtype=fp8)
    gen = torch.Generator().manual_seed(6)
    k = (torch.randn(7, hkv, d, generator=gen) * 5).to(DEVICE)
    v = torch.randn(7, hkv, d, generator=gen).to(DEVICE)
    caches = [torch.zeros_like(cache) for _ in range(2)]
    scales = new_kv_scales(2, DEVICE)
    batch = AttentionBatch(meta, caches, TorchAttentionBackend(), scales, calibrate_kv_scales=True)
    batch(1, q, k, v, 0.25)
    assert scales[0].tolist() == [1.0, 1.0]
    torch.testing.assert_close(scales[1], torch.stack([k.abs().max(), v.abs().max()]) / 448)
    # The largest value now sits at the format's max: the write used the calibrated scale.
    assert caches[1][0].float().abs().max().item() == 448.0


# ---------------------------------------------------------------- Triton kernels (interpreter on CPU)


@pytest.mark.parametrize("fp8", FP8)
def test_kv_write_reads_its_layers_scales_from_the_device(fp8: torch.dtype) -> None:
    num_tokens, hkv, d, bs, nb = 9, 2, 32, 16, 2
    kv_scales = torch.tensor([[1.0, 1.0], [0.5, 2.0], [7.0, 7.0]], device=DEVICE)
    k = exact_in_fp8((num_tokens, hkv, d), fp8, 0.5, seed=2).to(DEVICE)
    v = exact_in_fp8((num_tokens, hkv, d), fp8, 2.0, seed=3).to(DEVICE)
    k[0, 0, :2] = torch.tensor([1e6, -1e6])  # saturates
    slots = torch.randperm(nb * bs, generator=torch.Generator().manual_seed(4))[:num_tokens].to(DEVICE)
    slots[4] = -1
    cache = torch.zeros(2, nb, bs, hkv, d, dtype=fp8, device=DEVICE)
    expected = torch.zeros_like(cache)
    kv_write(k, v, cache, slots, kv_scale=kv_scales[1])  # a row view: the kernel must honour its offset
    write_kv_ref(k, v, expected, slots, kv_scales[1])
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    assert cache.float()[0].abs().max().item() == fp8_max(fp8)
    with pytest.raises(ValueError, match="kv_scale"):
        kv_write(k, v, cache, slots, kv_scale=kv_scales[1].double())


def fp8_case(fp8: torch.dtype, q_dtype: torch.dtype, seed: int, d: int = 64, bs: int = 16):
    """A mixed batch (decodes, then prefill chunks after cached prefixes) over an fp8 cache written by
    the torch reference with scales != 1."""
    hq, hkv = 8, 2
    query_lens = [1, 1, 1, 9, 20, 1]
    seq_lens = [30, 7, 77, 9, 50, 16]
    meta, q, cache = make_batch(query_lens, seq_lens, 3, hq, hkv, d, bs, q_dtype, seed=seed)
    kv_scale = torch.tensor([0.04, 0.015], device=DEVICE)
    flat = cache.view(2, -1, hkv, d)
    fp8_cache = torch.empty(cache.shape, dtype=fp8, device=DEVICE)
    slots = torch.arange(flat.shape[1], device=DEVICE)
    write_kv_ref(flat[0] * 0.2, flat[1] * 0.05, fp8_cache, slots, kv_scale)
    return meta, q, fp8_cache, kv_scale


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize(
    ("q_dtype", "convert", "num_splits"),
    [
        (torch.float32, "fp16", 1),
        (torch.float32, "fp16", 3),
        (torch.float16, "fp16", 3),
        (torch.float16, "bits", 1),
        (torch.float16, "q", 1),
    ],
)
def test_attention_on_fp8_cache_matches_reference(
    fp8: torch.dtype, q_dtype: torch.dtype, convert: str, num_splits: int
) -> None:
    """fp16 q takes the fp16-dot paths an fp8 cache uses on the GPU (each tile conversion); fp32 q
    computes in fp32."""
    meta, q, cache, kv_scale = fp8_case(fp8, q_dtype, seed=11)
    ref = paged_attention_ref(q.float(), cache, meta, 0.125, kv_scale)
    out = paged_attention(
        q,
        cache,
        meta,
        0.125,
        out=poisoned(q),
        kv_scale=kv_scale,
        num_splits=num_splits,
        decode_config=DecodeConfig(block_n=32, fp8_convert=convert),
        prefill_config=PrefillConfig(16, 16, 4, 1),
    )
    assert not out.isnan().any()
    # Relative to the largest output: with v_scale 0.015 the outputs are small.
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    assert err < (1e-5 if q_dtype == torch.float32 else 2e-3), err


@pytest.mark.parametrize(
    ("d", "bs", "block_n"),
    [(48, 16, 32), (64, 32, 16)],  # head_dim padded to BLOCK_D 64; tiles shorter than a page
)
def test_attention_on_fp8_cache_edge_shapes(d: int, bs: int, block_n: int) -> None:
    """Token-major V (kv_layout.py) is read unmasked along tokens: a padded head_dim must not read the
    next head's values into the output, and a tile shorter than a page is a partial contiguous run."""
    meta, q, cache, kv_scale = fp8_case(torch.float8_e4m3fn, torch.float32, seed=16, d=d, bs=bs)
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
            decode_config=DecodeConfig(block_n=block_n),
            prefill_config=PrefillConfig(16, block_n, 4, 1),
        )
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_fp8_cache_stores_v_token_major() -> None:
    """Where the bytes go: V of an fp8 cache as [block, head, dim, slot] (K: the head-major test below),
    from both the kernel and the reference; v_view reads V back in token order."""
    fp8, num_tokens, hkv, d, bs, nb = torch.float8_e4m3fn, 11, 2, 32, 16, 3
    k = exact_in_fp8((num_tokens, hkv, d), fp8, 1.0, seed=20).to(DEVICE)
    v = exact_in_fp8((num_tokens, hkv, d), fp8, 1.0, seed=21).to(DEVICE)
    slots = torch.randperm(nb * bs, generator=torch.Generator().manual_seed(22))[:num_tokens].to(DEVICE)
    kernel_cache = new_kv_cache((2, nb, bs, hkv, d), fp8, DEVICE)
    ref_cache = new_kv_cache((2, nb, bs, hkv, d), fp8, DEVICE)
    assert not kernel_cache.float().any()  # zeroed (kv_layout.py)
    kv_write(k, v, kernel_cache, slots)
    write_kv_ref(k, v, ref_cache, slots)
    for cache in (kernel_cache, ref_cache):
        vc = cache[1]
        v_storage = vc.as_strided((nb, hkv, d, bs), (hkv * d * bs, d * bs, bs, 1), vc.storage_offset())
        for t, slot in enumerate(slots.tolist()):
            blk, off = divmod(slot, bs)
            assert torch.equal(cache[0, blk, off].float(), k[t])
            assert torch.equal(v_storage[blk, :, :, off].float(), v[t])
            assert torch.equal(v_view(cache)[blk, off].float(), v[t])


def test_storage_layout_round_trip() -> None:
    gen = torch.Generator().manual_seed(23)
    logical = torch.randn(2, 3, 4, 2, 8, generator=gen)
    assert to_storage_layout(logical) is logical and not v_token_major(torch.bfloat16)
    fp8 = logical.to(torch.float8_e5m2)
    stored = to_storage_layout(fp8)
    assert torch.equal(stored[0].float(), fp8[0].float())
    assert not torch.equal(stored[1].float(), fp8[1].float())
    assert torch.equal(v_view(stored).float(), fp8[1].float())


@pytest.mark.parametrize("fp8_mma", [False, True])
def test_head_major_k_holds_the_same_cache(fp8_mma: bool) -> None:
    """new_kv_cache(head_major_k=True): one KV head's K of a page is one contiguous run, the tensor keeps
    its [2, blocks, slot, head, dim] shape, and kv_write, decode (both kernels) and prefill through its
    strides give exactly what they give on the slot-major cache."""
    fp8, num_tokens, hkv, d, bs, nb = torch.float8_e4m3fn, 23, 2, 32, 16, 4
    k = exact_in_fp8((num_tokens, hkv, d), fp8, 1.0, seed=30).to(DEVICE)
    v = exact_in_fp8((num_tokens, hkv, d), fp8, 1.0, seed=31).to(DEVICE)
    slots = torch.randperm(nb * bs, generator=torch.Generator().manual_seed(32))[:num_tokens].to(DEVICE)
    plain = new_kv_cache((2, nb, bs, hkv, d), fp8, DEVICE, head_major_k=False)
    hm = new_kv_cache((2, nb, bs, hkv, d), fp8, DEVICE, head_major_k=True)
    assert hm.shape == plain.shape and k_head_major(hm) and not k_head_major(plain)
    kv_write(k, v, plain, slots)
    kv_write(k, v, hm, slots)
    assert torch.equal(to_logical_layout(hm).float(), to_logical_layout(plain).float())
    raw = hm.as_strided((2 * nb * hkv * bs * d,), (1,), 0)  # the storage's bytes in order
    for t, slot in enumerate(slots.tolist()):
        blk, off = divmod(slot, bs)
        start = (blk * hkv * bs + off) * d  # head 0 of the block, then bs * d bytes per head
        assert torch.equal(raw[start : start + d].float(), k[t, 0])
        assert torch.equal(raw[start + bs * d : start + bs * d + d].float(), k[t, 1])

    meta, q, cache, kv_scale = fp8_case(fp8, torch.float16, seed=33)
    cache_hm = to_storage_layout(to_logical_layout(cache), head_major_k=True)
    assert k_head_major(cache_hm)
    outs = []
    for c in (cache, cache_hm):
        outs.append(
            paged_attention(
                q, c, meta, 0.125, out=poisoned(q), kv_scale=kv_scale, num_splits=3,
                decode_config=DecodeConfig(block_n=32, fp8_mma=fp8_mma),
                prefill_config=PrefillConfig(16, 16, 4, 1),
            )
        )  # fmt: skip
    assert not outs[0].isnan().any()
    assert torch.equal(outs[0], outs[1])


def test_attention_reads_scales_at_run_time() -> None:
    """The same launch with the scale tensor changed in place gives the new result (what keeps CUDA
    graphs valid after a calibration)."""
    meta, q, cache, kv_scale = fp8_case(torch.float8_e4m3fn, torch.float32, seed=12)
    # The fp16-dot paths, whose arithmetic is exact here (the e4m3-dot defaults round q and P).
    cfgs = dict(decode_config=DecodeConfig(block_n=32), prefill_config=PrefillConfig(16, 16, 4, 1))
    first = paged_attention(q, cache, meta, 0.125, kv_scale=kv_scale, num_splits=1, **cfgs)
    kv_scale.mul_(torch.tensor([3.0, 0.5], device=DEVICE))
    second = paged_attention(q, cache, meta, 0.125, kv_scale=kv_scale, num_splits=1, **cfgs)
    ref = paged_attention_ref(q, cache, meta, 0.125, kv_scale)
    assert not torch.allclose(first, second, atol=1e-3)
    torch.testing.assert_close(second, ref, rtol=1e-4, atol=1e-4)


def test_triton_backend_equals_torch_backend_on_fp8() -> None:
    """One step through both backends: the same cache bytes and close outputs."""
    fp8 = torch.float8_e4m3fn
    meta, q, cache, _ = fp8_case(fp8, torch.float32, seed=13)
    kv_scale = torch.tensor([0.25, 0.5], device=DEVICE)
    k = exact_in_fp8((meta.num_tokens, 2, 64), fp8, 0.25, seed=14).to(DEVICE)
    v = exact_in_fp8((meta.num_tokens, 2, 64), fp8, 0.5, seed=15).to(DEVICE)
    cache_ref = cache.clone()
    ref = TorchAttentionBackend().forward(q, k, v, cache_ref, meta, 0.125, kv_scale)
    backend = TritonAttentionBackend(
        8,
        2,
        64,
        max_num_seqs=8,
        max_model_len=4096,
        device=DEVICE,
        decode_config=DecodeConfig(block_n=16),
        prefill_config=PrefillConfig(32, 32, 4, 1),
    )
    out = backend.forward(q, k, v, cache, meta, 0.125, kv_scale)
    assert torch.equal(cache.view(torch.uint8), cache_ref.view(torch.uint8))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- the engine end to end (CPU)
#
# e4m3 keeps 3 mantissa bits, so every cached K/V carries up to 6% rounding error; on tiny random models
# (and on SmolLM2-135M) that flips the greedy token wherever the top two logits are within ~0.3 nats,
# which happens within 16 tokens for a third to half of the prompts. A bf16 cache gives 100% agreement
# and ~13x smaller logprob differences on the same prompts. So the checks are: most positions agree
# before the first divergence, every divergence is a near-tie (each side's token in the other's top 5,
# reference logprobs within NEAR_TIE), and the chosen tokens' logprobs move little on average.

# (least share of positions before the first divergence, largest mean |logprob difference|)
BOUNDS = {"fp8": (0.75, 0.06), "fp8_e5m2": (0.5, 0.12)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("fp8"), "qwen3", seed=3)


def assert_close_to_reference(ref, got, kv_cache_dtype: str) -> None:
    agree = agreement(ref, got)
    least_share, most_dlp = BOUNDS[kv_cache_dtype]
    assert agree.share >= least_share, agree
    assert agree.mean_abs_dlogprob <= most_dlp, agree
    assert agree.divergences_in_top and max(agree.divergence_gaps, default=0.0) < NEAR_TIE, agree


@pytest.fixture(scope="module")
def ref_tokens(tiny):
    return greedy(LLM(str(tiny), **ENGINE))


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_engine_fp8_agrees_with_full_precision(tiny, ref_tokens, kv_cache_dtype: str) -> None:
    llm = LLM(str(tiny), kv_cache_dtype=kv_cache_dtype, **ENGINE)
    assert llm.engine.runner.kv_caches[0].dtype == kv_cache_torch_dtype(kv_cache_dtype, torch.float32)
    assert_close_to_reference(ref_tokens, greedy(llm), kv_cache_dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_pool_holds_more_tokens_in_the_same_memory(tiny, dtype: str, caplog) -> None:
    """Same kv_cache_memory_bytes: the fp8 pool holds element_size(dtype) times the tokens (2x vs bf16),
    and the start-up line says so."""
    opts = {**ENGINE, "dtype": dtype}
    full = LLM(str(tiny), **opts).engine
    with caplog.at_level(logging.INFO, logger="overnight"):
        fp8 = LLM(str(tiny), kv_cache_dtype="fp8", **opts).engine
    ratio = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    assert not fp8.pool_plan.capped and not full.pool_plan.capped
    # An FP8 cache's blocks hold 64 tokens against 16 (options.block_size_for): compare tokens and bytes
    fp8_bs, full_bs = fp8.config.cache.block_size, full.config.cache.block_size
    assert (fp8_bs, full_bs) == (64, 16)
    tokens = fp8.pool_plan.num_blocks * fp8_bs
    assert tokens == ratio * full.pool_plan.num_blocks * full_bs
    assert fp8.runner.kv_bytes_per_block() * ratio * full_bs == full.runner.kv_bytes_per_block() * fp8_bs
    assert any(f"= {tokens} tokens" in r.message and "float8_e4m3fn" in r.message for r in caplog.records)


def with_kv_scales(folder, scales: dict[int, tuple[float, float]]) -> None:
    """Add model.layers.N.self_attn.k_scale / v_scale tensors to a saved checkpoint, as FP8 checkpoints
    ship them (scalars or one-element vectors)."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    for layer, (k, v) in scales.items():
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(k)
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor([v])
    save_file(tensors, path, metadata={"format": "pt"})


def test_checkpoint_scales_are_loaded(tmp_path, ref_tokens) -> None:
    folder = make_tiny_checkpoint(tmp_path, "qwen3", seed=3)
    scales = {0: (0.02, 0.015), 1: (0.03, 0.0125)}
    with_kv_scales(folder, scales)
    llm = LLM(str(folder), kv_cache_dtype="fp8", **ENGINE)
    torch.testing.assert_close(llm.engine.runner.kv_scales, torch.tensor([scales[0], scales[1]]))
    assert_close_to_reference(ref_tokens, greedy(llm), "fp8")
    # A full-precision cache ignores the scales (and the checkpoint still loads).
    assert LLM(str(folder), **ENGINE).engine.runner.kv_scales is None


def test_calibration_sets_scales_once_and_keeps_outputs_close(tiny, ref_tokens) -> None:
    llm = LLM(str(tiny), kv_cache_dtype="fp8", calculate_kv_scales=True, **ENGINE)
    scales = llm.engine.runner.kv_scales
    assert scales.tolist() == [[1.0, 1.0], [1.0, 1.0]]
    got = greedy(llm)
    calibrated = scales.clone()
    assert (calibrated != 1.0).all() and (calibrated > 0).all()
    assert_close_to_reference(ref_tokens, got, "fp8")
    greedy(llm)  # later prefills keep the first one's scales
    assert torch.equal(scales, calibrated)
