"""Paged attention over a step's flattened batch: decode rows to paged_decode, the rest to paged_prefill.

Reference: paged_attention_ref in overnight/attention/torch_backend.py (layouts in metadata.py).
"""

from __future__ import annotations

import torch

from overnight.attention.metadata import AttentionMetadata
from overnight.kernels.paged_decode import DecodeConfig, DecodeWorkspace, choose_num_splits, paged_decode
from overnight.kernels.paged_prefill import PrefillConfig, paged_prefill


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    kv_scale: torch.Tensor | None = None,
    num_splits: int | None = None,
    max_model_len: int | None = None,
    workspace: DecodeWorkspace | None = None,
    decode_config: DecodeConfig | None = None,
    prefill_config: PrefillConfig | None = None,
) -> torch.Tensor:
    """Attention of every query row over its request's cached context; q, out: [T, Hq, D].

    num_splits (decode only) defaults to choose_num_splits(num_decodes, Hkv, max_model_len or
    meta.max_seq_len); pass it explicitly (and a preallocated workspace) under CUDA-graph capture.
    kv_scale: [2] float32 (k_scale, v_scale) of an fp8 cache, on the device; None: unscaled.
    Rows owned by no request (CUDA-graph padding) are not written: nothing here may depend on where the
    real rows end, or a captured graph would bake in one step's count.
    """
    if out is None:
        out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd > 0:
        if num_splits is None:
            num_splits = choose_num_splits(nd, kv_cache.shape[3], max_model_len or meta.max_seq_len)
        paged_decode(
            q,
            kv_cache,
            meta.block_tables,
            meta.seq_lens,
            nd,
            scale,
            out,
            num_splits=num_splits,
            workspace=workspace,
            kv_scale=kv_scale,
            config=decode_config,
        )
    if meta.num_prefills > 0:
        if meta.query_start_loc_cpu is not None:
            prefill_rows = int(meta.query_start_loc_cpu[meta.num_reqs]) - int(meta.query_start_loc_cpu[nd])
        else:
            prefill_rows = meta.num_tokens - nd  # an upper bound: rows of decodes come first
        paged_prefill(
            q,
            kv_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            nd,
            meta.num_reqs,
            prefill_rows,
            scale,
            out,
            kv_scale=kv_scale,
            config=prefill_config,
        )
    return out
