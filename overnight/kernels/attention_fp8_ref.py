"""The e4m3-dot attention kernels' arithmetic in PyTorch, roundings included (DecodeConfig.fp8_mma in
paged_decode_fp8.py, PrefillConfig.fp8_mma in paged_prefill.py): q rounded to e4m3 per row and head, P
per tile after a 2**P_SHIFT shift, float32 otherwise, walked in the kernels' tiles and splits.

paged_attention_ref (overnight/attention/torch_backend.py) is the exact answer; these are what the
kernels must reproduce to float32 rounding, so a test can hold them to 1e-5 and keep the exact answer
for a looser check of the roundings themselves. Windows, chunks, softcaps and sinks as score_mods.py
says.
"""

from __future__ import annotations

import math

import torch

from overnight.kernels.kv_layout import v_view
from overnight.kernels.paged_decode_fp8 import P_SHIFT, Q_MAX


def decode_fp8_mma_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    num_decodes: int,
    scale: float,
    kv_scale: torch.Tensor | None = None,
    block_n: int = 128,
    num_splits: int = 1,
    *,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """The kernel's arithmetic in PyTorch, roundings included: q per head and P per tile of block_n
    tokens (under the running maximum of its split) rounded to e4m3; float32 otherwise. Returns
    [num_decodes, Hq, D] float32. paged_attention_ref is the exact answer; this one is what the
    kernel must reproduce to float32 rounding. With a window or a chunk the tiles start where the
    kernel's do (kv_tiles.decode_base) and nothing before it is read."""
    e4m3 = torch.float8_e4m3fn
    page, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_head = torch.arange(num_heads, device=q.device) // (num_heads // num_kv_heads)
    k_scale, v_scale = kv_scale.tolist() if kv_scale is not None else (1.0, 1.0)
    k_all, v_all = kv_cache[0], v_view(kv_cache)
    log2e = math.log2(math.e)
    sink2 = None if sinks is None else sinks.float().to(q.device) * log2e
    out = torch.zeros(num_decodes, num_heads, head_dim, device=q.device)
    align = min(page, block_n)
    for b in range(num_decodes):
        seq_len = int(seq_lens[b])
        lo = 0 if window is None else max(0, seq_len - window)
        if chunk is not None:  # the row's chunk starts at floor((seq_len - 1) / chunk) * chunk
            lo = max(lo, (max(seq_len, 1) - 1) // chunk * chunk)
        base = lo // align * align
        pos = torch.arange(base, seq_len, device=q.device)
        blocks = block_tables[b, pos // page].long()
        k = k_all[blocks, pos % page][:, kv_head].float()  # [L - base, Hq, D]
        v = v_all[blocks, pos % page][:, kv_head].float()
        qf = q[b].float()
        amax = qf.abs().amax(-1)
        q_scale = torch.where(amax > 0, amax / Q_MAX, torch.ones_like(amax))
        q8 = (qf / q_scale[:, None]).to(e4m3).float()
        col_scale = q_scale * scale * log2e * k_scale
        length = seq_len - base
        per_split = math.ceil(math.ceil(length / num_splits) / block_n) * block_n  # kv_tiles.split_len
        parts = []
        for start in range(0, length, max(per_split, 1)):
            end = min(start + per_split, length)
            m = torch.full((num_heads,), float("-inf"), device=q.device)
            l_sum = torch.zeros(num_heads, device=q.device)
            if sink2 is not None and num_splits == 1:
                m, l_sum = sink2.clone(), torch.full((num_heads,), 2.0**P_SHIFT, device=q.device)
            acc = torch.zeros(num_heads, head_dim, device=q.device)
            for n0 in range(start, end, block_n):
                n1 = min(n0 + block_n, end)
                s = torch.einsum("hd,nhd->hn", q8, k[n0:n1]) * col_scale[:, None]
                if softcap is not None:
                    cap2 = softcap * log2e
                    s = cap2 * torch.tanh(s / cap2)
                s = s.masked_fill((pos[n0:n1] < lo)[None, :], float("-inf"))
                m_new = torch.maximum(m, s.amax(-1))
                alpha = torch.exp2(m - m_new)
                p = torch.exp2(s - (m_new - P_SHIFT)[:, None])
                l_sum = l_sum * alpha + p.sum(-1)
                acc = acc * alpha[:, None] + torch.einsum("hn,nhd->hd", p.to(e4m3).float(), v[n0:n1])
                m = m_new
            parts.append((acc * (v_scale / l_sum)[:, None], m - P_SHIFT + torch.log2(l_sum)))
        if not parts:  # an empty context: zeros
            continue
        if num_splits == 1:
            out[b] = parts[0][0]
        else:
            lse = torch.stack([x[1] for x in parts])  # [splits, Hq]
            top = lse.amax(0) if sink2 is None else torch.maximum(lse.amax(0), sink2)
            w = torch.exp2(lse - top)
            denom = w.sum(0) + (0.0 if sink2 is None else torch.exp2(sink2 - top))
            out[b] = (torch.stack([x[0] for x in parts]) * w[..., None]).sum(0) / denom[:, None]
    return out


def prefill_fp8_mma_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_decodes: int,
    num_reqs: int,
    scale: float,
    kv_scale: torch.Tensor | None = None,
    block_n: int = 64,
    *,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """PrefillConfig.fp8_mma's arithmetic in PyTorch, roundings included: q per row and head, and P per
    tile of block_n keys (tiles from position 0, under each row's running maximum) rounded to e4m3;
    float32 otherwise. Returns [T, Hq, D] float32 with the prefill rows filled (zeros elsewhere).
    paged_attention_ref is the exact answer; this is what the kernel must reproduce to float32
    rounding. A tile past a row's position changes nothing for it (its weights are 0, its maximum the
    old one), so walking each request's whole context in block_n tiles matches the kernel's walk
    (with a window: keys before the chunk's first window are zeroed, never read)."""
    e4m3 = torch.float8_e4m3fn
    page, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    num_heads = q.shape[1]
    kv_head = torch.arange(num_heads, device=q.device) // (num_heads // num_kv_heads)
    k_scale, v_scale = kv_scale.tolist() if kv_scale is not None else (1.0, 1.0)
    k_all, v_all = kv_cache[0], v_view(kv_cache)
    log2e = math.log2(math.e)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for r in range(num_decodes, num_reqs):
        q0, q1 = int(query_start_loc[r]), int(query_start_loc[r + 1])
        seq_len = int(seq_lens[r])
        keys = torch.arange(seq_len, device=q.device)
        blocks = block_tables[r, keys // page].long()
        k = k_all[blocks, keys % page][:, kv_head].float()  # [L, Hq, D]
        v = v_all[blocks, keys % page][:, kv_head].float()
        first = 0 if window is None else max(0, seq_len - (q1 - q0) - window + 1)
        if chunk is not None:  # the first row's chunk start
            first = max(first, (seq_len - (q1 - q0)) // chunk * chunk)
        k[:first], v[:first] = 0.0, 0.0  # never read (a window's may be given back: any contents)
        qf = q[q0:q1].float()  # [R, Hq, D]
        amax = qf.abs().amax(-1)
        q_scale = torch.where(amax > 0, amax / Q_MAX, torch.ones_like(amax))
        q8 = (qf / q_scale[..., None]).to(e4m3).float()
        row_scale = q_scale * scale * math.log2(math.e) * k_scale  # [R, Hq]
        pos = seq_len - (q1 - q0) + torch.arange(q1 - q0, device=q.device)
        m = torch.full(amax.shape, float("-inf"), device=q.device)
        l_sum = torch.zeros(amax.shape, device=q.device)
        if sinks is not None:
            m = (sinks.float().to(q.device) * log2e).expand(amax.shape).clone()
            l_sum = torch.full(amax.shape, 2.0**P_SHIFT, device=q.device)
        acc = torch.zeros(qf.shape, device=q.device)
        for n0 in range(0, seq_len, block_n):
            n1 = min(n0 + block_n, seq_len)
            s = torch.einsum("rhd,nhd->rhn", q8, k[n0:n1]) * row_scale[..., None]
            if softcap is not None:
                s = softcap * log2e * torch.tanh(s / (softcap * log2e))
            visible = keys[n0:n1][None, :] <= pos[:, None]  # [R, N]
            if window is not None:
                visible &= keys[n0:n1][None, :] > pos[:, None] - window
            if chunk is not None:
                visible &= keys[n0:n1][None, :] >= (pos // chunk * chunk)[:, None]
            s = s.masked_fill(~visible[:, None, :], float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            m_use = m_new.masked_fill(m_new == float("-inf"), 0.0)
            alpha = torch.exp2(m - m_use)
            p = torch.exp2(s - (m_use - P_SHIFT)[..., None])
            l_sum = l_sum * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + torch.einsum("rhn,nhd->rhd", p.to(e4m3).float(), v[n0:n1])
            m = m_new
        out[q0:q1] = acc * (v_scale / l_sum)[..., None]
    return out
