"""The fused MoE kernels (router top-k, expert alignment, grouped GEMMs, the whole fused layer) against
their PyTorch references, and a tiny Qwen3-MoE with the kernels on against the PyTorch path.

Without a GPU, conftest.py turns on the Triton interpreter (fp32/fp16 only, tiny shapes); with one,
bf16 runs too. bench/moe_gpu.py repeats these checks at Qwen3-30B-A3B's shapes on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from overnight.kernels import dispatch, moe_configs
from overnight.kernels import moe_align as moe_align_module
from overnight.kernels.fp8_quant import quantize_fp8
from overnight.kernels.fused_moe import fused_experts
from overnight.kernels.moe_align import ALIGN_VARIANTS, ExpertRuns, max_padded, moe_align, moe_align_ref
from overnight.kernels.moe_configs import MoeConfig, default_config, get_config, shape_key
from overnight.kernels.moe_gemm import GemmTiles, moe_gemm, moe_gemm_ref
from overnight.kernels.moe_router import router_topk
from overnight.kernels.moe_sum import moe_sum, moe_sum_ref
from overnight.layers.moe import ExpertActivation, fused_experts_ref, router_topk_ref, runs_w8a8
from overnight.loader.model_loader import load_model
from overnight.loader.resolve import resolve_source
from overnight.quant.fp8 import quantize_stacked_per_channel
from tests.kernel_helpers import run_steps
from tests.tiny_models import make_tiny_checkpoint
from tests.triton_fp8 import exact_fp8_casts

pytestmark = pytest.mark.slow  # long Triton-interpreter runs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
SMALL = GemmTiles(block_n=16, block_k=16, group_m=2, num_warps=4, num_stages=2)


@pytest.fixture
def exact_casts():
    """The interpreter's fp32 -> e4m3 conversions rounded as the GPU's (tests/triton_fp8.py), so the
    kernels' quantized activations equal the reference's."""
    with exact_fp8_casts():
        yield


def randn(*shape: int, seed: int, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(DEVICE, dtype)


def random_ids(num_tokens: int, top_k: int, num_experts: int, seed: int) -> torch.Tensor:
    """Distinct experts per token, as a router picks them."""
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]
    return torch.stack(rows).to(DEVICE, torch.int32)


def experts_weights(
    e: int, n: int, h: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return randn(e, 2 * n, h, seed=seed, scale=h**-0.5, dtype=dtype), randn(
        e, h, n, seed=seed + 1, scale=n**-0.5, dtype=dtype
    )


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32: a few ulps of the output's scale (sums in another order). fp16/bf16: both round the same
    fp32 value once, so they differ by at most an ulp or two of the result where the fp32 sums differ."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    scale = float(ref.float().abs().max())
    tol = 1e-5 if out.dtype == torch.float32 else 4 * torch.finfo(out.dtype).eps
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * scale)


# -- router --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 8, 2), (37, 8, 2), (20, 6, 3), (17, 128, 8)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_router_topk_matches_reference(dtype, num_tokens, num_experts, top_k, renormalize):
    logits = randn(num_tokens, num_experts, seed=num_tokens, scale=2.0, dtype=dtype)
    weights, ids = router_topk(logits, top_k, renormalize)
    ref_weights, ref_ids = router_topk_ref(logits, top_k, renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    # Equal logits (frequent in bf16, 8 significant bits: on an H200 4 of these cases had some) give
    # equal probabilities, which torch.topk on CUDA orders in no fixed way; the kernel gives a tie to the
    # lower expert id. So the ids are the reference probabilities' order with that rule (a stable sort),
    # which is the reference's own order wherever nothing ties. Logits that differ differ by an ulp of
    # bf16 at least, far above the fp32 softmax's rounding, so no other pair can swap.
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    order = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :top_k]
    assert torch.equal(ids, order.to(torch.int32))
    assert torch.equal(probs.gather(1, ref_ids.long()), probs.gather(1, order))  # the same values picked
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-6)


def test_router_topk_ties_pick_distinct_experts():
    logits = torch.zeros(3, 8, device=DEVICE)  # all tied: the lowest ids, each once
    weights, ids = router_topk(logits, 3, renormalize=True)
    assert ids.tolist() == [[0, 1, 2]] * 3
    torch.testing.assert_close(weights, torch.full((3, 3), 1 / 3, device=DEVICE))


def test_router_topk_strided_logits():
    wide = randn(9, 20, seed=3)
    weights, ids = router_topk(wide[:, :8], 2, renormalize=False)
    ref_weights, ref_ids = router_topk_ref(wide[:, :8], 2, renormalize=False)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights)


# -- alignment -------------------------------------------------------------------------------------------


ALIGN_CASES = [
    (1, 2, 8, 16),  # decode of one: two tiles, mostly padding
    (37, 2, 8, 16),
    (300, 8, 128, 64),  # several chunks; E = 128
    (100, 4, 6, 32),  # E not a power of two
    (3, 8, 128, 16),  # fewer pairs than experts
    (64, 1, 4, 16),  # runs that fill whole tiles exactly
]


def assert_same_runs(runs: ExpertRuns, ref: ExpertRuns, stable: bool) -> None:
    """The same padded runs and tile experts as the reference; the stable variant also keeps each run's
    pairs in order, the atomic one may list them in any order (each run the same set)."""
    n, block_m = int(ref.num_padded), ref.block_m
    assert int(runs.num_padded) == n and n % block_m == 0
    assert torch.equal(runs.expert_ids[: n // block_m], ref.expert_ids[: n // block_m])
    got, want = runs.sorted_ids[:n].long(), ref.sorted_ids[:n].long()
    if stable:
        assert torch.equal(got, want)
        return
    # each position keyed by its run's expert: equal sorted keys <=> each run holds the same pairs and as
    # many sentinels
    expert = ref.expert_ids[: n // block_m].long().repeat_interleave(block_m)
    key = expert * (ref.num_pairs + 1)
    assert torch.equal((key + got).sort().values, (key + want).sort().values)
    assert bool((got[got < ref.num_pairs].sort().values == torch.arange(ref.num_pairs, device=DEVICE)).all())


@pytest.mark.parametrize("variant", ALIGN_VARIANTS)
@pytest.mark.parametrize("num_tokens,top_k,num_experts,block_m", ALIGN_CASES)
def test_align_matches_reference(num_tokens, top_k, num_experts, block_m, variant):
    if num_tokens == 64:  # every run a multiple of block_m: no padding slot at all
        ids = (torch.arange(64, device=DEVICE) // 16).to(torch.int32).view(64, 1)
    else:
        ids = random_ids(num_tokens, top_k, num_experts, seed=num_tokens)
    runs = moe_align(ids, num_experts, block_m, variant)
    ref = moe_align_ref(ids, num_experts, block_m)
    assert runs.sorted_ids.numel() == max_padded(ids.numel(), num_experts, block_m) >= int(ref.num_padded)
    assert_same_runs(runs, ref, stable=variant == "stable")


@pytest.fixture
def atomic_calls(monkeypatch) -> list[int]:
    """A 1 appended each time moe_align runs the atomic kernels."""
    calls: list[int] = []
    run_atomic = moe_align_module._align_atomic
    monkeypatch.setattr(moe_align_module, "_align_atomic", lambda *args: calls.append(1) or run_atomic(*args))
    return calls


def test_atomic_align_past_its_limit_runs_the_stable_variant(monkeypatch, atomic_calls):
    ids = random_ids(37, 2, 8, seed=3)  # 74 pairs
    moe_align(ids, 8, 16, "atomic")
    assert atomic_calls == [1]  # within the limit: the atomic kernels
    monkeypatch.setattr(moe_align_module, "ATOMIC_MAX_PAIRS", 16)
    assert_same_runs(moe_align(ids, 8, 16, "atomic"), moe_align_ref(ids, 8, 16), stable=True)
    assert atomic_calls == [1]  # past it: the stable kernels
    with pytest.raises(ValueError, match="unknown alignment variant"):
        moe_align(ids, 8, 16, "sorted")


def test_default_align_is_atomic_up_to_its_measured_crossover(monkeypatch, atomic_calls):
    monkeypatch.setattr(moe_align_module, "ATOMIC_DEFAULT_PAIRS", 74)
    ids = random_ids(37, 2, 8, seed=4)  # 74 pairs: at the crossover, atomic
    assert_same_runs(moe_align(ids, 8, 16), moe_align_ref(ids, 8, 16), stable=False)
    assert atomic_calls == [1]
    more = random_ids(38, 2, 8, seed=5)  # 76 pairs: past it, stable (in order within each expert)
    assert_same_runs(moe_align(more, 8, 16), moe_align_ref(more, 8, 16), stable=True)
    assert atomic_calls == [1]


@pytest.mark.parametrize("variant", ALIGN_VARIANTS)
def test_align_puts_everything_on_one_expert(variant):
    ids = torch.full((40, 1), 5, dtype=torch.int32, device=DEVICE)
    runs = moe_align(ids, 8, 16, variant)
    assert int(runs.num_padded) == 48
    assert sorted(runs.sorted_ids[:40].tolist()) == list(range(40))
    assert runs.sorted_ids[40:48].tolist() == [40] * 8
    assert runs.expert_ids[:3].tolist() == [5, 5, 5]
    if variant == "stable":
        assert runs.sorted_ids[:40].tolist() == list(range(40))


def shuffled_within_runs(runs: ExpertRuns, seed: int) -> ExpertRuns:
    """The same runs with each expert's pairs and sentinels in another order (what the atomic variant
    may produce on a GPU; the interpreter runs its atomic adds in pair order)."""
    n, block_m = int(runs.num_padded), runs.block_m
    expert = runs.expert_ids[: n // block_m].long().repeat_interleave(block_m)
    noise = torch.rand(n, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    order = torch.sort(expert.double() + noise.double()).indices  # stays within each run
    sorted_ids = runs.sorted_ids.clone()
    sorted_ids[:n] = runs.sorted_ids[:n][order]
    assert not torch.equal(sorted_ids[:n], runs.sorted_ids[:n])
    return runs._replace(sorted_ids=sorted_ids)


def test_gemms_do_not_depend_on_the_order_within_a_run():
    """Why the atomic variant may number an expert's pairs in any order: every row is computed on its own
    and stored at its pair's index, so both GEMMs give the same bits for any order within the runs."""
    num_tokens, top_k, num_experts, hidden, inter = 29, 2, 4, 32, 16
    x = randn(num_tokens, hidden, seed=60)
    w13, w2 = experts_weights(num_experts, inter, hidden, torch.float32, seed=61)
    ids = random_ids(num_tokens, top_k, num_experts, seed=62)
    weights = torch.rand(num_tokens, top_k, generator=torch.Generator().manual_seed(63)).to(DEVICE)
    runs = moe_align(ids, num_experts, 16, "stable")
    mixed = shuffled_within_runs(runs, seed=64)
    assert_same_runs(mixed, runs, stable=False)
    h = moe_gemm(x, w13, runs, SMALL, gated=True)
    assert_row_independent(moe_gemm(x, w13, mixed, SMALL, gated=True), h)
    y = moe_gemm(h, w2, runs, SMALL, topk_weights=weights)
    assert_row_independent(moe_gemm(h, w2, mixed, SMALL, topk_weights=weights), y)


