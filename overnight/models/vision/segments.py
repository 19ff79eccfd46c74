"""Bidirectional attention inside segments of a flattened batch of patches (an image, a frame, or one
window of one), the vision towers' attention.

A step's images go through a tower together, so its attention is over many short segments: 58 images
of 448 x 448 are 928 of Qwen2.5-VL's 64-patch windows. One attention call per segment is a few kernel
launches each, ~26,000 a step in that tower's 28 windowed blocks, which left the GPU idle. Segments
of one length are instead gathered into one batch and attended in one call: a step's images are
mostly one size, so a handful of calls (whole windows, and the partial windows at an image's right
and bottom edges) cover them.

    rows   [n, heads, head_dim]      cu_seqlens [0, 64, 128, ..., n]
    group  length L, S segments   -> [S, heads, L, head_dim] -> one scaled_dot_product_attention

A group whose segments lie back to back in row order (every whole window of a batch of equal images)
is a view of the rows; any other group gathers its rows by index.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on the device without waiting for the GPU: staged through pinned memory (a copy
    from pageable memory waits for the work queued before it, and the runner queues steps ahead)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class SegmentGroup:
    length: int  # rows in each segment
    count: int  # segments
    rows: slice | torch.Tensor  # the groups' rows in segment order: a contiguous range, or indices


@dataclass(frozen=True)
class Segments:
    """The segments of n rows (cu_seqlens), grouped by length; built once per tower call and shared by
    the blocks that attend over the same segments."""

    num_rows: int
    groups: tuple[SegmentGroup, ...]

    @staticmethod
    def of(cu_seqlens: list[int], device: torch.device) -> Segments:
        starts_by_len: dict[int, list[int]] = {}
        for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]):
            if b > a:
                starts_by_len.setdefault(b - a, []).append(a)
        groups = []
        for length, starts in sorted(starts_by_len.items()):
            first = starts[0]
            if starts == list(range(first, first + length * len(starts), length)):
                rows: slice | torch.Tensor = slice(first, first + length * len(starts))
            else:
                index = torch.tensor(starts)[:, None] + torch.arange(length)[None, :]
                rows = to_device(index.flatten(), device)
            groups.append(SegmentGroup(length, len(starts), rows))
        return Segments(cu_seqlens[-1] if cu_seqlens else 0, tuple(groups))


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments) -> torch.Tensor:
    """[n, heads, head_dim] each -> [n, heads, head_dim]: each row attends to every row of its own
    segment (softmax scale head_dim ** -0.5). Rows outside every segment are left undefined."""
    n, heads, dim = q.shape

    def batch(t: torch.Tensor, g: SegmentGroup) -> torch.Tensor:
        return t[g.rows].view(g.count, g.length, heads, dim).transpose(1, 2)

    only = segments.groups[0].rows if len(segments.groups) == 1 else None
    whole = isinstance(only, slice) and only == slice(0, n)
    out = None if whole else torch.empty_like(q)
    for g in segments.groups:
        o = F.scaled_dot_product_attention(batch(q, g), batch(k, g), batch(v, g))
        o = o.transpose(1, 2).reshape(g.count * g.length, heads, dim)
        if out is None:
            return o
        out[g.rows] = o
    assert out is not None
    return out
