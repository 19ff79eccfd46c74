"""Masking logits with a packed token bitmask: rows[i] of the logits keeps token t iff bit t % 32 of word
t // 32 of bitmask row i is set; every other entry becomes -inf. Rows not listed are untouched.

    bitmask [K, W] int32, W = ceil(V / 32)      word j of row i: bit b <-> token 32 j + b
    rows    [K]    int64: which logits row each bitmask row masks
    logits  [B, V] fp32 / fp16 / bf16, masked in place

Program (i, j) handles tokens j * BLOCK .. (j + 1) * BLOCK of row rows[i]: it loads BLOCK / 32 words,
expands them to one bit per token and stores -inf where the bit is clear (only there: allowed entries are
never written). Tokens past V (bits of the last word's padding) are never stored.

apply_token_bitmask_ picks the kernel on CUDA and apply_token_bitmask_cpu_ elsewhere: a table maps each
byte of the bitmask to eight additive biases (0 or -inf), and one index_add_ adds them to the listed rows
(several times faster on a CPU than unpacking bits and masked_fill on gathered rows, as the reference does).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BITMASK_BLOCK = 4096  # tokens per program: 128 words
BITMASK_NUM_WARPS = 4


@triton.jit
def _apply_token_bitmask_kernel(
    logits_ptr,
    bitmask_ptr,
    rows_ptr,
    stride_logits,
    stride_bitmask,
    vocab,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    j = tl.program_id(1)
    row = tl.load(rows_ptr + i).to(tl.int64)
    WORDS: tl.constexpr = BLOCK // 32
    words_offs = j * WORDS + tl.arange(0, WORDS)
    num_words = (vocab + 31) // 32
    words = tl.load(
        bitmask_ptr + i.to(tl.int64) * stride_bitmask + words_offs, mask=words_offs < num_words, other=0
    )
    bits = (words[:, None] >> tl.arange(0, 32)[None, :]) & 1
    allowed = tl.reshape(bits, (BLOCK,))
    offs = j * BLOCK + tl.arange(0, BLOCK)
    neg_inf = tl.full((BLOCK,), float("-inf"), dtype=logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * stride_logits + offs, neg_inf, mask=(offs < vocab) & (allowed == 0))


def _check(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [B, V] with unit stride along V, got {tuple(logits.shape)}")
    words = -(-logits.shape[1] // 32)
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32 or bitmask.shape[1] != words:
        raise ValueError(f"bitmask must be int32 [K, {words}], got {bitmask.dtype} {tuple(bitmask.shape)}")
    if bitmask.stride(1) != 1:
        raise ValueError("bitmask must have unit stride along its words")
    if rows.dim() != 1 or rows.shape[0] != bitmask.shape[0]:
        raise ValueError(f"rows must be [{bitmask.shape[0]}], got {tuple(rows.shape)}")
    if not (logits.device == bitmask.device == rows.device):
        raise ValueError("logits, bitmask and rows must be on one device")


def apply_token_bitmask_kernel_(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    rows: torch.Tensor,
    block: int = BITMASK_BLOCK,
    num_warps: int = BITMASK_NUM_WARPS,
) -> None:
    """The Triton kernel (see the module docstring); any device Triton runs on."""
    _check(logits, bitmask, rows)
    if rows.shape[0] == 0:
        return
    grid = (rows.shape[0], triton.cdiv(logits.shape[1], block))
    _apply_token_bitmask_kernel[grid](
        logits,
        bitmask,
        rows,
        logits.stride(0),
        bitmask.stride(0),
        logits.shape[1],
        BLOCK=block,
        num_warps=num_warps,
    )


def unpack_token_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[K, W] int32 -> [K, vocab] bool, True where the token is allowed."""
    # Little-endian bytes of each word: byte k of word j holds tokens 32 j + 8 k .. 32 j + 8 k + 7.
    as_bytes = bitmask.contiguous().view(torch.uint8)
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmask.device)
    bits = (as_bytes[:, :, None] >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab].bool()


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """The reference: unpack the bits, then masked_fill the listed rows."""
    _check(logits, bitmask, rows)
    if rows.shape[0] == 0:
        return
    allowed = unpack_token_bitmask(bitmask, logits.shape[1])
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


_BYTE_BIAS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def apply_token_bitmask_cpu_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """The CPU path (see the module docstring)."""
    _check(logits, bitmask, rows)
    if rows.shape[0] == 0:
        return
    key = (logits.dtype, logits.device)
    table = _BYTE_BIAS.get(key)
    if table is None:  # [256, 8]: bit k of byte b set -> 0, clear -> -inf
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
        table = torch.where(bits.bool(), 0.0, float("-inf")).to(logits.dtype).to(logits.device)
        _BYTE_BIAS[key] = table
    as_bytes = bitmask.contiguous().view(torch.uint8).long()  # little-endian, as in unpack_token_bitmask
    bias = F.embedding(as_bytes, table).view(bitmask.shape[0], -1)[:, : logits.shape[1]]
    logits.index_add_(0, rows, bias)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    if logits.is_cuda:
        apply_token_bitmask_kernel_(logits, bitmask, rows)
    else:
        apply_token_bitmask_cpu_(logits, bitmask, rows)
