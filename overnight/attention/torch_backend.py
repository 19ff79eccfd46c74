"""Paged attention in plain PyTorch: the CPU path, and the reference every GPU kernel is tested against.

Layouts are described in metadata.py (and an FP8 cache's token-major V in kv_layout.py). The
arithmetic is ordinary softmax attention in the dtype of q (fp32 accumulation happens inside torch's
matmul for fp16/bf16 on CUDA; on CPU we upcast explicitly).
With a layer's kv_scale (an FP8 cache, kv_quant.py) K/V are quantized on write and dequantized on read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from overnight.attention.kv_quant import dequantize_kv, quantize_kv
from overnight.attention.metadata import AttentionMetadata
from overnight.attention.mla import latent_attention_ref, write_latent_ref
from overnight.attention.spec import FULL_ATTENTION, LayerAttention
from overnight.kernels.kv_layout import v_view


def write_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """Store each row's k/v at its flat slot; rows whose slot is -1 (padding) are skipped.

    With kv_scale ([2]: k_scale, v_scale) the rows are stored quantized: x / scale, saturated, cast.
    """
    block_size = kv_cache.shape[2]
    n = slot_mapping.shape[0]
    valid = slot_mapping[:n] >= 0
    slots = slot_mapping[:n][valid]
    blocks, offsets = slots // block_size, slots % block_size
    k, v = k[:n][valid], v[:n][valid]
    if kv_scale is not None:
        k, v = quantize_kv(k, kv_scale[0], kv_cache.dtype), quantize_kv(v, kv_scale[1], kv_cache.dtype)
    kv_cache[0][blocks, offsets] = k.to(kv_cache.dtype)
    v_view(kv_cache)[blocks, offsets] = v.to(kv_cache.dtype)


def _load(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """Cached K or V in the compute dtype (dequantized when the cache is scaled)."""
    return x.to(dtype) if scale is None else dequantize_kv(x, scale, dtype)


def _gather_context(
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one request's first seq_len positions: [seq_len, Hkv, D] each."""
    block_size = kv_cache.shape[2]
    num_blocks_used = (seq_len + block_size - 1) // block_size
    blocks = block_table[:num_blocks_used].long()
    k = kv_cache[0, blocks].flatten(0, 1)[:seq_len]
    v = v_view(kv_cache)[blocks].flatten(0, 1)[:seq_len]
    return k, v


