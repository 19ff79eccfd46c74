"""Pooling: one vector per prompt from the hidden states of its tokens, then the embedding head
(Matryoshka cut, L2 normalization); or, for a sequence classifier, its logits through the activation
its checkpoint names (classifier_head).

The functions take a packed batch (the prompts' rows back to back, query_start_loc [num_seqs + 1] in
rows) and work in fp32, as sentence-transformers accumulates half-precision states. The runner pools
prompts that were split over several steps with the same arithmetic (runner/pooler.py); these whole-batch
forms are its reference and what the encoder engine uses.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F


def to_device(
    values: Sequence[int] | Sequence[bool] | np.ndarray, device: torch.device, dtype: type | None = None
) -> torch.Tensor:
    """A small host array on `device` without waiting for the GPU: a copy from pageable memory would
    first synchronize the stream (and end the overlap of host and device work), so it goes through
    pinned memory (torch caches those buffers)."""
    t = torch.as_tensor(np.asarray(values, dtype=dtype))
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def pool(hidden: torch.Tensor, query_start_loc: torch.Tensor, pooling_type: str) -> torch.Tensor:
    """hidden [T, H], query_start_loc [B + 1] (on hidden's device) -> [B, H] float32."""
    starts, ends = query_start_loc[:-1], query_start_loc[1:]
    if pooling_type == "LAST":
        return hidden[ends - 1].float()
    if pooling_type == "CLS":
        return hidden[starts].float()
    if pooling_type == "MEAN":
        lens = ends - starts
        seq_of_row = torch.repeat_interleave(torch.arange(len(lens), device=hidden.device), lens)
        sums = hidden.new_zeros(len(lens), hidden.shape[1], dtype=torch.float32)
        sums.index_add_(0, seq_of_row, hidden.float())
        return sums / lens[:, None].to(torch.float32)
    raise ValueError(f"unknown pooling type {pooling_type!r} (LAST, MEAN, CLS)")


def embedding_head(rows: torch.Tensor, dimensions: list[int | None], normalize: list[bool]) -> torch.Tensor:
    """rows [B, H] float32 -> [B, H]: row i cut to its first dimensions[i] values (the rest zeroed; the
    caller slices) and L2-normalized where normalize[i], cut first, as Matryoshka models are trained."""
    if any(d is not None for d in dimensions):
        width = rows.shape[1]
        keep = to_device([d or width for d in dimensions], rows.device)
        rows = rows * (torch.arange(width, device=rows.device)[None, :] < keep[:, None])
    if all(normalize):
        return F.normalize(rows, dim=-1)
    if any(normalize):
        which = to_device(normalize, rows.device)[:, None]
        return torch.where(which, F.normalize(rows, dim=-1), rows)
    return rows


def split_rows(host_rows: torch.Tensor, dimensions: list[int | None]) -> list[torch.Tensor]:
    """The per-prompt vectors of an embedding_head result copied to the host."""
    # Copies, not views: a view would keep (and pickle, across processes) the whole batch.
    return [(row if d is None else row[:d]).clone() for row, d in zip(host_rows, dimensions)]


def classifier_head(logits: torch.Tensor, activation: str, use_activation: list[bool]) -> torch.Tensor:
    """A sequence classifier's logits [B, num_labels] float32 -> what each request returns: the
    activation applied where use_activation[i] (sigmoid: each label on its own; softmax: over the
    labels; "none": the logits), the raw logits elsewhere."""
    if activation == "sigmoid":
        active = torch.sigmoid(logits)
    elif activation == "softmax":
        active = torch.softmax(logits, dim=-1)
    else:
        return logits
    if all(use_activation):
        return active
    if not any(use_activation):
        return logits
    which = to_device(use_activation, logits.device)[:, None]
    return torch.where(which, active, logits)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """An embedding model's score of a pair: the cosine similarity of its texts' vectors (fp32), as
    vLLM scores with one."""
    return float(F.cosine_similarity(a.float(), b.float(), dim=0))
