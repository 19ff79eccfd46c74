"""FP8 GEMM with the scales applied in the kernel: y = (A * sa) @ (B * sb)^T (+ bias), fp32 accumulation.

Reference: scaled_matmul_ref in overnight/quant/fp8.py.

    A  [M, K] e4m3, rows contiguous           activations (a linear layer's input, quantized)
    B  [N, K] e4m3, rows contiguous           weights as stored ([out, in]: K-major, as the tensor
                                              cores want both operands)
    sa [M, G] float32                         per token (G = 1) or per token and K-group
    sb [N] or [N, KB] float32                 per output channel, or per output row and K-block

Two ways to apply the scales, chosen by GROUP_K (constexpr):

    GROUP_K = 0     per-channel weights, per-token activations: the scales factor out of the sum
                    over K, so the K loop is a plain FP8 dot and the epilogue multiplies
                    acc[m, n] * sa[m] * sb[n] once.
    GROUP_K = gk    block-scaled weights (a checkpoint's 128 x 128 blocks, kept as [N, K / gk]):
                    each K step of BLOCK_K (which divides gk) lies inside one group g, and its
                    partial dot is scaled by sa[m, g] * sb[n, g] before it is accumulated. sa may
                    be per token too (its group stride is then 0).

Tiles: program (pid_m, pid_n) computes a BLOCK_M x BLOCK_N tile of y, walking K in BLOCK_K steps;
programs are ordered in groups of GROUP_M rows of tiles, so tiles running together share A and B in L2.
Rows past M and columns past N are read clamped (a duplicate row, never out of bounds) and not stored,
which keeps the K loop free of masks unless K is not a multiple of BLOCK_K. Launches depend only on
shapes, strides and pointers: safe to capture in a CUDA graph.

On CUDA the engine runs per-channel layers through torch._scaled_mm (quant/linear.py says when); this
kernel serves block-scaled weights, shapes _scaled_mm refuses, and the CPU tests (interpreter).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from overnight.kernels.tile_order import grouped_tile

# The tensor cores' FP8 MMA takes K 32 at a time: a compiled tl.dot on e4m3 tiles with K < 32 is refused
# (the interpreter takes any K, so only the GPU enforces it).
MIN_BLOCK_K = 32


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 4


@triton.jit(do_not_specialize=["M"])  # the token count changes every step (paged_prefill.py says why)
def _fp8_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    sa_ptr,
    sb_ptr,
    bias_ptr,
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_cm,
    stride_sam,
    stride_sag,
    stride_sbn,
    stride_sbg,
    GROUP_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_a = (offs_m % M).to(tl.int64)  # clamped reads; the store below is masked
    rows_b = (offs_n % N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows_a[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + rows_b[None, :] * stride_bn + offs_k[:, None]  # [BLOCK_K, BLOCK_N] view of B^T

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - kt * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if GROUP_K > 0:
            g = (kt * BLOCK_K) // GROUP_K
            sa = tl.load(sa_ptr + rows_a * stride_sam + g * stride_sag)
            sb = tl.load(sb_ptr + rows_b * stride_sbn + g * stride_sbg)
            acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
        else:
            # Hopper's FP8 MMA adds into its accumulator with about 14 significant bits over all of K
            # here (Triton's sm_90 default; error ~2^-13 of the products' absolute sum, as cuBLAS's fast
            # accumulation). Promoting each K step (max_num_imprecise_acc=BLOCK_K) would be exact to
            # fp32 but breaks the chain of asynchronous MMAs: a GPU measurement decides, not this file.
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    if GROUP_K == 0:
        sa = tl.load(sa_ptr + rows_a * stride_sam)
        sb = tl.load(sb_ptr + rows_b * stride_sbn)
        acc = acc * (sa[:, None] * sb[None, :])
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows_b).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def default_config(m: int, n: int, k: int, group_k: int) -> GemmConfig:
    """Tiles by batch size: decode-sized M takes a 64-row tile (the smallest Hopper's FP8 wgmma
    fills), larger M 128 x 128 tiles; BLOCK_K 128 is one K-block of a 128 x 128 checkpoint."""
    block_k = min(128, group_k) if group_k else 128
    if m <= 64:
        return GemmConfig(64, 64, block_k, num_warps=4, num_stages=4)
    return GemmConfig(128, 128, block_k, num_warps=8, num_stages=4)


def fp8_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    group_k: int = 0,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """(a * a_scale) @ (b * b_scale)^T + bias -> [M, N] in out_dtype. a [M, K], b [N, K] e4m3 with
    unit stride along K. group_k = 0: a_scale [M, 1], b_scale [N]. group_k > 0 (a power of two >= 32):
    b_scale [N, ceil(K / group_k)], a_scale [M, 1] or [M, ceil(K / group_k)]."""
    m, k = a.shape
    n = b.shape[0]
    if b.shape[1] != k or a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError(
            f"a [M, K] and b [N, K] with unit stride along K, got {tuple(a.shape)}, {tuple(b.shape)}"
        )
    groups = -(-k // group_k) if group_k else 1
    if a_scale.shape[0] != m or a_scale.shape[1] not in (1, groups) or a_scale.dtype != torch.float32:
        raise ValueError(f"a_scale must be float32 [{m}, 1] or [{m}, {groups}], got {tuple(a_scale.shape)}")
    b_cols = (groups,) if group_k else ()
    if tuple(b_scale.shape) != (n, *b_cols) or b_scale.dtype != torch.float32:
        raise ValueError(f"b_scale must be float32 {[n, *b_cols]}, got {list(b_scale.shape)}")
    cfg = config or default_config(m, n, k, group_k)
    if group_k and (group_k & (group_k - 1) or group_k % cfg.block_k):
        raise ValueError(f"group_k {group_k} must be a power of two that BLOCK_K {cfg.block_k} divides")
    if a.is_cuda and cfg.block_k < MIN_BLOCK_K:
        raise ValueError(
            f"BLOCK_K {cfg.block_k} is below {MIN_BLOCK_K}, the K step of the GPU's FP8 MMA (Triton refuses "
            f"to compile the dot); group_k must be at least {MIN_BLOCK_K} too"
        )
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _fp8_gemm_kernel[grid](
        a,
        b,
        out,
        a_scale,
        b_scale,
        bias if bias is not None else out,
        m,
        n,
        k,
        a.stride(0),
        b.stride(0),
        out.stride(0),
        a_scale.stride(0),
        a_scale.stride(1) if a_scale.shape[1] > 1 else 0,
        b_scale.stride(0),
        b_scale.stride(1) if group_k else 0,
        GROUP_K=group_k,
        HAS_BIAS=bias is not None,
        EVEN_K=k % cfg.block_k == 0,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
