"""What a layer may change in attention's scores: a sliding window, an attention chunk, a logit softcap,
learned sinks.

Shared by paged_decode.py, paged_decode_fp8.py and paged_prefill.py (reference: paged_attention_ref in
overnight/attention/torch_backend.py; the layer's facts in overnight/attention/spec.py). The kernels
keep scores in the log2 domain (s2 = q . k * scale * log2(e), softmax by exp2), so each modification is
written for s2:

    softcap  cap * tanh(s / cap) on the scaled score s (scale first, then the cap, as HF's Gemma 2):
             in log2 units the same function with cap2 = cap * log2(e), since
             log2(e) * cap * tanh(s / cap) = cap2 * tanh(s2 / cap2)
    window   a query at position p sees keys p - W + 1 .. p (HF's convention)
    chunk    a query at position p sees keys floor(p / C) * C .. p (Llama 4's chunked layers); with a
             window too, a key must pass both bounds
    sinks    one more logit per query head in the softmax denominator, with no value: a running
             maximum that starts at sink2 = sink * log2(e) with a row sum of 1 (exp2(sink2 - sink2)),
             or, split over the context, counted once where the splits are combined

Window, chunk and softcap are constexpr values (WINDOW = 0, CHUNK = 0, SOFTCAP = 0.0: off), sinks a
pointer behind a constexpr flag, so the full-attention variant compiles exactly as before they existed,
and a model with two or three layer kinds compiles two or three variants of each kernel.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2E = math.log2(math.e)
MAX_HEAD_DIM = 512  # Gemma 4's global layers; the kernels' default tiles shrink with head_dim above 128


@triton.jit
def softcap(s, CAP: tl.constexpr):
    """CAP * tanh(s / CAP) in fp32, through exp2 (the interpreter has no tanh; the GPU's ex2 is one
    instruction): tanh(x) = 1 - 2 / (exp2(2 x log2(e)) + 1), exact at both ends (+-1 for |x| large)."""
    e = tl.exp2(s * (2.0 * 1.4426950408889634 / CAP))
    return CAP * (1.0 - 2.0 / (e + 1.0))


@triton.jit
def sink_init(sinks_ptr, heads, mask, N: tl.constexpr, HAS_SINKS: tl.constexpr):
    """([N] running max, [N] row sum) an online softmax starts from: the sink of each row's head
    (heads: a scalar or [N]) as a logit already seen, with weight 1; (-inf, 0) without sinks."""
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + heads, mask=mask, other=0.0).to(tl.float32)
        m = sink * 1.4426950408889634 + tl.zeros([N], tl.float32)
        l_sum = tl.full([N], 1.0, tl.float32)
    else:
        m = tl.full([N], float("-inf"), tl.float32)
        l_sum = tl.zeros([N], tl.float32)
    return m, l_sum


def layer_constexprs(window: int | None, logit_softcap: float | None) -> tuple[int, float]:
    """(WINDOW, SOFTCAP) of a launch: 0 / 0.0 for off; the cap in log2 units."""
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if logit_softcap is not None and not logit_softcap > 0:
        raise ValueError(f"softcap must be > 0, got {logit_softcap}")
    return (window or 0), (0.0 if logit_softcap is None else float(logit_softcap) * LOG2E)


def chunk_constexpr(chunk: int | None) -> int:
    """CHUNK of a launch: the attention chunk in tokens, 0 for none."""
    if chunk is not None and chunk < 1:
        raise ValueError(f"attention chunk must be >= 1, got {chunk}")
    return chunk or 0


def check_sinks(sinks: torch.Tensor | None, num_heads: int, device: torch.device) -> None:
    if sinks is None:
        return
    if sinks.shape != (num_heads,) or sinks.dtype != torch.float32 or sinks.device != device:
        raise ValueError(
            f"sinks must be float32 [{num_heads}] on {device}, got {sinks.dtype} {tuple(sinks.shape)} "
            f"on {sinks.device}"
        )
    if sinks.stride(0) != 1:
        raise ValueError("sinks must be contiguous")


def check_head_dim(head_dim: int) -> None:
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(
            f"head_dim {head_dim} is outside what the attention kernels take (1..{MAX_HEAD_DIM})"
        )


def gpu_dot_refusal(head_dim: int, block_n: int, eight_bit: bool) -> str | None:
    """Why compiled attention kernels cannot take tiles of block_n tokens at this head_dim (None: they
    can). A GPU's MMA contracts at least 16 elements of 16- or 32-bit operands and 32 of 8-bit ones
    (Triton refuses to compile a smaller tl.dot); the kernels contract over the head (q . k, BLOCK_D the
    next power of two of head_dim) and over the tile's tokens (p . v). The interpreter takes any size,
    so the launchers ask only for CUDA tensors."""
    min_k = 32 if eight_bit else 16
    operands = "8-bit" if eight_bit else "16/32-bit"
    if triton.next_power_of_2(head_dim) < min_k:
        return f"head_dim {head_dim} is below {min_k}, the least a GPU dot of {operands} operands contracts"
    if block_n < min_k:
        return f"tiles of {block_n} tokens are below {min_k}, the least a GPU dot of {operands} operands contracts"
    return None
