"""Triton helpers of the integer-weight kernels (kernels/w4a16_gemm.py, kernels/int8_gemm.py): packed
codes to float32 values in registers, and the split-K reduce."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _field(words, j: tl.constexpr, BITS: tl.constexpr, SIGNED: tl.constexpr, BIAS: tl.constexpr):
    """Value j of each word as float32, minus BIAS - 2^23 (exact): the code's bits are put under the
    exponent of 2^23, so the float is 2^23 + code, and one add removes it: two integer ops (a shift, a
    fused and-or) and a float add, where an int-to-float conversion runs at a quarter of their rate.
    Signed (two's complement) codes are first moved to offset binary by flipping their top bit."""
    u = (words >> (j * BITS)) & ((1 << BITS) - 1)
    if SIGNED:
        u = u ^ (1 << (BITS - 1))
    return (u | 0x4B000000).to(tl.float32, bitcast=True) - BIAS


@triton.jit
def _unpack(words, BITS: tl.constexpr, SIGNED: tl.constexpr, CENTERED: tl.constexpr):
    """[R, W] words -> [R, W * P] float32 values, value j of word w at column w * P + j (the packed
    order): the codes, or with CENTERED the codes minus 2^(BITS-1) (symmetric or signed codes). Built
    by interleaving (a join on a new innermost dim and a reshape merging it): each thread keeps its own
    words' values in registers, with no shared-memory round trip a 3-D reshape would cost."""
    BIAS: tl.constexpr = 8388608.0 + ((1 << (BITS - 1)) if CENTERED else 0)
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
def _sum_partials_kernel(part_ptr, out_ptr, numel, split, BLOCK: tl.constexpr):
    """out = sum over the split fp32 partial products [split, numel], in order, cast to out's dtype:
    the split-K reduce in one launch (torch's sum and cast are two)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    acc = tl.load(part_ptr + offs, mask=ok, other=0.0)
    for i in range(1, split):
        acc += tl.load(part_ptr + i * numel + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)
