"""Weight-only integer GEMM (W4A16 / W8A16): y = x @ dequant(W)^T, the weight dequantized in the kernel.

Reference: w4a16_gemm_ref below. Layout (made once at load, quant/int_formats.kernel_layout):

    x      [M, K] fp16/bf16/fp32, rows contiguous     activations, columns already in group order
    qw     [N, K / P] int32 (P = 32 / BITS)            row n's codes, value j of a word at bits j*BITS
    scale  [N, K / G] float32                          one per output row and group of G columns
    zero   [N, K / G] float32                          zero points (codes), or none: 2^(BITS-1)

    W[n, k] = (code(n, k) - zero[n, k // G]) * scale[n, k // G], rounded to x's dtype, then a tensor-
    core dot with fp32 accumulation: the product the dequantized model's matmul makes.

Why this shape: at decode batch sizes the GEMM is a stream over the weight, so the kernel's worth is in
reading 4 bits per weight instead of 16. A program owns BLOCK_N output rows and one SPLIT_K share of K
and walks it BLOCK_K columns at a time (BLOCK_K divides G, so each step has one scale per row). When
M is small the (M, N) tiles are too few to fill the GPU, so K is split across programs that write fp32
partial sums [SPLIT_K, M, N], summed afterwards (a second small read; no atomics, so results do not
depend on scheduling). Large M (prefill) is compute-bound and the weight is read once per 64-row tile
either way: w4a16_linear dequantizes the whole weight into the compute dtype (one kernel) and lets
cuBLAS run the GEMM past DEQUANT_GEMM_MIN_M rows (plain AWQ in vLLM switches at 256 too).

Launches depend only on shapes: safe to capture in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

DEQUANT_GEMM_MIN_M = 256  # from this many rows on: dequantize + cuBLAS
_TARGET_PROGRAMS = 264  # ~2 waves on an H100/H200's 132 SMs


@dataclass(frozen=True)
class W4A16Config:
    """Tiles of the fused kernel; split_k 0: chosen from the shape (_TARGET_PROGRAMS)."""

    block_m: int
    block_n: int
    split_k: int = 0
    num_warps: int = 4
    num_stages: int = 4


def default_config(m: int) -> W4A16Config:
    """Untuned on the GPU so far (bench/w4a16_gpu.py sweeps the alternatives)."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    return W4A16Config(block_m=block_m, block_n=64 if m <= 64 else 128)


@triton.jit(do_not_specialize=["M"])
def _w4a16_kernel(
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
def _dequant_kernel(
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


def _check(
    qw: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int, group: int, k: int
) -> None:
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    n = qw.shape[0]
    if qw.dtype != torch.int32 or qw.dim() != 2 or qw.shape[1] * (32 // bits) != k or qw.stride(1) != 1:
        raise ValueError(
            f"qw must be int32 [N, K*{bits}/32] with contiguous rows, got {qw.dtype} {list(qw.shape)}"
        )
    if group <= 0 or k % group:
        raise ValueError(f"group size {group} does not divide K={k}")
    groups = (n, k // group)
    if scale.dtype != torch.float32 or tuple(scale.shape) != groups or scale.stride(1) != 1:
        raise ValueError(f"scale must be float32 {list(groups)}, got {scale.dtype} {list(scale.shape)}")
    if zero is not None and (
        zero.dtype != torch.float32 or zero.shape != scale.shape or zero.stride() != scale.stride()
    ):
        raise ValueError(f"zero must be float32 {list(groups)} laid out as scale, got {list(zero.shape)}")


def _block_k(group: int) -> int:
    for bk in (128, 64, 32, 16):
        if group % bk == 0:
            return bk
    raise ValueError(f"group size {group} is not a multiple of 16")


def w4a16_gemm(
    x: torch.Tensor,
    qw: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bits: int,
    group: int,
    split_k: int | None = None,
    config: W4A16Config | None = None,
) -> torch.Tensor:
    """x [M, K] @ dequant(qw)^T -> [M, N] in x's dtype (see the module docstring); split_k: None picks
    (or config.split_k when set)."""
    m, k = x.shape
    n = qw.shape[0]
    _check(qw, scale, zero, bits, group, k)
    if x.stride(1) != 1:
        x = x.contiguous()
    cfg = config or default_config(m)
    block_k = _block_k(group)
    block_m, block_n = cfg.block_m, cfg.block_n
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    steps = triton.cdiv(k, block_k)
    if split_k is None:
        split_k = cfg.split_k or max(1, min(steps, _TARGET_PROGRAMS // tiles, 16))
    per_split = triton.cdiv(steps, split_k) * block_k
    split_k = triton.cdiv(k, per_split)
    if split_k == 1:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        stride_os = 0
    else:
        out = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
        stride_os = out.stride(0)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split_k)
    _w4a16_kernel[grid](
        x,
        qw,
        scale,
        zero if zero is not None else scale,
        out,
        m,
        n,
        k,
        x.stride(0),
        qw.stride(0),
        scale.stride(0),
        out.stride(-2),
        stride_os,
        per_split,
        BITS=bits,
        GROUP=group,
        HAS_ZERO=zero is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        # fp32 models get fp32 products (torch's default for fp32 matmuls), not TF32
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out if split_k == 1 else out.sum(0).to(x.dtype)


def dequantize_int_weight(
    qw: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bits: int,
    group: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The whole weight [N, K] in `dtype` (the prefill path's first half)."""
    n = qw.shape[0]
    k = qw.shape[1] * (32 // bits)
    _check(qw, scale, zero, bits, group, k)
    w = torch.empty(n, k, dtype=dtype, device=qw.device)
    block_n, block_k = 32, 128
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    _dequant_kernel[grid](
        qw,
        scale,
        zero if zero is not None else scale,
        w,
        n,
        k,
        qw.stride(0),
        scale.stride(0),
        w.stride(0),
        BITS=bits,
        GROUP=group,
        HAS_ZERO=zero is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return w


def w4a16_linear(
    x: torch.Tensor, qw: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int, group: int
) -> torch.Tensor:
    """The layer's GEMM: the fused kernel for small M, dequantize + cuBLAS from DEQUANT_GEMM_MIN_M rows."""
    if x.shape[0] >= DEQUANT_GEMM_MIN_M:
        return x @ dequantize_int_weight(qw, scale, zero, bits, group, x.dtype).t()
    return w4a16_gemm(x, qw, scale, zero, bits, group)


def dequantize_int_weight_ref(
    qw: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bits: int,
    group: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, device=qw.device, dtype=torch.int32)
    codes = ((qw.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(qw.shape[0], -1)
    z = zero if zero is not None else torch.full_like(scale, float(1 << (bits - 1)))
    g = torch.arange(qw.shape[1] * per, device=qw.device) // group
    return ((codes.float() - z[:, g]) * scale[:, g]).to(dtype)


def w4a16_gemm_ref(
    x: torch.Tensor, qw: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int, group: int
) -> torch.Tensor:
    """x @ W^T with W dequantized to x's dtype and the product accumulated in fp32."""
    w = dequantize_int_weight_ref(qw, scale, zero, bits, group, x.dtype)
    return (x.float() @ w.float().t()).to(x.dtype)
