"""kernels/w4a16_gemm.py against its torch reference: the fused dequantize-GEMM (with and without split-K),
the whole-weight dequantization (bit-exact), and the layer dispatch, for 4 and 8 bits, group sizes 16 / 32
/ 64 and one group per row (channel-wise), zero points or none, and act-order layers (input columns
gathered by the permutation made at load). Without a GPU the kernels run in the Triton interpreter
(conftest.py sets TRITON_INTERPRET=1), fp32 and fp16, tiny shapes; on a GPU bf16 too.
"""

from __future__ import annotations

import pytest
import torch

from overnight.kernels import dispatch
from overnight.kernels import w4a16_gemm as gemm_module
from overnight.kernels.w4a16_gemm import (
    DEQUANT_GEMM_MIN_M,
    W4A16Config,
    default_config,
    dequantize_int_weight,
    dequantize_int_weight_ref,
    w4a16_gemm,
    w4a16_gemm_ref,
    w4a16_linear,
)
from overnight.quant.int_formats import IntWeight, kernel_layout, pack_along_last
from overnight.quant.int_linear import WeightOnlyIntLinear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _weight(n: int, k: int, bits: int, group: int, zeros: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (n, k), generator=gen)
    scale = (torch.rand(n, k // group, generator=gen) * 0.05 + 0.01).to(DEVICE)
    zero = torch.randint(0, 1 << bits, (n, k // group), generator=gen).float().to(DEVICE) if zeros else None
    return pack_along_last(codes, bits).to(DEVICE), scale, zero


def _tol(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 2e-2


def _assert_within_rounding(y, ref, x, qw, scale, zero, bits: int, group: int, roundings: int = 3) -> None:
    """|y - ref| within what the two roundings allow, per output: the reference rounds each dequantized
    weight to x's dtype, then its fp32 sum; a scale_after kernel scales exact (code - zero) products in
    fp32 instead; both round the sum once. So they differ by up to u * sum |x| |w| (the weights'
    rounding, u = x's unit roundoff) plus u * |y| on each side: 3u * sum |x| |w|, plus the fp32 sums'
    order. The bound follows the terms' size, not the output's: an output near zero by cancellation
    keeps the whole absolute difference (in bf16, a fixed atol plus a relative one failed about one
    random input in 20, the split-K sum in fp32 or not). The "half" unpack rounds the scale to x's
    dtype before the weight: one rounding more (roundings=4)."""
    w = dequantize_int_weight_ref(qw, scale, zero, bits, group, torch.float32)
    size = x.float().abs() @ w.abs().t()
    unit = torch.finfo(x.dtype).eps / 2
    bound = (roundings * unit + 16 * torch.finfo(torch.float32).eps / 2) * size
    apart = (y.float() - ref.float()).abs()
    assert not y.isnan().any() and (apart <= bound).all(), float((apart / size).max() / unit)


CASES = [
    # bits, group, M, N, K, zeros, split_k
    (4, 32, 1, 48, 96, True, None),
    (4, 32, 3, 40, 128, False, 2),
    (4, 16, 5, 24, 64, True, 4),
    (8, 32, 2, 32, 64, True, None),
    (8, 64, 17, 24, 128, False, 1),
    (4, 96, 2, 16, 96, True, None),  # one group per row (channel-wise: the group is K)
    (4, 64, 70, 72, 128, True, None),  # M past the small-M tiles
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_fused_gemm_matches_reference(case, dtype):
    bits, group, m, n, k, zeros, split_k = case
    qw, scale, zero = _weight(n, k, bits, group, zeros)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEVICE, dtype)
    y = w4a16_gemm(x, qw, scale, zero, bits, group, split_k=split_k)
    ref = w4a16_gemm_ref(x, qw, scale, zero, bits, group)
    assert y.dtype == dtype and y.shape == (m, n)
    _assert_within_rounding(y, ref, x, qw, scale, zero, bits, group)


# The variants bench/w4a16_variants_gpu.py times (W4A16Config): the first kernel, v2 scaling the dot's
# product or the weight, split-K summed or added atomically, the large-M tiles, a capped K step.
VARIANTS = {
    "v1": W4A16Config(16, 32, kernel="v1"),
    "v2-scale-after": W4A16Config(16, 32),
    "v2-scale-weight": W4A16Config(16, 32, scale_after=False),
    "v2-split-sum": W4A16Config(16, 16, split_k=3),
    "v2-split-atomic": W4A16Config(16, 16, split_k=3, reduce="atomic"),
    "v2-large": W4A16Config(64, 64, num_warps=8, num_stages=3, block_k=64, scale_after=False),
    "v2-bk16": W4A16Config(32, 16, block_k=16),
    "v2-swap": W4A16Config(16, 32, swap_ab=True),
    "v2-swap-scale-weight-split": W4A16Config(16, 64, split_k=2, scale_after=False, swap_ab=True),
    "v2-half": W4A16Config(16, 32, scale_after=False, unpack="half"),
    "v2-half-swap-split": W4A16Config(16, 64, split_k=2, scale_after=False, swap_ab=True, unpack="half"),
    "v2-half-large": W4A16Config(64, 64, 1, 8, 3, 64, scale_after=False, unpack="half"),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("bits,group,zeros", [(4, 32, True), (4, 128, False), (8, 64, True), (8, 32, False)])
def test_every_variant_matches_reference(variant, bits, group, zeros, dtype):
    m, n, k = 5, 40, 128
    qw, scale, zero = _weight(n, k, bits, group, zeros, seed=3)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(bits * group)).to(DEVICE, dtype)
    y = w4a16_gemm(x, qw, scale, zero, bits, group, config=VARIANTS[variant])
    ref = w4a16_gemm_ref(x, qw, scale, zero, bits, group)
    assert y.dtype == dtype and y.shape == (m, n)
    roundings = 4 if VARIANTS[variant].unpack == "half" else 3
    _assert_within_rounding(y, ref, x, qw, scale, zero, bits, group, roundings)


@pytest.mark.parametrize("dtype", DTYPES[1:])
@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("zeros", [True, False])
def test_half_unpack_is_exact_for_scales_in_x_dtype(zeros, swap, dtype):
    """With the scales already values of x's dtype (a checkpoint's fp16 / bf16 scales), the "half"
    unpack makes the reference's weights bit for bit: only the fp32 sums' order differs. On a GPU this
    runs the paired PTX instructions (FAST), in the interpreter the float32 path."""
    m, n, k, group = 20, 48, 256, 64
    qw, scale, zero = _weight(n, k, 4, group, zeros, seed=7)
    scale = scale.to(dtype).float()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(11)).to(DEVICE, dtype)
    cfg = W4A16Config(16, 32, split_k=1, scale_after=False, swap_ab=swap, unpack="half")
    y = w4a16_gemm(x, qw, scale, zero, 4, group, config=cfg).float()
    w = dequantize_int_weight_ref(qw, scale, zero, 4, group, dtype).float()
    ref = x.float() @ w.t()
    size = x.float().abs() @ w.abs().t()
    # the output's own rounding to x's dtype, plus the fp32 sums' order
    bound = (torch.finfo(dtype).eps / 2 + 16 * torch.finfo(torch.float32).eps / 2) * size
    assert ((y - ref).abs() <= bound).all()


def test_half_unpack_needs_the_scale_before_the_dot():
    with pytest.raises(ValueError, match="scale_after=False"):
        W4A16Config(16, 32, unpack="half")
    with pytest.raises(ValueError, match="unknown unpack"):
        W4A16Config(16, 32, scale_after=False, unpack="f16")
    from overnight.kernels.w4a16_moe import IntMoeTiles

    with pytest.raises(ValueError, match="scale_after=False"):
        IntMoeTiles(unpack="half")
    with pytest.raises(ValueError, match="unknown unpack"):
        IntMoeTiles(scale_after=False, unpack="f16")


@pytest.mark.parametrize("bound", [b for b, _ in gemm_module.TIERS])
def test_every_tier_matches_reference(bound):
    """Each tier's tile (the 128-row swapped one of the 128-row graph bucket too) on a few rows."""
    cfg = dict(gemm_module.TIERS)[bound]
    qw, scale, zero = _weight(40, 128, 4, 32, True, seed=5)
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(bound % 97)).to(DEVICE)
    y = w4a16_gemm(x, qw, scale, zero, 4, 32, config=cfg)
    _assert_within_rounding(y, w4a16_gemm_ref(x, qw, scale, zero, 4, 32), x, qw, scale, zero, 4, 32)


@pytest.mark.parametrize("kernel", ["v1", "v2"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits,group,zeros", [(4, 32, True), (4, 16, False), (8, 64, True)])
def test_dequantize_kernel_is_bit_exact(bits, group, zeros, dtype, kernel):
    qw, scale, zero = _weight(40, 128, bits, group, zeros)
    ours = dequantize_int_weight(qw, scale, zero, bits, group, dtype, kernel)
    assert torch.equal(ours, dequantize_int_weight_ref(qw, scale, zero, bits, group, dtype))


@pytest.mark.parametrize("mma_order", [False, True])
@pytest.mark.parametrize("k_major", [False, True])
def test_dequantize_program_order_is_bit_exact(k_major, mma_order, monkeypatch):
    """Either grid order (DEQUANT_K_MAJOR) writes every tile of the weight: 72 rows (a last tile of 8),
    K of two 128-column blocks, the words in column or MMA order."""
    monkeypatch.setattr(gemm_module, "DEQUANT_K_MAJOR", k_major)
    qw, scale, zero = _weight(72, 256, 4, 128, True, seed=3)
    ref = dequantize_int_weight_ref(qw, scale, zero, 4, 128, torch.float16)
    words = gemm_module.to_mma_order(qw) if mma_order else qw
    ours = dequantize_int_weight(words, scale, zero, 4, 128, torch.float16, mma_order=mma_order)
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("path,kernel", [("dequant", "v1"), ("dequant", "v2"), ("fused", "v2")])
def test_large_m_paths(path, kernel, monkeypatch):
    """From DEQUANT_GEMM_MIN_M rows the module's choice runs: dequantize + matmul, or the fused kernel
    with the large tiers' tiles; both equal the reference."""
    monkeypatch.setattr(gemm_module, "LARGE_M_PATH", path)
    monkeypatch.setattr(gemm_module, "DEQUANT_KERNEL", kernel)
    assert default_config(DEQUANT_GEMM_MIN_M).path == default_config(4096).path == path
    assert default_config(DEQUANT_GEMM_MIN_M - 1).path == "fused"
    monkeypatch.setattr(gemm_module, "DEQUANT_GEMM_MIN_M", 8)  # small shapes for the interpreter
    bits, group = 4, 32
    qw, scale, zero = _weight(24, 64, bits, group, True)
    x = torch.randn(9, 64, device=DEVICE)
    ref = w4a16_gemm_ref(x, qw, scale, zero, bits, group)
    torch.testing.assert_close(w4a16_linear(x, qw, scale, zero, bits, group), ref, atol=1e-3, rtol=1e-4)
    for _, cfg in gemm_module.TIERS[-2:]:  # the large tiles themselves
        torch.testing.assert_close(
            w4a16_linear(x, qw, scale, zero, bits, group, cfg), ref, atol=1e-3, rtol=1e-4
        )


def test_default_config_follows_the_module_choices(monkeypatch):
    assert [default_config(m) for m in (1, 16, 17, 64, 65, 127, 128, DEQUANT_GEMM_MIN_M - 1)] == [
        gemm_module.TIERS[i][1] for i in (0, 0, 1, 2, 3, 3, 3, 4)
    ]
    assert default_config(128).block_m == 128 and default_config(128).swap_ab
    assert default_config(65).unpack == "half" and default_config(64).unpack == "f32"
    assert default_config(1).kernel == "v2" and default_config(1).scale_after
    # From DEQUANT_GEMM_MIN_M rows on the module's large-M path: dequantize + cuBLAS (the H100's winner)
    assert {default_config(m).path for m in (DEQUANT_GEMM_MIN_M, 256, 512, 4096)} == {"dequant"}
    # words in MMA order keep the fused tiles to MMA_DEQUANT_GEMM_MIN_M - 1 rows (session Y)
    mma_min = gemm_module.MMA_DEQUANT_GEMM_MIN_M
    assert [default_config(m, mma_order=True) for m in (DEQUANT_GEMM_MIN_M, 256, 257, mma_min - 1)] == [
        gemm_module.TIERS[i][1] for i in (5, 5, 6, 6)
    ]
    assert default_config(256, mma_order=True).block_m == 256
    assert default_config(128, mma_order=True) == default_config(128)
    assert {default_config(m, mma_order=True).path for m in (mma_min, 512, 4096)} == {"dequant"}
    monkeypatch.setattr(gemm_module, "LARGE_M_PATH", "fused")
    assert [default_config(m) for m in (256, 385, 511, 512, 4096)] == [
        gemm_module.TIERS[i][1] for i in (5, 7, 7, 8, 8)
    ]
    monkeypatch.setattr(gemm_module, "KERNEL", "v1")
    assert default_config(16) == W4A16Config(16, 64, kernel="v1")
    assert default_config(4096).path == "dequant"
    monkeypatch.setattr(gemm_module, "KERNEL", "v2")
    monkeypatch.setattr(gemm_module, "TIERS", ((1 << 62, W4A16Config(16, 32, reduce="atomic")),))
    assert default_config(4).reduce == "atomic"
    with pytest.raises(ValueError, match="unknown kernel"):
        W4A16Config(16, 64, kernel="v3")
    with pytest.raises(ValueError, match="no atomic"):
        W4A16Config(16, 64, kernel="v1", reduce="atomic")
    with pytest.raises(ValueError, match="no swap_ab"):
        W4A16Config(16, 64, kernel="v1", swap_ab=True)
    with pytest.raises(ValueError, match="unknown path"):
        W4A16Config(16, 64, path="cublas")


def test_signed_codes_are_twos_complement():
    """signed=True reads 8-bit codes as int8 with no zero point (the W8A8 layers' small-M path)."""
    gen = torch.Generator().manual_seed(5)
    w = torch.randint(-128, 128, (24, 64), generator=gen, dtype=torch.int8).to(DEVICE)
    scale = (torch.rand(24, 1, generator=gen) * 0.01).to(DEVICE)
    x = torch.randn(3, 64, device=DEVICE)
    y = w4a16_gemm(x, w.view(torch.int32), scale, None, 8, 64, signed=True)
    torch.testing.assert_close(y, x @ (w.float() * scale).t(), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="signed"):
        w4a16_gemm(x, w.view(torch.int32), scale, scale, 8, 64, signed=True)


def test_wrapper_checks_shapes():
    qw, scale, zero = _weight(16, 64, 4, 32, True)
    x = torch.randn(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="does not divide"):
        w4a16_gemm(x, qw, scale, zero, 4, 48)
    with pytest.raises(ValueError, match="int32"):
        w4a16_gemm(torch.randn(2, 32, device=DEVICE), qw, scale, zero, 4, 32)
    with pytest.raises(ValueError, match="zero"):
        w4a16_gemm(x, qw, scale, zero[:, :1].contiguous(), 4, 32)


def test_mma_order_layout():
    """Word 4t + c of each 128-column block holds columns 32c + 16s + 8h + 2t + e as value 4s + 2h + e
    (the module's comment), read back from a weight whose two rows spell each column's index; the
    inverse restores the words."""
    k = 256
    cols = torch.arange(k)
    codes = torch.stack([cols % 16, (cols // 16) % 8 + 8 * (cols // 128)])  # row 1: the 16-column chunk
    qw = pack_along_last(codes, 4)
    mma = gemm_module.to_mma_order(qw)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    held = (mma[:, :, None] >> shifts) & 0xF  # [2, K/8 words, 8 values]
    column = held[1] % 8 * 16 + held[0] + 128 * (held[1] // 8)
    for word in range(k // 8):
        block, t, c = word // 16, word % 16 // 4, word % 4
        expected = [
            128 * block + 32 * c + 16 * s + 8 * h + 2 * t + e for s in (0, 1) for h in (0, 1) for e in (0, 1)
        ]
        assert column[word].tolist() == expected, word
    assert torch.equal(gemm_module.to_mma_order(mma, inverse=True), qw)


MMA_CONFIGS = {
    **{f"tier-{bound}": cfg for bound, cfg in gemm_module.TIERS},
    "half": W4A16Config(16, 32, scale_after=False, unpack="half"),
    "half-swap-split": W4A16Config(16, 64, split_k=2, scale_after=False, swap_ab=True, unpack="half"),
    "swap-scale-weight": W4A16Config(16, 32, scale_after=False, swap_ab=True),
    "atomic": W4A16Config(16, 16, split_k=2, reduce="atomic"),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(MMA_CONFIGS))
@pytest.mark.parametrize("group,zeros", [(128, True), (256, False)])
def test_mma_order_kernels_match_reference(name, group, zeros, dtype):
    """Every tier and unpack on words in MMA order equals the reference on the same weight in column
    order; the whole-weight dequantization is bit-exact."""
    m, n, k = 6, 40, 512
    qw, scale, zero = _weight(n, k, 4, group, zeros, seed=9)
    mma = gemm_module.to_mma_order(qw)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(group)).to(DEVICE, dtype)
    cfg = MMA_CONFIGS[name]
    y = w4a16_gemm(x, mma, scale, zero, 4, group, config=cfg, mma_order=True)
    ref = w4a16_gemm_ref(x, qw, scale, zero, 4, group)
    assert torch.equal(w4a16_gemm_ref(x, mma, scale, zero, 4, group, mma_order=True), ref)
    _assert_within_rounding(y, ref, x, qw, scale, zero, 4, group, 4 if cfg.unpack == "half" else 3)
    if name == "half":
        w = dequantize_int_weight(mma, scale, zero, 4, group, dtype, mma_order=True)
        assert torch.equal(w, dequantize_int_weight_ref(qw, scale, zero, 4, group, dtype))


def test_mma_order_needs_4_bit_codes_and_128_column_groups():
    qw, scale, zero = _weight(8, 256, 4, 64, True)
    x = torch.randn(2, 256).to(DEVICE)
    with pytest.raises(ValueError, match="MMA order needs"):
        w4a16_gemm(x, qw, scale, zero, 4, 64, mma_order=True)
    qw8, scale8, zero8 = _weight(8, 256, 8, 128, True)
    with pytest.raises(ValueError, match="MMA order needs"):
        dequantize_int_weight(qw8, scale8, zero8, 8, 128, torch.float32, mma_order=True)
    qw, scale, zero = _weight(8, 256, 4, 128, True)
    with pytest.raises(ValueError, match="v2 kernel"):
        w4a16_gemm(x, qw, scale, zero, 4, 128, config=W4A16Config(16, 32, kernel="v1"), mma_order=True)


@pytest.mark.parametrize("group", [128, 64])
def test_layer_in_mma_order_keeps_its_products(group, monkeypatch):
    """WeightOnlyIntLinear.use_mma_order_: the same forward and dequantized weight; a layer whose groups
    are not a multiple of 128 columns keeps the column order."""
    n, k = 24, 256
    qw, scale, zero = _weight(n, k, 4, group, True, seed=2)
    layer = WeightOnlyIntLinear(k, n, False, 4, group, False, False, torch.float32, DEVICE)
    for param, value in ((layer.packed_weight, qw), (layer.group_scale, scale), (layer.group_zero, zero)):
        assert param is not None
        param.data.copy_(value)
    x = torch.randn(3, k, device=DEVICE)
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", True)
    before, dense = layer(x), layer.dequantized_weight()
    layer.use_mma_order_()
    assert layer.mma_order == (group == 128)
    assert torch.equal(layer.packed_weight, gemm_module.to_mma_order(qw) if group == 128 else qw)
    assert torch.equal(layer.dequantized_weight(), dense)
    torch.testing.assert_close(layer(x), before, atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", False)  # the reference path reads the order too
    torch.testing.assert_close(layer(x), before, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bits", [4, 8])
def test_act_order_layer_with_kernels(bits, monkeypatch):
    """A layer built from a g_idx weight: columns sorted by group at load, the input gathered by the same
    permutation in forward; the kernel path equals the dense product of the checkpoint-order weight."""
    n, k, group = 24, 64, 16
    gen = torch.Generator().manual_seed(1)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[torch.randperm(k, generator=gen)] = (torch.arange(k) // group).int()
    w = IntWeight(
        q=torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.int32),
        zero=torch.randint(0, 1 << bits, (n, k // group), generator=gen, dtype=torch.int32),
        scale=(torch.rand(n, k // group, generator=gen) * 0.05).half(),
        g_idx=g_idx,
        group_size=group,
        bits=bits,
    )
    packed, scale, zero, perm = kernel_layout(w, "test")
    assert perm is not None
    layer = WeightOnlyIntLinear(k, n, False, bits, group, False, True, torch.float32, DEVICE)
    for param, value in ((layer.packed_weight, packed), (layer.group_scale, scale), (layer.group_zero, zero)):
        assert param is not None
        param.data.copy_(value)
    assert layer.input_perm is not None
    layer.input_perm.copy_(perm)
    dense = w.dequantize(torch.float32).to(DEVICE)
    assert torch.equal(layer.dequantized_weight(), dense)
    x = torch.randn(3, k, device=DEVICE)
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", True)
    torch.testing.assert_close(layer(x), x @ dense.t(), atol=1e-4, rtol=1e-4)


# -- MoE experts on packed weights (kernels/w4a16_moe.py) --------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "bits,groups,zeros,tokens",
    [(4, (32, 16), True, 5), (4, (64, 32), False, 1), (8, (32, 32), True, 9), (4, (64, 32), True, 33)],
)
def test_fused_experts_match_reference(bits, groups, zeros, tokens, dtype):
    """Gated gate/up GEMM with SiLU-and-mul, weighted down GEMM, sum over the top k; groups (gate_up,
    down) include one group per row of down (I = 32)."""
    from overnight.kernels.w4a16_moe import w4a16_fused_experts, w4a16_fused_experts_ref

    experts, hidden, inter, top_k = 8, 64, 32, 2

    def stack(n: int, k: int, group: int, seed: int):
        layers = [_weight(n, k, bits, group, zeros, seed=seed + e) for e in range(experts)]
        packed = torch.stack([w for w, _, _ in layers])
        scale = torch.stack([s for _, s, _ in layers]) * (32 / (1 << bits))  # outputs of order 1 in fp16
        zero = torch.stack([z for _, _, z in layers]) if zeros else None  # type: ignore[misc]
        return packed, scale, zero

    gate_up, down = stack(2 * inter, hidden, groups[0], 0), stack(hidden, inter, groups[1], 100)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    weights, ids = torch.topk(torch.randn(tokens, experts, generator=gen).softmax(-1), top_k)
    weights, ids = weights.to(DEVICE), ids.int().to(DEVICE)
    y = w4a16_fused_experts(x, gate_up, down, bits, groups, weights, ids)
    ref = w4a16_fused_experts_ref(x, gate_up, down, bits, groups, weights, ids)
    scale = ref.float().abs().max()
    torch.testing.assert_close(y.float() / scale, ref.float() / scale, atol=_tol(dtype), rtol=0)


def _moe_variants() -> dict:
    """Every tier, the first version, and the options the tiers leave out (swap_ab with the scale
    before and after the dot, grouped tile order at 16 rows, the "half" unpack), at tiles the tiny
    shapes exercise."""
    from overnight.kernels.w4a16_moe import TIERS, V1_CONFIG, IntMoeTiles, W4A16MoeConfig

    swap_after = IntMoeTiles(32, 64, 4, 4, 3, True, True)
    swap_before = IntMoeTiles(64, 32, 2, 4, 2, False, True)
    half_swap = IntMoeTiles(64, 32, 2, 4, 2, False, True, unpack="half")
    return {
        "v1": V1_CONFIG,
        **{f"tier-m{cfg.block_m}": cfg for _, cfg in TIERS},
        "swap-after-m16": W4A16MoeConfig(16, swap_after, swap_after),
        "swap-before-m64": W4A16MoeConfig(64, swap_before, swap_before),
        "before-grouped-m16": W4A16MoeConfig(16, IntMoeTiles(32, 32, 2, 4, 2, False), swap_before),
        "half-m64": W4A16MoeConfig(64, IntMoeTiles(32, 32, 2, 4, 2, False, unpack="half"), half_swap),
    }


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", list(_moe_variants()))
@pytest.mark.parametrize("zeros", [True, False])
def test_every_moe_variant_matches_reference(variant, zeros, dtype):
    """Each variant of the MoE GEMMs on one routing: 4 experts, 25 tokens x top-2 (runs of about 12 rows,
    so several tiles at 16 rows and padding at 64 and 128), an intermediate size (48) that no column tile
    divides, and down's group of 16 (K steps of 16)."""
    from overnight.kernels.w4a16_moe import w4a16_fused_experts, w4a16_fused_experts_ref

    experts, hidden, inter, top_k, tokens, bits, groups = 4, 64, 48, 2, 25, 4, (32, 16)

    def stack(n: int, k: int, group: int, seed: int):
        layers = [_weight(n, k, bits, group, zeros, seed=seed + e) for e in range(experts)]
        zero = torch.stack([z for _, _, z in layers]) if zeros else None  # type: ignore[misc]
        return torch.stack([w for w, _, _ in layers]), torch.stack([s for _, s, _ in layers]) * 2, zero

    gate_up, down = stack(2 * inter, hidden, groups[0], 0), stack(hidden, inter, groups[1], 50)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    weights, ids = torch.topk(torch.randn(tokens, experts, generator=gen).softmax(-1), top_k)
    weights, ids = weights.to(DEVICE), ids.int().to(DEVICE)
    cfg = _moe_variants()[variant]
    y = w4a16_fused_experts(x, gate_up, down, bits, groups, weights, ids, config=cfg)
    ref = w4a16_fused_experts_ref(x, gate_up, down, bits, groups, weights, ids)
    scale = ref.float().abs().max()
    assert y.dtype == dtype and y.shape == x.shape
    torch.testing.assert_close(y.float() / scale, ref.float() / scale, atol=_tol(dtype), rtol=0)


def test_moe_default_config_by_rows_per_expert(monkeypatch):
    from overnight.kernels import w4a16_moe
    from overnight.kernels.w4a16_moe import TIERS, V1_CONFIG, IntMoeTiles, W4A16MoeConfig, default_config

    # Qwen3-30B-A3B (128 experts, top-8): rows per expert = tokens / 16
    picked = [default_config(t, 8, 128).block_m for t in (1, 16, 128, 129, 384, 512, 1024, 1025, 4096)]
    assert picked == [16, 16, 16, 32, 32, 64, 64, 128, 128]
    assert default_config(4096, 8, 128) == TIERS[-1][1] and default_config(1, 8, 128).kernel == "v2"
    monkeypatch.setattr(w4a16_moe, "KERNEL", "v1")
    assert default_config(4096, 8, 128) == V1_CONFIG
    with pytest.raises(ValueError, match="unknown MoE int kernel"):
        W4A16MoeConfig(16, IntMoeTiles(), IntMoeTiles(), kernel="v3")
    with pytest.raises(ValueError, match="block_m must be"):
        W4A16MoeConfig(48, IntMoeTiles(), IntMoeTiles())


def test_moe_gemm_wrapper_checks_shapes():
    from overnight.kernels.moe_align import moe_align
    from overnight.kernels.w4a16_moe import w4a16_moe_gemm

    qw, scale, zero = _weight(32, 64, 4, 32, True)
    runs = moe_align(torch.zeros(2, 1, dtype=torch.int32, device=DEVICE), 1, 16)
    x = torch.randn(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="scale must be"):
        w4a16_moe_gemm(x, qw[None], scale[None, :, :1].contiguous(), None, 4, 32, runs)
    with pytest.raises(ValueError, match="does not divide"):
        w4a16_moe_gemm(x, qw[None], scale[None], zero[None], 4, 48, runs)


# -- per-token int8 activations (kernels/int8_quant.py), the W8A8 layers' input --------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,k", [(1, 64), (5, 96), (3, 1000)])
def test_int8_quantization_is_bit_exact(tokens, k, dtype):
    from overnight.kernels.int8_quant import quantize_int8, quantize_int8_ref

    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(tokens, k, generator=gen) * 3).to(DEVICE, dtype)
    x[0, :5] = torch.tensor([0.5, -0.5, 1.5, 2.5, -2.5]).to(x) * x[0].abs().max() / 127 * 2  # near ties
    codes, scale = quantize_int8(x)
    ref_codes, ref_scale = quantize_int8_ref(x)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(codes, ref_codes)
