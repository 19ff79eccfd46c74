"""Triton helpers of the integer-weight kernels (kernels/w4a16_gemm.py, kernels/w4a16_moe.py,
kernels/int8_gemm.py): packed codes to float32 values in registers, one K step of the weight-only dot,
and the split-K reduce. Jit functions called from a kernel are inlined by Triton: sharing them costs
nothing at run time."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _field(words, j: tl.constexpr, BITS: tl.constexpr, SIGNED: tl.constexpr, BIAS: tl.constexpr):
    """Value j of each word as float32, minus BIAS - 2^23 (exact): the code's bits are put under the
    exponent of 2^23, so the float is 2^23 + code, and one add removes it: two integer ops (a shift, a
    fused and-or) and a float add, where an int-to-float conversion runs at a quarter of their rate.
    BIAS 0 keeps the raw 2^23 + code (the caller subtracts 2^23 + zero point in one op). Signed (two's
    complement) codes are first moved to offset binary by flipping their top bit."""
    u = (words >> (j * BITS)) & ((1 << BITS) - 1)
    if SIGNED:
        u = u ^ (1 << (BITS - 1))
    if BIAS == 0:
        return (u | 0x4B000000).to(tl.float32, bitcast=True)
    return (u | 0x4B000000).to(tl.float32, bitcast=True) - BIAS


@triton.jit
def _unpack(words, BITS: tl.constexpr, SIGNED: tl.constexpr, CENTERED: tl.constexpr, RAW: tl.constexpr):
    """[R, W] words -> [R, W * P] float32 values, value j of word w at column w * P + j (the packed
    order): the codes, with CENTERED the codes minus 2^(BITS-1) (symmetric or signed codes), with RAW
    2^23 + the codes (_field's BIAS 0). Built
    by interleaving (a join on a new innermost dim and a reshape merging it): each thread keeps its own
    words' values in registers, with no shared-memory round trip a 3-D reshape would cost."""
    BIAS: tl.constexpr = 0.0 if RAW else 8388608.0 + ((1 << (BITS - 1)) if CENTERED else 0)
    if BITS == 4:
        even = tl.interleave(
            tl.interleave(_field(words, 0, BITS, SIGNED, BIAS), _field(words, 4, BITS, SIGNED, BIAS)),
            tl.interleave(_field(words, 2, BITS, SIGNED, BIAS), _field(words, 6, BITS, SIGNED, BIAS)),
        )
        odd = tl.interleave(
            tl.interleave(_field(words, 1, BITS, SIGNED, BIAS), _field(words, 5, BITS, SIGNED, BIAS)),
            tl.interleave(_field(words, 3, BITS, SIGNED, BIAS), _field(words, 7, BITS, SIGNED, BIAS)),
        )
    else:
        even = tl.interleave(_field(words, 0, BITS, SIGNED, BIAS), _field(words, 2, BITS, SIGNED, BIAS))
        odd = tl.interleave(_field(words, 1, BITS, SIGNED, BIAS), _field(words, 3, BITS, SIGNED, BIAS))
    return tl.interleave(even, odd)


@triton.jit
def _int_weight_step(
    acc,
    x,
    words,
    scale,
    zero,
    BITS: tl.constexpr,
    SIGNED: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    SCALE_AFTER: tl.constexpr,
    SWAP_AB: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """acc plus one K step of x [BM, BK] times the integer weight tile's transpose: words [BN, BK / P]
    (K contiguous), scale [BN] (one group covers the step), zero [BN] (read only with HAS_ZERO). acc is
    [BM, BN], or [BN, BM] with SWAP_AB (out^T = W x^T: the dequantized tile is the dot's first operand,
    which Hopper's wgmma reads from registers). SCALE_AFTER: the dot runs on (code - zero), small
    integers exact in x's dtype, and its fp32 product is scaled per weight row (BM * BN multiplies
    instead of BN * BK, but the accumulator is read back each step, so wgmma cannot chain); otherwise
    each weight is scaled and rounded to x's dtype first (the reference's rounding)."""
    if HAS_ZERO:  # 2^23 + code - (2^23 + zero): one subtraction, exact for integer zero points < 2^23
        vals = _unpack(words, BITS, SIGNED, False, True) - (zero + 8388608.0)[:, None]
    else:
        vals = _unpack(words, BITS, SIGNED, True, False)
    if SCALE_AFTER:
        w = vals.to(x.dtype)
        if SWAP_AB:
            acc += tl.dot(w, tl.trans(x), input_precision=DOT_PRECISION) * scale[:, None]
        else:
            acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION) * scale[None, :]
    else:
        w = (vals * scale[:, None]).to(x.dtype)
        if SWAP_AB:
            acc += tl.dot(w, tl.trans(x), input_precision=DOT_PRECISION)
        else:
            acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _sum_partials_kernel(part_ptr, out_ptr, numel, split, BLOCK: tl.constexpr):
    """out = sum over the split fp32 partial products [split, numel], in order, cast to out's dtype:
    the split-K reduce in one launch (torch's sum and cast are two)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    acc = tl.load(part_ptr + offs, mask=ok, other=0.0)
    for i in range(1, split):
        acc += tl.load(part_ptr + i * numel + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)
