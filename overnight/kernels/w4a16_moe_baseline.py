"""The first W4A16 MoE grouped GEMM (kernels/w4a16_moe.py's kernel "v1"), kept as the benchmark's baseline.

Measured on an H100 (bench/w4a16_gpu.py, Qwen3-30B-A3B experts, int4 groups of 128): 1.04-1.32x the bf16
fused MoE up to 128 tokens, 0.57x at 512. It was always launched with BLOCK_M = 16, BLOCK_N = 64,
BLOCK_K = 128, 4 warps, 3 stages. Compiled for sm_90 on the CPU (tests/sm90.py; per thread, gated):

    BLOCK_M   shared   regs  stack  cvt.f32.u32  st.shared.b16  MMA
    16        42 KB    168   0      128          128            mma.sync (32)
    64        82 KB    204   0      128          128            wgmma (16)
    128       130 KB   255   8      128          128            wgmma (32), spills

- Each step's [BLOCK_K / P, BLOCK_N] words come with 16-byte copies (their K offsets start at 0 and
  step by BLOCK_K, so Triton proves the alignment), but the unpacked codes [BLOCK_K / P, P, BLOCK_N]
  are reshaped across threads: the dequantized tile goes to shared memory as 64 scalar 16-bit stores
  per thread per tile (`st.shared.b16`, 128 a step gated) before the dot reads it back.
- Every code is converted by `cvt.rn.f32.u32` (a quarter of the integer/float ALU rate), then the
  zero point subtracted and the scale multiplied: BLOCK_K * BLOCK_N of each per tile and step.
- BLOCK_M = 16 (the caller's fixed alignment) makes all of that per 16 rows: an expert with 256 rows
  (4096 tokens x top-8 / 128 experts) dequantizes each of its weight tiles 16 times, and the tiles run
  mma.sync m16n8k16, not wgmma. The dequantization's ALU work, not the 4-bit stream, bounds the
  kernel once experts get more than a few rows: where the bf16 kernel turns compute-bound at large
  tiles, this one stays ALU-bound at small ones.
- Programs sweep all N tiles of one row tile before the next (no grouping): the expert's weight tile
  is re-read from L2 or DRAM by each of its row tiles.

In SASS (cuobjdump of the same cubin) a gated K step of 16 rows issues 1,032 instructions a thread for
its 128 weights: 128 I2FP (the conversions, 1/8 of the FP32 rate), 128 STS (scalar shared stores), 130
SHF + 129 LOP3, 128 FADD + 128 FMUL. Calibration: at that rate, 16 tokens (82 experts, one 16-row tile
each) dequantize for ~200 us against the bf16 kernel's ~260 us stream, 1.3x, and 512 tokens (about 2.5
tiles an expert) ~770 us, 0.57x: what was measured.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_pairs", "num_tiles_m"])
def _w4a16_moe_kernel_v1(
    a_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    out_ptr,
    topk_weights_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_padded_ptr,
    N,
    K,
    num_pairs,
    num_tiles_m,
    stride_am,
    stride_qe,
    stride_qn,
    stride_se,
    stride_sn,
    stride_om,
    up_offset_rows,
    A_DIV: tl.constexpr,
    GATED: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    PER: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    pid = tl.program_id(0)
    num_tiles_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_tiles_n
    pid_n = pid % num_tiles_n
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = pair < num_pairs
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_n = tl.minimum(offs_n, N - 1).to(tl.int64)
    a_rows = (pair // A_DIV).to(tl.int64)
    shifts = tl.arange(0, PER) * BITS
    q_base = qw_ptr + expert * stride_qe + rows_n[None, :] * stride_qn
    s_base = s_ptr + expert * stride_se + rows_n * stride_sn
    z_base = z_ptr + expert * stride_se + rows_n * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :], mask=row_mask[:, None], other=0.0)
        offs_w = k0 // PER + tl.arange(0, BLOCK_K // PER)
        g = k0 // GROUP
        words = tl.load(q_base + offs_w[:, None])
        codes = tl.reshape((words[:, None, :] >> shifts[None, :, None]) & MASK, (BLOCK_K, BLOCK_N))
        scale = tl.load(s_base + g)
        if HAS_ZERO:
            zero = tl.load(z_base + g)
        else:
            zero = tl.full((BLOCK_N,), 1 << (BITS - 1), tl.float32)
        w = ((codes.to(tl.float32) - zero[None, :]) * scale[None, :]).to(a.dtype)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
        if GATED:
            up_words = tl.load(q_base + up_offset_rows * stride_qn + offs_w[:, None])
            up_codes = tl.reshape((up_words[:, None, :] >> shifts[None, :, None]) & MASK, (BLOCK_K, BLOCK_N))
            up_scale = tl.load(s_base + up_offset_rows * stride_sn + g)
            if HAS_ZERO:
                up_zero = tl.load(z_base + up_offset_rows * stride_sn + g)
            else:
                up_zero = tl.full((BLOCK_N,), 1 << (BITS - 1), tl.float32)
            up = ((up_codes.to(tl.float32) - up_zero[None, :]) * up_scale[None, :]).to(a.dtype)
            acc_up += tl.dot(a, up, input_precision=DOT_PRECISION)
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_WEIGHT:
        acc = acc * tl.load(topk_weights_ptr + pair, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & (offs_n[None, :] < N))