def assert_row_independent(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """The same bits on a GPU (a tensor-core tile computes each row on its own). The interpreter's dot
    is a BLAS matmul, whose result for a row may move by an ulp with the row's place in the tile on
    some CPUs (OpenBLAS takes other code paths for the tile's edge rows): rounding-close there."""
    if DEVICE == "cuda":
        assert torch.equal(ours, ref)
    else:
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_max_padded_bounds_every_routing():
    for pairs, experts, block_m in [(8, 128, 16), (8192, 128, 64), (1, 1, 128), (5, 3, 16)]:
        worst = min(experts, pairs) * (block_m - 1) + pairs
        assert max_padded(pairs, experts, block_m) >= worst
        assert max_padded(pairs, experts, block_m) % block_m == 0


# -- grouped GEMMs ---------------------------------------------------------------------------------------


GEMM_CASES = [
    # tokens, k, experts, hidden (K of gemm1), inter (N of gemm1), block_m, tiles
    (5, 2, 8, 32, 16, 16, SMALL),
    (37, 2, 8, 48, 40, 16, GemmTiles(32, 32, 4, 4, 2)),  # K and N not multiples of the tile
    (9, 3, 5, 64, 32, 32, GemmTiles(16, 32, 1, 4, 2)),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", GEMM_CASES, ids=lambda c: f"T{c[0]}-k{c[1]}-E{c[2]}")
def test_grouped_gemms_match_reference(dtype, case):
    num_tokens, top_k, num_experts, hidden, inter, block_m, tiles = case
    x = randn(num_tokens, hidden, seed=1, dtype=dtype)
    w13, w2 = experts_weights(num_experts, inter, hidden, dtype, seed=2)
    ids = random_ids(num_tokens, top_k, num_experts, seed=3)
    weights = torch.rand(num_tokens, top_k, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    runs = moe_align(ids, num_experts, block_m)

    h = moe_gemm(x, w13, runs, tiles, gated=True)
    assert h.shape == (num_tokens * top_k, inter)
    assert_close(h, moe_gemm_ref(x, w13, ids, gated=True))
    y = moe_gemm(h, w2, runs, tiles, topk_weights=weights)
    assert_close(y, moe_gemm_ref(h, w2, ids, topk_weights=weights))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", GEMM_CASES[:2], ids=lambda c: f"T{c[0]}-k{c[1]}-E{c[2]}")
def test_grouped_gemms_with_fp8_experts_match_reference(dtype, case):
    """e4m3 weights converted to the activations' dtype in the kernel, each row scaled in the epilogue
    (the gate's and the up's rows by their own scales): the reference multiplies the dequantized weights."""
    num_tokens, top_k, num_experts, hidden, inter, block_m, tiles = case
    x = randn(num_tokens, hidden, seed=21, dtype=dtype)
    w13, w2 = experts_weights(num_experts, inter, hidden, torch.float32, seed=22)
    # Rows of very different sizes: a scale applied to the wrong row (or gate/up swapped) shows.
    w13 = w13 * torch.linspace(0.1, 10.0, 2 * inter, device=DEVICE)[None, :, None]
    (q13, s13), (q2, s2) = quantize_stacked_per_channel(w13), quantize_stacked_per_channel(w2)
    ids = random_ids(num_tokens, top_k, num_experts, seed=23)
    weights = torch.rand(num_tokens, top_k, generator=torch.Generator().manual_seed(24)).to(DEVICE)
    runs = moe_align(ids, num_experts, block_m)

    h = moe_gemm(x, q13, runs, tiles, gated=True, w_scale=s13)
    assert_close(h, moe_gemm_ref(x, q13, ids, gated=True, w_scale=s13))
    y = moe_gemm(h, q2, runs, tiles, topk_weights=weights, w_scale=s2)
    assert_close(y, moe_gemm_ref(h, q2, ids, topk_weights=weights, w_scale=s2))
    with pytest.raises(ValueError, match="needs w_scale"):
        moe_gemm(x, q13, runs, tiles, gated=True)
    with pytest.raises(ValueError, match=r"w_scale must be float32"):
        moe_gemm(x, q13, runs, tiles, gated=True, w_scale=s13[:, :-1])


def test_fused_fp8_experts_match_the_layer_reference():
    """The fused layer with FP8 experts against layers/moe.py's CPU path, which dequantizes the experts
    it runs, and both near the float experts they were quantized from."""
    num_tokens, num_experts, top_k, hidden, inter = 23, 8, 2, 32, 16
    x = randn(num_tokens, hidden, seed=30)
    w13, w2 = experts_weights(num_experts, inter, hidden, torch.float32, seed=31)
    (q13, s13), (q2, s2) = quantize_stacked_per_channel(w13), quantize_stacked_per_channel(w2)
    weights, ids = router_topk_ref(randn(num_tokens, num_experts, seed=32), top_k, renormalize=True)
    config = MoeConfig(16, SMALL, GemmTiles(16, 16, 1, 4, 2))
    out = fused_experts(x, q13, q2, weights, ids, config, s13, s2)
    assert_close(out, fused_experts_ref(x, q13, q2, weights, ids, s13, s2))
    exact = fused_experts_ref(x, w13, w2, weights, ids)
    assert float((out - exact).abs().max()) < 0.1 * float(exact.abs().max())  # e4m3's rounding, no more


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", GEMM_CASES[:2], ids=lambda c: f"T{c[0]}-k{c[1]}-E{c[2]}")
def test_grouped_gemms_with_fp8_activations_match_reference(dtype, case, exact_casts):
    """W8A8: e4m3 rows (each with its own scale) times e4m3 weights, both scales in the epilogue; rows
    of very different sizes, so a scale applied to the wrong row shows."""
    num_tokens, top_k, num_experts, hidden, inter, block_m, tiles = case
    x = randn(num_tokens, hidden, seed=41) * torch.logspace(-1, 1, num_tokens, device=DEVICE)[:, None]
    w13, w2 = experts_weights(num_experts, inter, hidden, torch.float32, seed=42)
    w13 = w13 * torch.linspace(0.1, 3.0, 2 * inter, device=DEVICE)[None, :, None]
    (q13, s13), (q2, s2) = quantize_stacked_per_channel(w13), quantize_stacked_per_channel(w2)
    xq, xs = quantize_fp8(x)
    ids = random_ids(num_tokens, top_k, num_experts, seed=43)
    weights = torch.rand(num_tokens, top_k, generator=torch.Generator().manual_seed(44)).to(DEVICE)
    runs = moe_align(ids, num_experts, block_m)

    h = moe_gemm(xq, q13, runs, tiles, gated=True, w_scale=s13, a_scale=xs.view(-1), out_dtype=dtype)
    assert torch.isfinite(h).all()  # the scales keep fp16 in range, so the comparison below means something
    ref = moe_gemm_ref(xq, q13, ids, gated=True, w_scale=s13, a_scale=xs.view(-1), out_dtype=dtype)
    assert_close(h, ref)
    hq, hs = quantize_fp8(h)
    y = moe_gemm(hq, q2, runs, tiles, topk_weights=weights, w_scale=s2, a_scale=hs.view(-1), out_dtype=dtype)
    ref = moe_gemm_ref(hq, q2, ids, topk_weights=weights, w_scale=s2, a_scale=hs.view(-1), out_dtype=dtype)
    assert_close(y, ref)
    # Each row takes its own scale: the scales in reverse row order give another result
    swapped = moe_gemm(
        xq, q13, runs, tiles, gated=True, w_scale=s13, a_scale=xs.view(-1).flip(0), out_dtype=dtype
    )
    assert torch.isfinite(swapped).all()
    assert float((swapped.float() - h.float()).abs().max()) > 0.1 * float(h.float().abs().max())
    with pytest.raises(ValueError, match="needs a_scale"):
        moe_gemm(xq, q13, runs, tiles, gated=True, w_scale=s13, out_dtype=dtype)
    with pytest.raises(ValueError, match="a_scale must be float32"):
        moe_gemm(xq, q13, runs, tiles, gated=True, w_scale=s13, a_scale=xs, out_dtype=dtype)
    with pytest.raises(ValueError, match="need out_dtype"):
        moe_gemm(xq, q13, runs, tiles, gated=True, w_scale=s13, a_scale=xs.view(-1))
    with pytest.raises(ValueError, match="need e4m3 weights"):
        moe_gemm(xq, w13, runs, tiles, gated=True, a_scale=xs.view(-1), out_dtype=dtype)


@pytest.mark.parametrize("kind", ["silu", "gelu_tanh", "relu2"])
def test_fused_w8a8_experts_match_the_reference(kind, exact_casts):
    """The fused layer with fp8_activations against fused_experts_ref's W8A8 arithmetic, and both near
    the weight-only result (the activations' e4m3 rounding, no more)."""
    num_tokens, num_experts, top_k, hidden, inter = 23, 8, 2, 32, 16
    gated = kind != "relu2"
    x = randn(num_tokens, hidden, seed=50)
    w13, w2 = experts_weights(num_experts, inter, hidden, torch.float32, seed=51)
    if not gated:
        w13 = w13[:, :inter].contiguous()
    (q13, s13), (q2, s2) = quantize_stacked_per_channel(w13), quantize_stacked_per_channel(w2)
    weights, ids = router_topk_ref(randn(num_tokens, num_experts, seed=52), top_k, renormalize=True)
    config = MoeConfig(16, SMALL, GemmTiles(16, 16, 1, 4, 2))
    act = ExpertActivation(kind)
    out = fused_experts(
        x,
        q13,
        q2,
        weights,
        ids,
        config,
        s13,
        s2,
        activation=(kind, act.alpha, act.limit),
        fp8_activations=True,
    )
    ref = fused_experts_ref(x, q13, q2, weights, ids, s13, s2, activation=act, fp8_activations=True)
    # h is requantized: where the two sides' fp32 sums differ by an ulp next to an e4m3 rounding
    # boundary, that element moves by an e4m3 step. Most rows agree to fp32 ulps, none by more than
    # such a step carries through the down projection.
    scale = float(ref.abs().max())
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-3 * scale)
    assert float(((out - ref).abs() <= 1e-5 * scale).float().mean()) > 0.95
    weight_only = fused_experts_ref(x, q13, q2, weights, ids, s13, s2, activation=act)
    err = float((out - weight_only).abs().max())
    assert 0 < err < 0.1 * float(weight_only.abs().max())
    with pytest.raises(ValueError, match="needs e4m3 experts"):
        fused_experts(x, w13, w2, weights, ids, config, activation=(kind, 0.0, 0.0), fp8_activations=True)


def test_fp8_experts_run_w8a8_on_a_gpu_only():
    """The choice follows the weights' device: the CPU path stays weight-only (HF's arithmetic)."""
    e4m3 = torch.zeros(2, 4, 8, dtype=torch.float8_e4m3fn, device=DEVICE)
    assert runs_w8a8(e4m3) == (DEVICE == "cuda")
    assert not runs_w8a8(torch.zeros(2, 4, 8, device=DEVICE))


def test_gemm_tiles_past_num_padded_are_not_run():
    """The reference alignment fills the unused tail with -1 (a real kernel would leave it unwritten);
    a tile that ran anyway would read pair -1 and write outside its rows."""
    ids = random_ids(3, 2, 8, seed=5)
    x = randn(3, 32, seed=6)
    w13, _ = experts_weights(8, 16, 32, torch.float32, seed=7)
    runs = moe_align_ref(ids, 8, 16)
    assert runs.sorted_ids.numel() > int(runs.num_padded)  # there is a tail
    out = torch.full((6, 16), float("nan"), device=DEVICE)
    moe_gemm(x, w13, runs, SMALL, gated=True, out=out)
    assert_close(out, moe_gemm_ref(x, w13, ids, gated=True))


def test_gemm_rejects_bad_shapes():
    runs = moe_align(random_ids(4, 2, 8, seed=0), 8, 16)
    w = torch.zeros(8, 32, 16, device=DEVICE)
    with pytest.raises(ValueError, match="must be a multiple"):
        moe_gemm(torch.zeros(3, 16, device=DEVICE), w, runs, SMALL)
    with pytest.raises(ValueError, match=r"w must be \[E, N, 24\]"):
        moe_gemm(torch.zeros(4, 24, device=DEVICE), w, runs, SMALL)


# -- the top-k sum ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "top_k", "hidden"), [(5, 8, 40), (3, 2, 1500), (1, 1, 16)])
def test_moe_sum_matches_reference(dtype, num_tokens, top_k, hidden):
    """Each token's k rows added in float32 and rounded once; H past one block (1,500 > 1,024) and not
    a power of two, so the column mask and the second block count."""
    y = randn(num_tokens * top_k, hidden, seed=60, dtype=dtype)
    out = moe_sum(y, top_k)
    ref = moe_sum_ref(y, top_k)
    assert out.dtype == dtype and out.shape == (num_tokens, hidden)
    torch.testing.assert_close(
        out.float(), ref.float(), rtol=1e-6, atol=1e-6 * float(ref.float().abs().max())
    )
    assert torch.equal(moe_sum(y, top_k), out)  # one fixed order: the same bits every time
    with pytest.raises(ValueError, match="not a multiple of top_k"):
        moe_sum(y[:-1], top_k) if top_k > 1 else moe_sum(y, 0)


# -- the fused layer ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 23])
def test_fused_experts_matches_reference(dtype, num_tokens):
    num_experts, top_k, hidden, inter = 8, 2, 32, 16
    x = randn(num_tokens, hidden, seed=10, dtype=dtype)
    w13, w2 = experts_weights(num_experts, inter, hidden, dtype, seed=11)
    weights, ids = router_topk_ref(randn(num_tokens, num_experts, seed=12), top_k, renormalize=True)
    config = MoeConfig(16, SMALL, GemmTiles(16, 16, 1, 4, 2))
    out = fused_experts(x, w13, w2, weights, ids, config)
    ref = fused_experts_ref(x.float(), w13.float(), w2.float(), weights, ids).to(dtype)
    if dtype == torch.float32:
        assert_close(out, ref)
    else:  # the reference rounds after every op; the kernels once per GEMM, and once after the sum
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2 * float(ref.abs().max()))


def test_model_forward_with_fp8_expert_kernels_matches_pytorch_path(tmp_path, monkeypatch):
    """quantization="fp8" on a MoE model: the fused FP8 experts against the layer's CPU path, everything
    else on the same (PyTorch) path on both sides (the FP8 linear kernels have tests of their own)."""
    import overnight.layers.moe as moe

    folder = make_tiny_checkpoint(tmp_path, "qwen3_moe", num_hidden_layers=2, mlp_only_layers=[1])
    model = load_model(resolve_source(str(folder), quantization="fp8"), torch.float32, DEVICE)
    assert model.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", False)
    expected = run_steps(model)
    monkeypatch.setattr(moe, "use_kernels", lambda x: True)
    got = run_steps(model)
    if DEVICE == "cuda":  # both paths run W8A8 there (layers/moe.py runs_w8a8)
        monkeypatch.setattr(moe, "use_kernels", lambda x: False)
        monkeypatch.setattr(moe, "runs_w8a8", lambda w: False)
        assert_w8a8_close(got, expected, weight_only=run_steps(model))
    else:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


def assert_w8a8_close(got: torch.Tensor, expected: torch.Tensor, weight_only: torch.Tensor) -> None:
    """The W8A8 kernels against the W8A8 PyTorch path on a GPU, where they cannot agree bit for bit.
    The FP8 tensor cores sum in another order than torch, so elements of the experts' h next to an
    e4m3 rounding boundary land a step away, which in this tiny model moves a row's logits by up to a
    few percent (an H100: up to 2.6% of the largest logit; 9 of 23 rows over 0.1%). Neither path is exact:
    both round the activations. So the kernels must stay as close to the unrounded result (weight-only
    FP8) as the PyTorch path is, and differ from it by less than that rounding costs; a wrong scale or a
    misrouted row misses both by far."""
    scale = float(expected.abs().max())
    rounding = float((expected - weight_only).abs().max())
    assert 0 < rounding < 0.1 * scale  # the activations' rounding shows, and is a rounding
    assert float((got - weight_only).abs().max()) <= 1.25 * rounding
    assert float((got - expected).abs().max()) <= rounding


def test_model_forward_with_w8a8_experts_matches_its_pytorch_path(tmp_path, monkeypatch, exact_casts):
    """The layer's wiring of W8A8 (what a GPU runs): with runs_w8a8 on for e4m3 experts here too, the
    fused kernels and the PyTorch path both quantize the experts' inputs and agree; the logits move off
    the weight-only ones by the activations' rounding, no more."""
    import overnight.layers.moe as moe

    folder = make_tiny_checkpoint(tmp_path, "qwen3_moe", num_hidden_layers=2, mlp_only_layers=[1])
    model = load_model(resolve_source(str(folder), quantization="fp8"), torch.float32, DEVICE)
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", False)
    monkeypatch.setattr(moe, "runs_w8a8", lambda w: False)
    weight_only = run_steps(model)
    monkeypatch.setattr(moe, "runs_w8a8", lambda w: w.dtype == torch.float8_e4m3fn)
    expected = run_steps(model)
    monkeypatch.setattr(moe, "use_kernels", lambda x: True)
    got = run_steps(model)
    if DEVICE == "cuda":
        assert_w8a8_close(got, expected, weight_only)
        return
    scale = float(expected.abs().max())
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3 * scale)
    err = float((expected - weight_only).abs().max())
    assert 2e-3 * scale < err < 0.1 * scale  # so the comparison above would see a path left weight-only


