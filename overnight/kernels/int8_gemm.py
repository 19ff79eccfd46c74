"""W8A8 GEMM (int8 weight per output channel, int8 activations per token): y = (xq * sx) @ (W * sw)^T.

Reference: int8_gemm_ref below (quant/int_linear.py's Int8Linear: its torch path). Layout:

    codes  [M, K] int8, rows contiguous           activations quantized per token (kernels/int8_quant.py)
    sx     [M, 1] float32                         their scales
    w      [N, K] int8, rows contiguous           the checkpoint's weight as loaded
    sw     [N] float32                            one scale per output row

Why a kernel of our own: on an H100 the first path (torch._int_mm, then the scales applied by three
elementwise torch ops on the int32 product) ran at 0.1-0.5x of a bf16 GEMM. Two causes: at M <= 16
_int_mm wants more than 16 rows (padded to 17) and cuBLASLt's int8 kernel for that shape took 100-300
us; at large M the scaling re-read and re-wrote the [M, N] product in fp32 four times (int32 -> fp32,
* sx, * sw, -> bf16), more traffic than the GEMM. Here:

- "triton": one kernel: int8 x int8 tensor-core dot accumulated in int32 (exact, as _int_mm), both
  scales applied to the accumulator before the single store in the output dtype.
- "w8a16" (small M): the activations are not quantized; the int8 weight, viewed as int32 words, runs
  through the W4A16 kernel with signed 8-bit codes and the channel scale (kernels/w4a16_gemm.py): a
  stream over the weight like any weight-only GEMM. Its result is the layer's product with the
  unquantized input: closer to the float model than W8A8, so it differs from the W8A8 reference by the
  activation quantization's error (a few 1e-3 relative).
- "int_mm": the first path (torch._int_mm + torch scaling), kept for the benchmark.

Which path runs for M rows: default_path (module constants, set from bench/w4a16_variants_gpu.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from overnight.kernels.int8_quant import quantize_int8
from overnight.kernels.tile_order import grouped_tile
from overnight.kernels.w4a16_gemm import W4A16Config, w4a16_gemm

W8A16_MAX_M = 16  # up to this many rows: "w8a16"; past it LARGE_PATH
LARGE_PATH = "triton"  # "triton" or "int_mm"
PATHS = ("triton", "w8a16", "int_mm")


@dataclass(frozen=True)
class Int8Config:
    """Tiles of the "triton" kernel."""

    block_m: int
    block_n: int
    block_k: int = 128
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 4


def default_path(m: int) -> str:
    return "w8a16" if m <= W8A16_MAX_M else LARGE_PATH


def default_config(m: int) -> Int8Config:
    if m <= 64:
        return Int8Config(block_m=16 if m <= 16 else 32 if m <= 32 else 64, block_n=64)
    return Int8Config(block_m=128, block_n=128, num_warps=8, num_stages=3)


@triton.jit(do_not_specialize=["M"])
def _int8_gemm_kernel(
    a_ptr,
    sa_ptr,
    b_ptr,
    sb_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_m = tl.minimum(offs_m, M - 1)  # clamped reads, masked stores
    rows_n = tl.minimum(offs_n, N - 1)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        kk = tl.max_contiguous(tl.multiple_of(k0 + offs_k, BLOCK_K), BLOCK_K)
        k_ok = kk[None, :] < K
        a_ok = k_ok & (offs_m[:, None] < M)  # rows past M masked, not re-read from L2
        a = tl.load(a_ptr + rows_m[:, None] * stride_am + kk[None, :], mask=a_ok, other=0)
        b = tl.load(b_ptr + rows_n[:, None] * stride_bn + kk[None, :], mask=k_ok, other=0)
        acc = tl.dot(a, tl.trans(b), acc, out_dtype=tl.int32)
    sa = tl.load(sa_ptr + rows_m)
    sb = tl.load(sb_ptr + rows_n)
    y = acc.to(tl.float32) * sa[:, None] * sb[None, :]
    ok = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], y.to(out_ptr.dtype.element_ty), mask=ok)


def _check(w: torch.Tensor, w_scale: torch.Tensor, k: int) -> None:
    if w.dtype != torch.int8 or w.dim() != 2 or w.shape[1] != k or w.stride(1) != 1:
        raise ValueError(f"w must be int8 [N, {k}] with contiguous rows, got {w.dtype} {list(w.shape)}")
    if w_scale.dtype != torch.float32 or tuple(w_scale.shape) != (w.shape[0],):
        raise ValueError(f"w_scale must be float32 [{w.shape[0]}], got {w_scale.dtype} {list(w_scale.shape)}")


def int8_gemm(
    codes: torch.Tensor,
    sx: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
    config: Int8Config | None = None,
) -> torch.Tensor:
    """(codes * sx) @ (w * w_scale)^T -> [M, N] in out_dtype, int32 accumulation (the "triton" path)."""
    m, k = codes.shape
    n = w.shape[0]
    _check(w, w_scale, k)
    if codes.dtype != torch.int8 or codes.stride(1) != 1 or sx.shape != (m, 1) or sx.dtype != torch.float32:
        raise ValueError("codes must be int8 [M, K] with contiguous rows and sx float32 [M, 1]")
    cfg = config or default_config(m)
    out = torch.empty(m, n, dtype=out_dtype, device=codes.device)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _int8_gemm_kernel[grid](
        codes,
        sx,
        w,
        w_scale,
        out,
        m,
        n,
        k,
        codes.stride(0),
        w.stride(0),
        out.stride(0),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def w8a16_gemm(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, config: W4A16Config | None = None
) -> torch.Tensor:
    """x @ (w * w_scale)^T in x's dtype, x unquantized (the "w8a16" path): w [N, K] int8 viewed as
    int32 words [N, K / 4] (little-endian: value j of a word is byte j, column 4w + j)."""
    k = x.shape[1]
    _check(w, w_scale, k)
    if k % 16:
        raise ValueError(f"the w8a16 path needs K a multiple of 16, got {k}")
    words = w.view(torch.int32)
    return w4a16_gemm(x, words, w_scale[:, None], None, 8, k, config=config, signed=True)


def int8_linear(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, path: str | None = None
) -> torch.Tensor:
    """The W8A8 layer's product (no bias) in x's dtype by `path` (default_path(M) when None)."""
    path = path or default_path(x.shape[0])
    if path not in PATHS:
        raise ValueError(f"unknown int8 path {path!r}: one of {PATHS}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if path == "w8a16":
        return w8a16_gemm(x, w, w_scale)
    codes, sx = quantize_int8(x)
    if path == "triton":
        return int8_gemm(codes, sx, w, w_scale, x.dtype)
    m = codes.shape[0]
    # CUDA's torch._int_mm wants more than 16 rows: small batches are padded
    padded = codes if m > 16 else torch.nn.functional.pad(codes, (0, 0, 0, 17 - m))
    acc = torch._int_mm(padded, w.t())[:m].float()
    return (acc * sx * w_scale[None, :]).to(x.dtype)


def int8_gemm_ref(
    codes: torch.Tensor, sx: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """The W8A8 product in float32 (exact for |sums| < 2^24), scaled, in out_dtype."""
    acc = codes.float() @ w.float().t()
    return (acc * sx * w_scale[None, :]).to(out_dtype)
