"""kernels/w4a16_moe.py on expert words in MMA order (experts_to_mma_order): every tier and unpack against
the column-order reference on the same experts, the errors for weights that do not fit, and
quant/int_moe.py's IntExperts keeping its products and dequantized weights when it converts. Without a
GPU the kernels run in the Triton interpreter (fp32, fp16), tiny shapes; on a GPU bf16 too."""

from __future__ import annotations

import pytest
import torch

from overnight.kernels import dispatch
from overnight.kernels.moe_align import moe_align
from overnight.kernels.w4a16_gemm import to_mma_order
from overnight.kernels.w4a16_moe import (
    MMA_TIERS,
    TIERS,
    V1_CONFIG,
    IntMoeTiles,
    W4A16MoeConfig,
    dequantize_experts_ref,
    experts_to_mma_order,
    w4a16_fused_experts,
    w4a16_fused_experts_ref,
    w4a16_moe_gemm,
)
from overnight.quant.int_formats import pack_along_last
from overnight.quant.int_moe import IntExperts

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
EXPERTS, HIDDEN, INTER, TOP_K, TOKENS = 4, 256, 128, 2, 25


def _stack(n: int, k: int, group: int, zeros: bool, seed: int):
    """int32 [E, n, k/8] codes in column order, float32 scales (outputs of order 1) and zeros or None."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (EXPERTS, n, k), generator=gen)
    scale = torch.rand(EXPERTS, n, k // group, generator=gen) * 0.02 + 0.005
    zero = torch.randint(0, 16, (EXPERTS, n, k // group), generator=gen).float() if zeros else None
    return pack_along_last(codes, 4).to(DEVICE), scale.to(DEVICE), None if zero is None else zero.to(DEVICE)


def _routing(seed: int = 5):
    gen = torch.Generator().manual_seed(seed)
    weights, ids = torch.topk(torch.randn(TOKENS, EXPERTS, generator=gen).softmax(-1), TOP_K)
    return weights.to(DEVICE), ids.int().to(DEVICE)


def test_experts_to_mma_order_is_each_experts_rows():
    qw, _, _ = _stack(8, HIDDEN, 128, False, 0)
    mma = experts_to_mma_order(qw)
    assert mma.shape == qw.shape
    for e in range(EXPERTS):
        assert torch.equal(mma[e], to_mma_order(qw[e]))
    assert torch.equal(experts_to_mma_order(mma, inverse=True), qw)
    assert not torch.equal(mma, qw)


def _variants() -> dict[str, W4A16MoeConfig]:
    """Every tier of MMA_TIERS and TIERS (their K steps become 128 deep) and the options the tiers
    leave out."""
    half_swap = IntMoeTiles(64, 32, 2, 4, 2, False, True, unpack="half")
    return {
        **{f"tier-m{cfg.block_m}": cfg for _, cfg in TIERS},
        **{f"mma-tier-m{cfg.block_m}": cfg for _, cfg in MMA_TIERS if cfg not in [c for _, c in TIERS]},
        "half-m64": W4A16MoeConfig(64, IntMoeTiles(32, 32, 2, 4, 2, False, unpack="half"), half_swap),
        "swap-before-m16": W4A16MoeConfig(16, IntMoeTiles(32, 32, 1, 4, 2, False, True), half_swap),
    }


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", list(_variants()))
@pytest.mark.parametrize("groups,zeros", [((128, 128), True), ((256, 128), False)])
def test_every_moe_variant_on_mma_order_matches_reference(variant, groups, zeros, dtype):
    """25 tokens x top-2 over 4 experts (runs of ~12 rows: padding at every tile), both GEMMs on MMA-
    ordered words against the reference on the same experts in column order; the reference reads the
    order back bit for bit."""
    gate_up = _stack(2 * INTER, HIDDEN, groups[0], zeros, 0)
    down = _stack(HIDDEN, INTER, groups[1], zeros, 50)
    mma_gate_up = (experts_to_mma_order(gate_up[0]), *gate_up[1:])
    mma_down = (experts_to_mma_order(down[0]), *down[1:])
    weights, ids = _routing()
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
    cfg = _variants()[variant]
    y = w4a16_fused_experts(x, mma_gate_up, mma_down, 4, groups, weights, ids, config=cfg, mma_order=True)
    ref = w4a16_fused_experts_ref(x, gate_up, down, 4, groups, weights, ids)
    assert torch.equal(
        w4a16_fused_experts_ref(x, mma_gate_up, mma_down, 4, groups, weights, ids, mma_order=True), ref
    )
    scale = ref.float().abs().max()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert y.dtype == dtype and y.shape == x.shape
    torch.testing.assert_close(y.float() / scale, ref.float() / scale, atol=tol, rtol=0)


def test_mma_order_needs_4_bit_codes_128_column_groups_and_v2():
    qw, scale, zero = _stack(32, HIDDEN, 64, True, 1)
    runs = moe_align(torch.zeros(2, 1, dtype=torch.int32, device=DEVICE), EXPERTS, 16)
    a = torch.randn(2, HIDDEN, device=DEVICE)
    with pytest.raises(ValueError, match="MMA order needs"):
        w4a16_moe_gemm(a, qw, scale, zero, 4, 64, runs, mma_order=True)
    qw, scale, zero = _stack(32, HIDDEN, 128, True, 1)
    with pytest.raises(ValueError, match="v2 kernel"):
        w4a16_moe_gemm(a, qw, scale, zero, 4, 128, runs, kernel="v1", mma_order=True)
    weights = torch.ones(2, 1, device=DEVICE)
    ids = torch.zeros(2, 1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="v2 kernel"):
        w4a16_fused_experts(
            a,
            (qw, scale, zero),
            (qw, scale, zero),
            4,
            (128, 128),
            weights,
            ids,
            config=V1_CONFIG,
            mma_order=True,
        )


def _experts(group: int | None, inter: int = INTER) -> IntExperts:
    """Packed experts with zero points; group None: channel-wise (one group a row)."""
    experts = IntExperts(EXPERTS, HIDDEN, inter, 4, group, False, torch.nn.Module, torch.float32, DEVICE)
    for proj, (n, k, seed) in (("gate_up", (2 * inter, HIDDEN, 0)), ("down", (HIDDEN, inter, 9))):
        qw, scale, zero = _stack(n, k, group or k, True, seed)
        getattr(experts, f"{proj}_proj").data.copy_(qw)
        getattr(experts, f"{proj}_scale").copy_(scale)
        getattr(experts, f"{proj}_zero").copy_(zero)
    return experts


@pytest.mark.parametrize("group,inter", [(128, INTER), (None, INTER), (64, INTER), (None, 192)])
def test_experts_in_mma_order_keep_their_products(group, inter, monkeypatch):
    """IntExperts.use_mma_order_: the same forward on the kernels and on the reference, the same
    dequantized weights (groups of 128 and channel-wise); experts whose groups (64, or down's one group
    of a 192-wide intermediate size, as a tensor-parallel share can be) are not a multiple of 128
    columns keep the column order."""
    experts = _experts(group, inter)
    weights, ids = _routing()
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(4), device="cpu").to(DEVICE)
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", True)
    before, dense = experts(x, weights, ids), experts.dequantized(torch.float32)
    words = experts.gate_up_proj.clone()
    experts.use_mma_order_()
    fits = group != 64 and inter % 128 == 0
    assert experts.mma_order == fits
    assert torch.equal(experts.gate_up_proj, experts_to_mma_order(words) if fits else words)
    for got, want in zip(experts.dequantized(torch.float32), dense):
        assert torch.equal(got, want)
    torch.testing.assert_close(experts(x, weights, ids), before, atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", False)  # the reference path reads the order too
    torch.testing.assert_close(experts(x, weights, ids), before, atol=1e-5, rtol=1e-5)
    experts.use_mma_order_()  # a second call converts nothing twice
    assert experts.mma_order == fits
    for got, want in zip(experts.dequantized(torch.float32), dense):
        assert torch.equal(got, want)


def test_after_load_keeps_cpu_experts_and_follows_the_switch(monkeypatch):
    """after_load_ converts on the GPU only, and only with MMA_ORDER on."""
    from overnight.kernels import w4a16_moe

    experts = _experts(128)
    monkeypatch.setattr(w4a16_moe, "MMA_ORDER", True)
    experts.after_load_()
    assert experts.mma_order == (DEVICE == "cuda")
    experts = _experts(128)
    monkeypatch.setattr(w4a16_moe, "MMA_ORDER", False)
    experts.after_load_()
    assert not experts.mma_order


def test_dequantize_reads_mma_order_back():
    qw, scale, zero = _stack(16, HIDDEN, 128, True, 2)
    mma = experts_to_mma_order(qw)
    want = dequantize_experts_ref(qw, scale, zero, 4, 128, torch.float32)
    assert torch.equal(dequantize_experts_ref(mma, scale, zero, 4, 128, torch.float32, True), want)


def test_default_config_takes_mma_tiers_on_mma_words():
    """At Qwen3-30B-A3B's routing (top-8 of 128) MMA_TIERS keeps TIERS' alignments; its 64-row tier is
    swapped (the words wgmma's register operand) where column order keeps the unswapped tier."""
    from overnight.kernels.w4a16_moe import default_config

    for tokens in (1, 100, 512, 1024, 4096):
        column, mma = default_config(tokens, 8, 128), default_config(tokens, 8, 128, mma_order=True)
        assert mma.block_m == column.block_m
        assert mma.gemm1.swap_ab and mma.gemm2.swap_ab, tokens
    assert default_config(1024, 8, 128, mma_order=True).block_m == 64
    assert not default_config(1024, 8, 128).gemm1.swap_ab


@pytest.mark.parametrize("mma_order", [False, True])
def test_fused_experts_default_follows_the_word_order(mma_order, monkeypatch):
    """With no config, w4a16_fused_experts takes the tier for its words' order: 100 tokens x top-2 over
    4 experts is 50 rows an expert, the 64-row tier."""
    from overnight.kernels import w4a16_moe

    seen = []

    def spy(*args, tiles, mma_order, **kwargs):
        seen.append((tiles, mma_order))
        raise StopIteration

    monkeypatch.setattr(w4a16_moe, "w4a16_moe_gemm", spy)
    qw, scale, zero = _stack(2 * INTER, HIDDEN, 128, True, 0)
    ids = torch.arange(200, device=DEVICE).remainder(EXPERTS).int().view(100, 2)
    with pytest.raises(StopIteration):
        w4a16_fused_experts(
            torch.randn(100, HIDDEN, device=DEVICE), (qw, scale, zero), (qw, scale, zero), 4, (128, 128),
            torch.ones(100, 2, device=DEVICE), ids, mma_order=mma_order,
        )  # fmt: skip
    tiers = MMA_TIERS if mma_order else TIERS
    assert seen == [(dict(tiers)[64].gemm1, mma_order)]
