"""Per-row key limits (AttentionMetadata.key_limit: the tokens of one image attend to each other both
ways, Gemma 3) in the Triton prefill kernel against the PyTorch reference, and the reference itself
against a dense mask written out here. fp32 / fp16 through the interpreter (bf16 too on a GPU), tiny
shapes."""

from __future__ import annotations

import pytest
import torch

from overnight.attention.metadata import AttentionMetadata
from overnight.attention.spec import FULL_ATTENTION, LayerAttention
from overnight.attention.torch_backend import paged_attention_ref
from overnight.attention.triton_backend import paged_attention
from overnight.kernels.paged_prefill import PrefillConfig, paged_prefill
from tests.kernel_helpers import DEVICE, DTYPES, assert_close, make_batch

TINY = PrefillConfig(16, 16, 4, 1)
# Two decodes, then three prefill chunks; images (spans of rows) inside the chunks, one crossing a
# 16-row query tile and a 16-key tile, one at a chunk's very end, one at its start.
QUERY = [1, 1, 21, 9, 6]
SEQ = [12, 30, 40, 9, 50]
SPANS = {2: [(3, 8), (13, 19)], 3: [(5, 9)], 4: [(0, 4)]}  # request -> [first row, end row) in its chunk


def limits_for(meta: AttentionMetadata) -> torch.Tensor:
    qsl, sl = meta.query_start_loc_cpu.tolist(), meta.seq_lens_cpu.tolist()
    rows = []
    for i in range(meta.num_reqs):
        qlen = qsl[i + 1] - qsl[i]
        pos = list(range(sl[i] - qlen, sl[i]))
        for a, b in SPANS.get(i, []):
            pos[a:b] = [sl[i] - qlen + b - 1] * (b - a)
        rows += pos
    return torch.tensor(rows, dtype=torch.int32, device=DEVICE)


def dense(q, cache, meta, scale, limit, window):
    """Each row against its gathered context with an explicit mask."""
    out = torch.zeros_like(q, dtype=torch.float32)
    qsl, sl = meta.query_start_loc_cpu.tolist(), meta.seq_lens_cpu.tolist()
    bs = cache.shape[2]
    group = q.shape[1] // cache.shape[3]
    for i in range(meta.num_reqs):
        n = sl[i]
        blocks = meta.block_tables[i, : (n + bs - 1) // bs].long()
        k = cache[0, blocks].flatten(0, 1)[:n].float().repeat_interleave(group, 1)
        v = cache[1, blocks].flatten(0, 1)[:n].float().repeat_interleave(group, 1)
        for r in range(qsl[i], qsl[i + 1]):
            p = n - (qsl[i + 1] - r)
            keys = torch.arange(n, device=q.device)
            seen = keys <= int(limit[r])
            if window is not None:
                seen &= keys > p - window
            s = torch.einsum("hd,lhd->hl", q[r].float(), k) * scale
            prob = s.masked_fill(~seen[None], float("-inf")).softmax(-1)
            out[r] = torch.einsum("hl,lhd->hd", prob, v)
    return out


@pytest.mark.parametrize("window", [None, 11])
def test_reference_matches_a_dense_mask(window) -> None:
    meta, q, cache = make_batch(QUERY, SEQ, 2, 4, 2, 16, 8, torch.float32, seed=3)
    meta.key_limit = limits_for(meta)
    layer = LayerAttention(sliding_window=window) if window else FULL_ATTENTION
    ref = paged_attention_ref(q, cache, meta, 0.25, layer=layer)
    torch.testing.assert_close(ref, dense(q, cache, meta, 0.25, meta.key_limit, window), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 11])
def test_prefill_kernel_key_limits(dtype, window) -> None:
    meta, q, cache = make_batch(QUERY, SEQ, 2, 4, 2, 16, 8, dtype, seed=5)
    meta.key_limit = limits_for(meta)
    layer = LayerAttention(sliding_window=window) if window else FULL_ATTENTION
    ref = paged_attention_ref(q, cache, meta, 0.25, layer=layer)
    out = paged_attention(q, cache, meta, 0.25, layer=layer, prefill_config=TINY)
    assert_close(out, ref, dtype)
    # The limits change the answer (rows before an image's end see more), and without them the kernel
    # is the causal one.
    meta.key_limit = None
    causal = paged_attention(q, cache, meta, 0.25, layer=layer, prefill_config=TINY)
    assert not torch.allclose(causal.float(), out.float(), atol=1e-3)
    assert_close(causal, paged_attention_ref(q, cache, meta, 0.25, layer=layer), dtype)


def test_key_limit_is_checked() -> None:
    meta, q, cache = make_batch([5], [5], 0, 2, 1, 16, 8, torch.float32, seed=1)
    out = torch.empty_like(q)
    args = (q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0, 1, 5, 0.25, out)
    with pytest.raises(ValueError, match="key_limit"):
        paged_prefill(*args, key_limit=torch.zeros(5, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="key_limit"):
        paged_prefill(*args, key_limit=torch.zeros(3, dtype=torch.int32, device=DEVICE))