def _softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last dim, with one more logit (the head's sink, no value) in the denominator.
    sinks: shaped to broadcast against scores[..., :1]."""
    if sinks is None:
        return scores.softmax(dim=-1)
    sink = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]


def _visible(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    window: int | None,
    limit: torch.Tensor | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """[len(q_pos), len(k_pos)] bool: up to each row's limit (None: causal, its own position), within
    the last `window` positions before the row's own position when set, and within the row's own
    chunk of `chunk` positions when set (spec.py)."""
    mask = k_pos[None, :] <= (q_pos if limit is None else limit)[:, None]
    if window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    if chunk is not None:
        mask &= k_pos[None, :] >= torch.div(q_pos, chunk, rounding_mode="floor")[:, None] * chunk
    return mask


def paged_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_scale: torch.Tensor | None = None,
    *,
    layer: LayerAttention = FULL_ATTENTION,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of every query row over its request's cached context (this step's K/V already written).

    q: [T, Hq, D]; returns [T, Hq, D]. Rows past the real tokens (padding) are left as zeros.
    kv_scale: [2] (k_scale, v_scale) of a quantized cache, multiplied in after the cast.
    layer: sliding window, attention chunk and logit softcap (spec.py); sinks: [Hq] learned sink logits.
    meta.key_limit: per-row last visible key of prefill rows (metadata.py); decode rows are causal.
    """
    window, cap, chunk = layer.sliding_window, layer.logit_softcap, layer.attention_chunk
    k_scale, v_scale = (None, None) if kv_scale is None else (kv_scale[0], kv_scale[1])
    out = torch.zeros_like(q)
    compute_dtype = torch.float32 if q.device.type == "cpu" else q.dtype
    qsl = meta.query_start_loc_cpu if meta.query_start_loc_cpu is not None else meta.query_start_loc.cpu()
    sl = meta.seq_lens_cpu if meta.seq_lens_cpu is not None else meta.seq_lens.cpu()
    qsl_list, sl_list = qsl.tolist(), sl.tolist()
    num_heads, num_kv_heads = q.shape[1], kv_cache.shape[3]

    # Decodes: one query row each, batched over requests with a padding mask.
    nd = meta.num_decodes
    if nd > 0:
        max_len = max(sl_list[:nd])
        block_size = kv_cache.shape[2]
        nblk = (max_len + block_size - 1) // block_size
        # With a window (chunk), blocks before every request's window (chunk start) are not read at
        # all (given back: engine/kv_cache_manager.py); the shortest request's is the earliest.
        shortest = min(sl_list[:nd])
        first = 0 if window is None else max(0, shortest - window) // block_size
        if chunk is not None:
            first = max(first, (shortest - 1) // chunk * chunk // block_size)
        blocks = meta.block_tables[:nd, first:nblk].long()
        lo = first * block_size
        k = kv_cache[0, blocks].flatten(1, 2)[:, : max_len - lo]  # [nd, L - lo, Hkv, D]
        v = v_view(kv_cache)[blocks].flatten(1, 2)[:, : max_len - lo]
        lens = sl[:nd].to(q.device)
        key_pos = torch.arange(lo, max_len, device=q.device)[None, :]
        pad = key_pos >= lens[:, None]  # [nd, L - lo]
        group = num_heads // num_kv_heads
        qd = q[:nd].to(compute_dtype).view(nd, num_kv_heads, group, -1)
        if window is not None:  # the query sits at position len - 1
            pad |= key_pos <= lens[:, None] - 1 - window
        if chunk is not None:  # its chunk starts at floor((len - 1) / C) * C
            pad |= key_pos < torch.div(lens[:, None] - 1, chunk, rounding_mode="floor") * chunk
        scores = torch.einsum("bhgd,blhd->bhgl", qd, _load(k, compute_dtype, k_scale)) * scale
        if cap is not None:
            scores = cap * torch.tanh(scores / cap)
        scores = scores.masked_fill(pad[:, None, None, :], float("-inf"))
        probs = _softmax_with_sinks(scores, None if sinks is None else sinks.view(1, num_kv_heads, group, 1))
        # Slots past a request's length hold whatever the memory held (possibly NaN): zero them,
        # since 0 * NaN would poison the sum.
        v = _load(v, compute_dtype, v_scale).masked_fill(pad[:, :, None, None], 0.0)
        o = torch.einsum("bhgl,blhd->bhgd", probs, v)
        out[:nd] = o.reshape(nd, num_heads, -1).to(q.dtype)

    # Prefill chunks: one causal attention per request, offset by the context already cached.
    for i in range(nd, meta.num_reqs):
        start, end = qsl_list[i], qsl_list[i + 1]
        qlen, seq_len = end - start, sl_list[i]
        if qlen == 0:
            continue
        k, v = _gather_context(kv_cache, meta.block_tables[i], seq_len)
        # A window's older positions may sit in blocks already given back (any contents, NaN too):
        # read from the first position the chunk's first query sees.
        lo = 0 if window is None else max(0, seq_len - qlen - window + 1)
        if chunk is not None:  # and nothing before the first query's chunk is read
            lo = max(lo, (seq_len - qlen) // chunk * chunk)
        qi = q[start:end].to(compute_dtype).transpose(0, 1)  # [Hq, qlen, D]
        ki = _load(k[lo:], compute_dtype, k_scale).transpose(0, 1)  # [Hkv, L - lo, D]
        vi = _load(v[lo:], compute_dtype, v_scale).transpose(0, 1)
        q_pos = torch.arange(seq_len - qlen, seq_len, device=q.device)
        limit = None if meta.key_limit is None else meta.key_limit[start:end].to(q_pos.dtype)
        k_pos = torch.arange(lo, seq_len, device=q.device)
        mask = _visible(q_pos, k_pos, window, limit, chunk)  # [qlen, L - lo]
        if cap is None and sinks is None:
            o = F.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=num_heads != num_kv_heads
            )
        else:
            group = num_heads // num_kv_heads
            ki, vi = ki.repeat_interleave(group, dim=0), vi.repeat_interleave(group, dim=0)
            scores = torch.einsum("hqd,hld->hql", qi, ki) * scale
            if cap is not None:
                scores = cap * torch.tanh(scores / cap)
            scores = scores.masked_fill(~mask[None], float("-inf"))
            probs = _softmax_with_sinks(scores, None if sinks is None else sinks.view(-1, 1, 1))
            o = torch.einsum("hql,hld->hqd", probs, vi)
        out[start:end] = o.transpose(0, 1).to(q.dtype)
    return out


class TorchAttentionBackend:
    """The CPU backend: write K/V with indexing, attend with the reference above."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scale: torch.Tensor | None = None,
        *,
        layer: LayerAttention = FULL_ATTENTION,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if k is not None and v is not None:  # None: a layer reading another layer's cache
            write_kv_ref(k, v, kv_cache, meta.slot_mapping, kv_scale)
        return paged_attention_ref(q, kv_cache, meta, scale, kv_scale, layer=layer, sinks=sinks)

    def forward_mla(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        rows: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
        kv_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        write_latent_ref(rows, kv_cache, meta.slot_mapping, kv_scale, w_uk.shape[2])
        return latent_attention_ref(q_nope, q_pe, kv_cache, meta, scale, w_uk, w_uv, kv_scale)


def build_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    num_decodes: int = 0,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Metadata for a batch described by plain lists (tests, and the simple runner path)."""
    qsl = [0]
    slots: list[int] = []
    for qlen, slen, table in zip(query_lens, seq_lens, block_tables, strict=True):
        qsl.append(qsl[-1] + qlen)
        for pos in range(slen - qlen, slen):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    width = max((len(t) for t in block_tables), default=1) or 1
    bt = torch.zeros(len(block_tables), width, dtype=torch.int32)
    for i, t in enumerate(block_tables):
        bt[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    qsl_t = torch.tensor(qsl, dtype=torch.int32)
    sl_t = torch.tensor(seq_lens, dtype=torch.int32)
    return AttentionMetadata(
        num_reqs=len(query_lens),
        num_decodes=num_decodes,
        num_tokens=qsl[-1],
        query_start_loc=qsl_t.to(device),
        seq_lens=sl_t.to(device),
        block_tables=bt.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        query_start_loc_cpu=qsl_t,
        seq_lens_cpu=sl_t,
    )
