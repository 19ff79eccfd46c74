"""The grouped expert GEMMs with per-expert biases and gpt-oss's clamped SwiGLU, against their PyTorch
references (moe_gemm_ref, and the layer's CPU path fused_experts_ref). Triton interpreter on the CPU."""

from __future__ import annotations

import pytest
import torch

from overnight.kernels.fused_moe import fused_experts
from overnight.kernels.moe_align import moe_align
from overnight.kernels.moe_configs import MoeConfig
from overnight.kernels.moe_gemm import MXFP4_DECODES, GemmTiles, moe_gemm, moe_gemm_ref
from overnight.layers.moe import ExpertActivation, fused_experts_ref, router_topk_ref
from tests.test_kernels_moe import DEVICE, SMALL, assert_close, experts_weights, randn, random_ids

pytestmark = pytest.mark.slow  # Triton-interpreter runs

OAI = ("swiglu_oai", 1.702, 7.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gated_gemm_with_bias_and_clamped_swiglu(dtype):
    num_tokens, top_k, num_experts, hidden, inter = 9, 2, 5, 32, 24
    x = randn(num_tokens, hidden, seed=1, dtype=dtype)
    w13, w2 = experts_weights(num_experts, inter, hidden, dtype, seed=2)
    # Large pre-activations, so the clamps at +-limit really cut.
    w13 = w13 * 40
    b13 = randn(num_experts, 2 * inter, seed=3, scale=3.0, dtype=dtype)
    b2 = randn(num_experts, hidden, seed=4, dtype=dtype)
    ids = random_ids(num_tokens, top_k, num_experts, seed=5)
    weights = torch.rand(num_tokens, top_k, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    runs = moe_align(ids, num_experts, 16)
    h = moe_gemm(x, w13, runs, SMALL, gated=True, bias=b13, activation=OAI)
    ref_h = moe_gemm_ref(x, w13, ids, gated=True, bias=b13, activation=OAI)
    assert float(ref_h.float().abs().max()) > 7.0  # the limit was reached somewhere
    assert_close(h, ref_h)
    y = moe_gemm(h, w2, runs, SMALL, topk_weights=weights, bias=b2)
    assert_close(y, moe_gemm_ref(h, w2, ids, topk_weights=weights, bias=b2))
    with pytest.raises(ValueError, match="bias must be"):
        moe_gemm(x, w13, runs, SMALL, gated=True, bias=b13[:, :-1])
    with pytest.raises(ValueError, match="unknown activation"):
        moe_gemm(x, w13, runs, SMALL, gated=True, activation=("gelu", 0.0, 0.0))


def test_fused_layer_with_biases_matches_the_layer_reference():
    num_tokens, num_experts, top_k, hidden, inter = 13, 6, 3, 32, 16
    x = randn(num_tokens, hidden, seed=10)
    w13, w2 = experts_weights(num_experts, inter, hidden, torch.float32, seed=11)
    w13 = w13 * 20
    b13 = randn(num_experts, 2 * inter, seed=12)
    b2 = randn(num_experts, hidden, seed=13)
    weights, ids = router_topk_ref(randn(num_tokens, num_experts, seed=14), top_k, renormalize=True)
    config = MoeConfig(16, SMALL, GemmTiles(16, 16, 1, 4, 2))
    act = ExpertActivation("swiglu_oai", 1.702, 7.0)
    out = fused_experts(x, w13, w2, weights, ids, config, gate_up_bias=b13, down_bias=b2, activation=OAI)
    ref = fused_experts_ref(x, w13, w2, weights, ids, gate_up_bias=b13, down_bias=b2, activation=act)
    assert_close(out, ref)


def _mxfp4(e: int, rows: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 experts: every code, scales around 2^0."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randint(0, 256, (e, rows, k // 2), generator=gen, dtype=torch.uint8)
    s = torch.randint(122, 130, (e, rows, k // 32), generator=gen, dtype=torch.uint8)
    return w.to(DEVICE), s.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hidden", [64, 96, 128])  # 96: K not a multiple of the 64-wide tile
@pytest.mark.parametrize("decode", MXFP4_DECODES)
def test_mxfp4_gemms_match_reference(dtype, hidden, decode):
    """The kernel decodes the nibbles and scales in registers (either decoding); the reference decodes
    the whole tensor."""
    from overnight.kernels.moe_gemm import mxfp4_to_float
    from overnight.quant.mxfp4 import dequantize_mxfp4

    num_tokens, top_k, num_experts, inter = 7, 2, 4, 32
    # 128: 128-deep steps (fp16; fp32 operands take 32: fit_operand_size)
    tiles = GemmTiles(block_n=16, block_k=128 if hidden == 128 else 64, group_m=2, num_warps=4, num_stages=2)
    x = randn(num_tokens, hidden, seed=40, scale=0.1, dtype=dtype)
    w13, s13 = _mxfp4(num_experts, 2 * inter, hidden, seed=41)
    w2, s2 = _mxfp4(num_experts, hidden, inter, seed=42)
    # The kernels' decoder and the loader's agree to the bit.
    blocks = w13.cpu().unflatten(-1, (-1, 16))
    assert torch.equal(
        mxfp4_to_float(w13.cpu(), s13.cpu()), dequantize_mxfp4(blocks, s13.cpu(), torch.float32)
    )
    ids = random_ids(num_tokens, top_k, num_experts, seed=43)
    weights = torch.rand(num_tokens, top_k, generator=torch.Generator().manual_seed(44)).to(DEVICE)
    b13 = randn(num_experts, 2 * inter, seed=45, dtype=dtype)
    runs = moe_align(ids, num_experts, 16)
    h = moe_gemm(x, w13, runs, tiles, gated=True, w_scale=s13, bias=b13, activation=OAI, mxfp4_decode=decode)
    assert_close(h, moe_gemm_ref(x, w13, ids, gated=True, w_scale=s13, bias=b13, activation=OAI))
    small = GemmTiles(16, 32, 2, 4, 2)
    y = moe_gemm(h, w2, runs, small, topk_weights=weights, w_scale=s2, mxfp4_decode=decode)
    assert_close(y, moe_gemm_ref(h, w2, ids, topk_weights=weights, w_scale=s2))
    with pytest.raises(ValueError, match="MXFP4: w_scale"):
        moe_gemm(x, w13, runs, tiles, gated=True, w_scale=s13[..., :-1])
    with pytest.raises(ValueError, match="multiples of 32"):
        moe_gemm(x, w13, runs, GemmTiles(16, 16, 2, 4, 2), gated=True, w_scale=s13)
    with pytest.raises(ValueError, match="unknown MXFP4 decode"):
        moe_gemm(x, w13, runs, tiles, gated=True, w_scale=s13, mxfp4_decode="lut")


@pytest.mark.parametrize("decode", MXFP4_DECODES)
def test_mxfp4_every_code_at_extreme_scales(decode):
    """One-hot rows of x pick single weights: every e2m1 code (both nibbles of every byte value) at scales
    from 2^-100 to 2^100, decoded exactly (fp32, one product a weight)."""
    k, rows = 32, 256  # row r: byte r in every position, so both nibbles take every code
    w = torch.arange(256, dtype=torch.uint8)[:, None].expand(rows, k // 2).contiguous()[None]
    s = torch.linspace(27, 227, rows).round().to(torch.uint8)[None, :, None]  # 2^-100 .. 2^100
    x = torch.eye(k, dtype=torch.float32)
    ids = torch.zeros(k, 1, dtype=torch.int32)
    runs = moe_align(ids.to(DEVICE), 1, 16)
    one = torch.ones(k, 1, device=DEVICE)
    tiles = GemmTiles(block_n=16, block_k=32, group_m=1, num_warps=4, num_stages=2)
    args = (x.to(DEVICE), w.to(DEVICE), runs, tiles)
    out = moe_gemm(*args, topk_weights=one, w_scale=s.to(DEVICE), mxfp4_decode=decode)
    assert torch.equal(out.cpu(), moe_gemm_ref(x, w, ids, topk_weights=one.cpu(), w_scale=s))
