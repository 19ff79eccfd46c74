"""Segment attention (models/vision/segments.py) against one attention call per segment, and the grouping
it batches by: whole windows of equal images as a view of the rows, partial windows gathered."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from overnight.models.vision.qwen_vit import cu_seqlens_of
from overnight.models.vision.segments import Segments, segment_attention


def per_segment(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int]) -> torch.Tensor:
    out = torch.zeros_like(q)
    for a, b in zip(cu[:-1], cu[1:]):
        if b > a:
            qs, ks, vs = (t[a:b].transpose(0, 1)[None] for t in (q, k, v))
            out[a:b] = F.scaled_dot_product_attention(qs, ks, vs)[0].transpose(0, 1)
    return out


def qkv(n: int, heads: int = 3, dim: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(n, heads, dim, generator=g) for _ in range(3))
    return q, k, v


def test_groups_by_length_contiguous_runs_are_views():
    # two equal images of 4 windows of 16 rows each: one group, the whole range
    s = Segments.of(cu_seqlens_of([16] * 8), torch.device("cpu"))
    assert [(g.length, g.count) for g in s.groups] == [(16, 8)]
    assert s.groups[0].rows == slice(0, 128)
    # an image with partial windows: whole 16s, edge 8s, a corner 4, interleaved in row order
    sizes = [16, 8, 16, 8, 8, 4]
    s = Segments.of(cu_seqlens_of(sizes), torch.device("cpu"))
    assert [(g.length, g.count) for g in s.groups] == [(4, 1), (8, 3), (16, 2)]
    eights = s.groups[1].rows
    assert isinstance(eights, torch.Tensor)
    assert eights.tolist() == list(range(16, 24)) + list(range(40, 48)) + list(range(48, 56))
    assert s.groups[0].rows == slice(56, 60)  # one segment is always a range


def test_empty_segments_are_skipped():
    s = Segments.of([0, 0, 5, 5, 9], torch.device("cpu"))
    assert [(g.length, g.count) for g in s.groups] == [(4, 1), (5, 1)]
    assert Segments.of([0], torch.device("cpu")).groups == ()


def test_matches_one_call_per_segment():
    cases = [
        [64] * 6,  # whole windows only: one batched call on a view
        [16, 8, 16, 8, 8, 4, 64, 64, 12],  # mixed lengths, gathered groups
        [37],  # one image
        [5, 0, 7, 5],  # an empty segment
    ]
    for sizes in cases:
        cu = cu_seqlens_of(sizes)
        q, k, v = qkv(cu[-1])
        got = segment_attention(q, k, v, Segments.of(cu, torch.device("cpu")))
        torch.testing.assert_close(got, per_segment(q, k, v, cu), rtol=1e-5, atol=1e-6)


def test_attention_never_crosses_a_segment():
    cu = cu_seqlens_of([8, 8, 4])
    q, k, v = qkv(20)
    s = Segments.of(cu, torch.device("cpu"))
    base = segment_attention(q, k, v, s)
    k2, v2 = k.clone(), v.clone()
    k2[8:16] += 3.0  # the second segment's keys and values change
    v2[8:16] -= 2.0
    moved = segment_attention(q, k2, v2, s)
    torch.testing.assert_close(moved[:8], base[:8])
    torch.testing.assert_close(moved[16:], base[16:])
    assert not torch.allclose(moved[8:16], base[8:16])
