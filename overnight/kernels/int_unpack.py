"""Triton helpers of the integer-weight kernels (kernels/w4a16_gemm.py, kernels/w4a16_moe.py,
kernels/int8_gemm.py): packed codes to float32 values in registers, one K step of the weight-only dot,
and the split-K reduce. Jit functions called from a kernel are inlined by Triton: sharing them costs
nothing at run time."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def check_unpack(unpack: str, scale_after: bool) -> None:
    """The `unpack` option of W4A16Config and IntMoeTiles: "f32" or "half" (_unpack_scaled below)."""
    if unpack not in ("f32", "half"):
        raise ValueError(f"unknown unpack {unpack!r}: 'f32' or 'half'")
    if unpack == "half" and scale_after:
        raise ValueError("unpack 'half' scales the weights before the dot: needs scale_after=False")


def fast_half(unpack: str, bits: int, signed: bool, dtype: torch.dtype) -> bool:
    """Whether the half unpack takes its paired instructions: they are PTX (compiled code only, not
    the interpreter) for 4-bit unsigned codes and 16-bit activations; otherwise it computes the same
    values from the float32 unpack."""
    if unpack != "half" or bits != 4 or signed or dtype not in (torch.float16, torch.bfloat16):
        return False
    return not triton.knobs.runtime.interpret


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


# The fast dequantization to 16-bit values ("half" unpack), on the GPU for 4-bit codes. Per word, one
# shift and per pair of neighbouring codes one byte permute and one and-or put codes 2i and 2i+1 under
# the exponent of a 16-bit float (MAGIC: 128 in bf16, 1024 in fp16, whose last mantissa bits then hold
# the code), so the register holds (MAGIC + code) for both halves; two paired multiply-adds leave
# (code - zero) * scale. Two integer and two float instructions per two values, where the float32 path
# (_unpack, then a conversion) takes about six a value.
_HALF_ASM = """{
    .reg .b32 t, a, b, c, d, one, nz;
    mov.b32 one, ONE;
    mov.b32 nz, NEG0;
    shr.u32 t, $4, 4;
    prmt.b32 a, $4, t, 0x0400; prmt.b32 b, $4, t, 0x0501;
    prmt.b32 c, $4, t, 0x0602; prmt.b32 d, $4, t, 0x0703;
    lop3.b32 a, a, 0x000F000F, MAGIC, 0xea; lop3.b32 b, b, 0x000F000F, MAGIC, 0xea;
    lop3.b32 c, c, 0x000F000F, MAGIC, 0xea; lop3.b32 d, d, 0x000F000F, MAGIC, 0xea;
    fma.rn.T a, a, one, $5; fma.rn.T b, b, one, $5; fma.rn.T c, c, one, $5; fma.rn.T d, d, one, $5;
    fma.rn.T $0, a, $6, nz; fma.rn.T $1, b, $6, nz; fma.rn.T $2, c, $6, nz; fma.rn.T $3, d, $6, nz;
}"""
# MAGIC, 1.0 and -0.0 (the product's addend) paired, by dtype; the paired instructions exist from sm_80
_BF16_ASM: tl.constexpr = tl.constexpr(
    _HALF_ASM.replace("MAGIC", "0x43004300").replace("ONE", "0x3F803F80")
    .replace("NEG0", "0x80008000").replace(".T ", ".bf16x2 ")
)  # fmt: skip
_FP16_ASM: tl.constexpr = tl.constexpr(
    _HALF_ASM.replace("MAGIC", "0x64006400").replace("ONE", "0x3C003C00")
    .replace("NEG0", "0x80008000").replace(".T ", ".f16x2 ")
)  # fmt: skip


@triton.jit
def _paired(v, DT: tl.constexpr):
    """[R] float32 -> [R] int32: the value rounded to DT (16 bits) in both halves of a word."""
    h = v.to(DT).to(tl.uint16, bitcast=True).to(tl.uint32)
    return (h | (h << 16)).to(tl.int32, bitcast=True)


@triton.jit
def _unpack_scaled(words, scale, zero, BITS: tl.constexpr, SIGNED: tl.constexpr, HAS_ZERO: tl.constexpr,
                   DT: tl.constexpr, FAST: tl.constexpr):  # fmt: skip
    """[R, W] int32 words -> [R, W * P] values in DT (the packed order, as _unpack): (code - zero) *
    scale, the scale [R] first rounded to DT, then the exact difference times it rounded once. Equal
    to the reference's weight when the scale is a DT value (a checkpoint's fp16 / bf16 scales in its
    own dtype); otherwise the scale's rounding is the difference (as in other 16-bit int4 kernels).
    FAST (4-bit unsigned codes, fp16 / bf16, compiled for the GPU): the paired instructions above, the
    pairs then interleaved into the packed order; else the float32 path, rounded the same way (how the
    interpreter runs it: the same results)."""
    if FAST:
        BIAS: tl.constexpr = 128.0 if DT == tl.bfloat16 else 1024.0
        if HAS_ZERO:
            neg = _paired(-(zero + BIAS), DT)
        else:
            neg = _paired(tl.full(scale.shape, -(BIAS + 8.0), tl.float32), DT)
        neg = tl.broadcast_to(neg[:, None], words.shape)
        s2 = tl.broadcast_to(_paired(scale, DT)[:, None], words.shape)
        if DT == tl.bfloat16:
            p0, p1, p2, p3 = tl.inline_asm_elementwise(
                _BF16_ASM, "=r,=r,=r,=r,r,r,r", [words, neg, s2], dtype=(tl.int32,) * 4, is_pure=True, pack=1
            )
        else:
            p0, p1, p2, p3 = tl.inline_asm_elementwise(
                _FP16_ASM, "=r,=r,=r,=r,r,r,r", [words, neg, s2], dtype=(tl.int32,) * 4, is_pure=True, pack=1
            )
        # pair i of word w holds values 2i and 2i+1: pairs in order, then each split into its halves
        q = tl.interleave(tl.interleave(p0, p2), tl.interleave(p1, p3)).to(tl.uint32, bitcast=True)
        lo = (q & 0xFFFF).to(tl.uint16).to(DT, bitcast=True)
        hi = (q >> 16).to(tl.uint16).to(DT, bitcast=True)
        return tl.interleave(lo, hi)
    else:
        if HAS_ZERO:
            vals = _unpack(words, BITS, SIGNED, zero[:, None])
        else:
            vals = _unpack(words, BITS, SIGNED, (1 << (BITS - 1)) * 1.0)
        return vals.to(DT) * scale.to(DT)[:, None]


@triton.jit
def _from_mma_order(t, R: tl.constexpr, C: tl.constexpr):
    """[R, C] values unpacked from words in MMA order (kernels/w4a16_gemm.py's to_mma_order: within each
    128-column block, position 8w + j, w = 4t + c and j = 4s + 2h + e, holds column 32c + 16s + 8h + 2t +
    e) -> columns in natural order. A reshape and a permute: the compiler relabels the registers, so a
    swapped tile's weights come out in the wgmma register operand's layout as they stand (each thread's
    word holds the eight values it needs there)."""
    t = tl.reshape(t, (R, C // 128, 4, 4, 2, 2, 2))  # [R, block, t, c, s, h, e]
    t = tl.permute(t, (0, 1, 3, 4, 5, 2, 6))  # [R, block, c, s, h, t, e]
    return tl.reshape(t, (R, C))


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
    HALF: tl.constexpr = False,
    FAST: tl.constexpr = False,
    MMA_ORDER: tl.constexpr = False,
):
    """acc plus one K step of x [BM, BK] times the integer weight tile's transpose: words [BN, BK / P]
    (K contiguous), scale [BN] (one group covers the step), zero [BN] (read only with HAS_ZERO). acc is
    [BM, BN], or [BN, BM] with SWAP_AB (out^T = W x^T: the dequantized tile is the dot's first operand,
    which Hopper's wgmma reads from registers). SCALE_AFTER: the dot runs on (code - zero), small
    integers exact in x's dtype, and its fp32 product is scaled per weight row (BM * BN multiplies
    instead of BN * BK, but the accumulator is read back each step, so wgmma cannot chain); otherwise
    each weight is scaled and rounded to x's dtype first (the reference's rounding). HALF (SCALE_AFTER
    off): the weights made by _unpack_scaled (above; FAST: its paired PTX instructions). MMA_ORDER: the
    words are in MMA order (_from_mma_order; BK a multiple of 128)."""
    R: tl.constexpr = words.shape[0]
    C: tl.constexpr = x.shape[1]
    if HALF:
        w = _unpack_scaled(words, scale, zero, BITS, SIGNED, HAS_ZERO, x.dtype, FAST)
        if MMA_ORDER:
            w = _from_mma_order(w, R, C)
        if SWAP_AB:
            acc = tl.dot(w, tl.trans(x), acc, input_precision=DOT_PRECISION)
        else:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    else:  # if / else, not an early return: Triton traces what follows a constexpr branch's return
        if HAS_ZERO:
            vals = _unpack(words, BITS, SIGNED, zero[:, None])
        else:  # symmetric (or signed, moved to offset binary) codes: centred on 2^(BITS-1)
            vals = _unpack(words, BITS, SIGNED, (1 << (BITS - 1)) * 1.0)
        if MMA_ORDER:
            vals = _from_mma_order(vals, R, C)
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
