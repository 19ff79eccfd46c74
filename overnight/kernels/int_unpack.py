"""Triton helpers of the integer-weight kernels (kernels/w4a16_gemm.py, kernels/w4a16_moe.py,
kernels/int8_gemm.py): packed codes to float32 values in registers, one K step of the weight-only dot,
and the split-K reduce. Jit functions called from a kernel are inlined by Triton: sharing them costs
nothing at run time."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _field(words, high, j: tl.constexpr, BITS: tl.constexpr, offset):
    """Value j of each word minus `offset` (a float, or per row [R, 1]), as exact float32. The field is
    masked where it lies, in the word's low half (`words`) or its high half (`high`, the word shifted
    right by 16 once), and put under the exponent of 2^23 by the same fused and-or: the float is
    2^23 + code * 2^S, S the field's shift within its half (S + BITS <= 16, inside the mantissa). One
    fused multiply-add by 2^-S with -(2^(23-S) + offset) leaves code - offset: one integer op and one
    float op a value, where a shift, an and, an or and an int-to-float conversion (a quarter of the
    ALU rate) would be four, the integer ones at half the float rate on Hopper. Exact when the offset
    is an integer (zero points are codes)."""
    HALF: tl.constexpr = 16 // BITS
    S: tl.constexpr = (j % HALF) * BITS
    KEEP: tl.constexpr = 0x4B000000 | (((1 << BITS) - 1) << S)
    if j < HALF:
        raw = words & KEEP
    else:
        raw = high & KEEP
    return raw.to(tl.float32, bitcast=True) * (1.0 / (1 << S)) - ((8388608.0 / (1 << S)) + offset)


@triton.jit
def _unpack(words, BITS: tl.constexpr, SIGNED: tl.constexpr, offset):
    """[R, W] int32 words -> [R, W * P] float32 values, value j of word w at column w * P + j (the
    packed order): the codes minus `offset` (a float: 2^(BITS-1) for symmetric or signed codes; or
    zero points [R, 1]). Signed (two's complement) codes are first moved to offset binary by flipping
    each field's top bit, one xor a word. Built by interleaving (a join on a new innermost dim and a
    reshape merging it): each thread keeps its own words' values in registers, with no shared-memory
    round trip a 3-D reshape would cost."""
    u = words.to(tl.uint32, bitcast=True)
    if SIGNED:
        u = u ^ (0x88888888 if BITS == 4 else 0x80808080)
    high = (u >> 16) | 0x4B000000
    u = (u & 0xFFFF) | 0x4B000000
    if BITS == 4:
        even = tl.interleave(
            tl.interleave(_field(u, high, 0, BITS, offset), _field(u, high, 4, BITS, offset)),
            tl.interleave(_field(u, high, 2, BITS, offset), _field(u, high, 6, BITS, offset)),
        )
        odd = tl.interleave(
            tl.interleave(_field(u, high, 1, BITS, offset), _field(u, high, 5, BITS, offset)),
            tl.interleave(_field(u, high, 3, BITS, offset), _field(u, high, 7, BITS, offset)),
        )
    else:
        even = tl.interleave(_field(u, high, 0, BITS, offset), _field(u, high, 2, BITS, offset))
        odd = tl.interleave(_field(u, high, 1, BITS, offset), _field(u, high, 3, BITS, offset))
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
    if HAS_ZERO:
        vals = _unpack(words, BITS, SIGNED, zero[:, None])
    else:  # symmetric (or signed, moved to offset binary) codes: centred on 2^(BITS-1)
        vals = _unpack(words, BITS, SIGNED, (1 << (BITS - 1)) * 1.0)
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