def test_model_forward_with_kernels_matches_pytorch_path(tmp_path, monkeypatch):
    folder = make_tiny_checkpoint(tmp_path, "qwen3_moe", num_hidden_layers=2, mlp_only_layers=[1])
    model = load_model(resolve_source(str(folder)), torch.float32, DEVICE)
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", False)
    expected = run_steps(model)
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", True)
    got = run_steps(model)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


# -- tile configurations -------------------------------------------------------------------------------


def test_configs_nearest_tuned_batch_and_defaults(monkeypatch):
    tiles = GemmTiles(128, 64, 8, 8, 3)
    table = {
        "cpu": {
            shape_key(128, 768, 2048, 8, torch.bfloat16): {
                "1": MoeConfig(16, tiles, tiles).to_json(),
                "64": MoeConfig(32, tiles, tiles).to_json(),
                "1024": MoeConfig(64, tiles, tiles).to_json(),
            }
        }
    }
    monkeypatch.setattr(moe_configs, "_table", lambda: table)
    cpu = torch.device("cpu")

    def block_m(tokens: int, inter: int = 768) -> int:
        return get_config(tokens, 128, inter, 2048, 8, torch.bfloat16, cpu).block_m

    assert [block_m(t) for t in (1, 5, 10, 64, 200, 300, 5000)] == [16, 16, 32, 32, 32, 64, 64]
    assert get_config(64, 128, 768, 2048, 8, torch.bfloat16, cpu).gemm1 == tiles
    # An untuned shape (another tensor-parallel split) falls back to the defaults.
    assert block_m(1, inter=384) == default_config(1, 8, 128).block_m == 16
    assert default_config(16384, 8, 128).block_m == 128
    # FP8 experts: their own entries once tuned, the compute dtype's until then, with at least 64 rows
    # a tile (W8A8's e4m3 warpgroup MMA); an untuned shape's defaults too.
    fp8 = torch.float8_e4m3fn
    key = shape_key(128, 768, 2048, 8, torch.bfloat16, fp8)
    assert (
        key.endswith(",w=float8_e4m3fn")
        and shape_key(128, 768, 2048, 8, torch.bfloat16, torch.bfloat16) in key
    )
    assert get_config(64, 128, 768, 2048, 8, torch.bfloat16, cpu, fp8) == MoeConfig(64, tiles, tiles)
    assert get_config(1, 128, 384, 2048, 8, torch.bfloat16, cpu, fp8).block_m == 64
    assert get_config(5000, 128, 768, 2048, 8, torch.bfloat16, cpu, fp8).block_m == 64
    table["cpu"][key] = {"64": MoeConfig(16, tiles, tiles).to_json()}
    assert get_config(64, 128, 768, 2048, 8, torch.bfloat16, cpu, fp8).block_m == 16


def test_shipped_config_file_parses():
    for shapes in moe_configs._table().values():
        for entries in shapes.values():
            for tokens, entry in entries.items():
                config = MoeConfig.from_json(entry)
                assert int(tokens) > 0 and config.block_m in (16, 32, 64, 128)
