"""The first W4A16 kernels (kernels/w4a16_gemm.py's variants "v1"), kept as the benchmark's baseline.

Measured on an H100 (bench/w4a16_gpu.py): ~190 GB/s of packed weight at small M, the dequantize kernel
~40 GB/s. Compiled for sm_90 on the CPU (tests/sm90.py, int arguments specialized as Triton does at
launch), the causes show in the PTX:
- _w4a16_kernel_v1 loads the words as a [BLOCK_K / P, BLOCK_N] tile whose contiguous dim (K) is the
  first: each thread's copy is 8 bytes (`cp.async.ca ... 0x8`, half the width, twice the count); the
  unpacked codes [BLOCK_K / P, P, BLOCK_N] are reshaped across threads, so the dequantized
  [BLOCK_K, BLOCK_N] tile goes to shared memory as 64 scalar 16-bit stores per thread per step
  (`st.shared.b16`) before the dot reads it back; and each weight element is multiplied by its scale
  (BLOCK_K * BLOCK_N fp32 multiplies per step, ALU work of the same order as the memory stream).
- split-K was chosen to reach 264 programs whatever the tile count (o and down at 64 tiles: 4-way
  split with a [4, M, N] fp32 buffer and a torch sum after it).
- _dequant_kernel_v1 computes one word address per output element: every word is loaded P times with
  scalar 32-bit loads (`ld.global.b32`, 96 per thread), and so are the scales and zero points: ~40 GB/s.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["M"])
def _w4a16_kernel_v1(
    x_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_om,
    stride_os,
    k_per_split,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    PER: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_m = tl.minimum(offs_m, M - 1)  # clamped reads, masked stores
    rows_n = tl.minimum(offs_n, N - 1)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_ptr + rows_m[:, None] * stride_xm + offs_k[None, :], mask=k_ok[None, :], other=0.0)
        # each int32 word read once: [BLOCK_K / PER, BLOCK_N] words -> [BLOCK_K / PER, PER, BLOCK_N]
        # codes -> [BLOCK_K, BLOCK_N] (row w * PER + j is value j of word w, as packed)
        offs_w = k0 // PER + tl.arange(0, BLOCK_K // PER)
        words = tl.load(
            qw_ptr + rows_n[None, :] * stride_qn + offs_w[:, None], mask=offs_w[:, None] < K // PER, other=0
        )
        shifts = tl.arange(0, PER) * BITS
        codes = tl.reshape((words[:, None, :] >> shifts[None, :, None]) & MASK, (BLOCK_K, BLOCK_N))
        g = k0 // GROUP
        scale = tl.load(s_ptr + rows_n * stride_sn + g)
        if HAS_ZERO:
            zero = tl.load(z_ptr + rows_n * stride_sn + g)
        else:
            zero = tl.full((BLOCK_N,), 1 << (BITS - 1), tl.float32)
        w = ((codes.to(tl.float32) - zero[None, :]) * scale[None, :]).to(x.dtype)
        acc += tl.dot(x, w, input_precision=DOT_PRECISION)
    out = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _dequant_kernel_v1(
    qw_ptr,
    s_ptr,
    z_ptr,
    w_ptr,
    N,
    K,
    stride_qn,
    stride_sn,
    stride_wn,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    PER: tl.constexpr = 32 // BITS
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    words = tl.load(qw_ptr + offs_n[:, None] * stride_qn + offs_k[None, :] // PER, mask=ok, other=0)
    codes = (words >> ((offs_k[None, :] % PER) * BITS)) & ((1 << BITS) - 1)
    g = offs_k[None, :] // GROUP
    scale = tl.load(s_ptr + offs_n[:, None] * stride_sn + g, mask=ok, other=0.0)
    if HAS_ZERO:
        zero = tl.load(z_ptr + offs_n[:, None] * stride_sn + g, mask=ok, other=0.0)
    else:
        zero = (1 << (BITS - 1)) * 1.0
    w = (codes.to(tl.float32) - zero) * scale
    tl.store(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], w.to(w_ptr.dtype.element_ty), mask=ok)
