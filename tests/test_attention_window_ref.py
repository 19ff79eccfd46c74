"""The reference's window, softcap and sinks (attention/spec.py) against a dense per-position loop."""

import pytest
import torch

from overnight.attention.spec import LayerAttention
from overnight.attention.torch_backend import TorchAttentionBackend, build_metadata


def _dense(q, k, v, q_pos, scale, window, cap, sinks):
    """One request, every row at its own position: q [n, Hq, D], k/v [L, Hkv, D]."""
    hq, hkv = q.shape[1], k.shape[1]
    out = torch.empty_like(q)
    for r in range(q.shape[0]):
        p = q_pos[r]
        lo = 0 if window is None else max(0, p - window + 1)
        for h in range(hq):
            kh, vh = k[lo : p + 1, h // (hq // hkv)], v[lo : p + 1, h // (hq // hkv)]
            s = (kh @ q[r, h]) * scale
            if cap is not None:
                s = cap * torch.tanh(s / cap)
            if sinks is not None:
                s = torch.cat([s, sinks[h : h + 1]])
            w = s.softmax(0)[: kh.shape[0]]
            out[r, h] = w @ vh
    return out


@pytest.mark.parametrize("window", [None, 1, 5])
@pytest.mark.parametrize("cap", [None, 3.0])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_prefill_chunk_then_decode(window, cap, with_sinks):
    torch.manual_seed(0)
    hq, hkv, d, bs, length = 4, 2, 8, 4, 13
    q = torch.randn(length, hq, d)
    k, v = torch.randn(length, hkv, d), torch.randn(length, hkv, d)
    sinks = torch.randn(hq) if with_sinks else None
    layer = LayerAttention(window, cap)
    # Blocks a window no longer sees may be given back and hold anything: NaN must not leak in.
    cache = torch.full((2, 8, bs, hkv, d), float("nan"))
    table = [[5, 2, 7, 0]]
    backend = TorchAttentionBackend()
    ref = _dense(q, k, v, list(range(length)), 0.3, window, cap, sinks)
    # a first chunk of 9 rows, a second of 3, then one decode row
    got = []
    for lo, hi in [(0, 9), (9, 12)]:
        meta = build_metadata([hi - lo], [hi], table, bs)
        got.append(backend.forward(q[lo:hi], k[lo:hi], v[lo:hi], cache, meta, 0.3, layer=layer, sinks=sinks))
        if window is not None and window <= 5:  # positions 0..3 are out of every later window
            cache[:, 5] = float("nan")
    meta = build_metadata([1], [length], table, bs, num_decodes=1)
    got.append(backend.forward(q[12:], k[12:], v[12:], cache, meta, 0.3, layer=layer, sinks=sinks))
    torch.testing.assert_close(torch.cat(got), ref, rtol=1e-5, atol=1e-5)
    # k and v None: the cache already holds them (a KV-shared layer reads only)
    meta = build_metadata([1], [length], table, bs, num_decodes=1)
    again = backend.forward(q[12:], None, None, cache, meta, 0.3, layer=layer, sinks=sinks)
    torch.testing.assert_close(again, ref[12:], rtol=1e-5, atol=1e-5)


def test_bad_layer_attention_refused():
    with pytest.raises(ValueError, match="sliding_window"):
        LayerAttention(sliding_window=0)
    with pytest.raises(ValueError, match="logit_softcap"):
        LayerAttention(logit_softcap=-1.0)
