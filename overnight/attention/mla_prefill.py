"""Latent attention's prefill chunks on the GPU (attention/mla.py's decompressed form), batched: every
prefill request of a step at once, no Python work or host read per request.

    1. gather   each request's cached rows (its chunk's own included, already written; an FP8 cache's
                dequantized) into one buffer [sum L, R + P] (kernels/latent_gather.py)
    2. expand   latent [sum L, R] @ kv_b_proj's weight^T -> [sum L, H, Dn + Dv]: K_nope is each
                head's first Dn values, V the other Dv (W_UK and W_UV in one GEMM: both are views
                of that weight, split_kv_b)
    3. attend   causal varlen flash attention of the prefill rows over those keys and values, the
                rotated key k_pe read once from the gathered rows for every head
                (kernels/mla_prefill.mla_prefill_attention)

The host plans from the metadata's host copies (query_start_loc_cpu, seq_lens_cpu): how many rows to
gather, and how to split the requests into groups so that the decompressed K and V stay within
MAX_DECOMPRESSED_BYTES (a request longer than that runs alone, as the per-request reference would).
latent_prefill_ref (mla.py) is the reference and the CPU path.

Memory: a group holds sum L x (R + P) gathered values and sum L x H x (Dn + Dv) decompressed ones, in
the compute dtype, for one layer at a time: outside the pool plan's measured peak, as the reference's
per-request K and V were (DeepSeek-V2-Lite: 8 KB a context token, so 512 MB is 64K context tokens).
"""

from __future__ import annotations

import torch

from overnight.attention.metadata import AttentionMetadata
from overnight.kernels.latent_gather import latent_gather
from overnight.kernels.mla_prefill import MlaPrefillConfig, mla_prefill_attention

MAX_DECOMPRESSED_BYTES = 512 << 20


def kv_b_weight(w_uk: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """kv_b_proj's weight [H x (Dn + Dv), R] from its views W_UK [H, Dn, R] and W_UV [H, Dv, R]
    (split_kv_b): the weight itself when they are such views, else a copy of them interleaved per head."""
    heads, nope, rank = w_uk.shape
    width = nope + w_uv.shape[1]
    views = (
        w_uk.stride() == (width * rank, rank, 1)
        and w_uv.stride() == w_uk.stride()
        and w_uv.dtype == w_uk.dtype
        and w_uv.untyped_storage().data_ptr() == w_uk.untyped_storage().data_ptr()
        and w_uv.data_ptr() == w_uk.data_ptr() + nope * rank * w_uk.element_size()
    )
    if views:
        return w_uk.as_strided((heads * width, rank), (rank, 1))
    return torch.cat([w_uk, w_uv], dim=1).flatten(0, 1)


def prefill_groups(seq_lens_cpu: torch.Tensor, first: int, last: int, max_rows: int) -> list[tuple[int, int]]:
    """Requests first .. last - 1 in runs [i0, i1) of consecutive ones whose context lengths sum to at
    most max_rows (a longer request alone): one search per run, none per request."""
    ends = torch.cumsum(seq_lens_cpu[first:last].long(), 0)
    groups: list[tuple[int, int]] = []
    i0, done = first, 0
    while i0 < last:
        i1 = max(first + int(torch.searchsorted(ends, done + max_rows, right=True)), i0 + 1)
        groups.append((i0, i1))
        done, i0 = int(ends[i1 - first - 1]), i1
    return groups


def latent_prefill(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
    *,
    max_bytes: int = MAX_DECOMPRESSED_BYTES,
    config: MlaPrefillConfig | None = None,
) -> torch.Tensor:
    """latent_prefill_ref's result (mla.py) through the Triton kernels: causal attention of the prefill
    rows (num_decodes ..) over their requests' cached rows, returned as [T, H, Dv] in q's dtype with the
    decode rows and padding rows zero. kv_scale: an FP8 cache's (latent, rope) scales on the device."""
    heads, nope, rank = w_uk.shape
    v_dim, dtype = w_uv.shape[1], q_nope.dtype
    width = kv_cache.shape[-1]
    if q_nope.shape[1:] != (heads, nope) or q_pe.shape[:2] != q_nope.shape[:2]:
        raise ValueError(
            f"q_nope {tuple(q_nope.shape)} and q_pe {tuple(q_pe.shape)} do not fit W_UK {w_uk.shape}"
        )
    if w_uv.shape[0] != heads or w_uv.shape[2] != rank or width != rank + q_pe.shape[-1]:
        raise ValueError(f"W_UV {tuple(w_uv.shape)} and cache rows of {width} do not fit W_UK {w_uk.shape}")
    out = q_nope.new_zeros(q_nope.shape[0], heads, v_dim)
    nd, n = meta.num_decodes, meta.num_reqs
    if n <= nd:
        return out
    # Host copies the runner always sets (runner/inputs.py); without them one read each for the step.
    qsl = meta.query_start_loc_cpu if meta.query_start_loc_cpu is not None else meta.query_start_loc.cpu()
    sl = meta.seq_lens_cpu if meta.seq_lens_cpu is not None else meta.seq_lens.cpu()
    weight = kv_b_weight(w_uk, w_uv).to(dtype)
    token_bytes = (heads * (nope + v_dim) + width) * out.element_size()
    for i0, i1 in prefill_groups(sl, nd, n, max(1, max_bytes // token_bytes)):
        lens = sl[i0:i1]
        total, rows_q = int(lens.sum()), int(qsl[i1] - qsl[i0])
        if rows_q == 0:
            continue
        kv_loc = torch.zeros(i1 - i0 + 1, dtype=torch.int32, device=out.device)
        torch.cumsum(meta.seq_lens[i0:i1], 0, dtype=torch.int32, out=kv_loc[1:])
        rows = torch.empty(total, width, dtype=dtype, device=out.device)
        latent_gather(
            kv_cache,
            meta.block_tables,
            meta.seq_lens,
            kv_loc,
            i0,
            i1 - i0,
            int(lens.max()),
            rank,
            rows,
            kv_scale,
        )
        kv = torch.mm(rows[:, :rank], weight.t()).view(total, heads, nope + v_dim)
        mla_prefill_attention(
            q_nope,
            q_pe,
            kv[..., :nope],
            rows[:, rank:],
            kv[..., nope:],
            meta.query_start_loc,
            kv_loc,
            i0,
            i1 - i0,
            rows_q,
            scale,
            out,
            config,
        )
    return out
