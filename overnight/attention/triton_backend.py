"""The GPU attention backend: Triton kernels for the KV write and paged attention (decode rows to
paged_decode, the rest to paged_prefill; reference: paged_attention_ref in torch_backend.py).

Same contract as TorchAttentionBackend in torch_backend.py (its reference): forward writes this step's
K/V into the layer's cache, then attends. Everything a launch depends on besides device tensors is
static per batch size (num_tokens, num_decodes, and num_splits derived from them, max_model_len and the
layer's window), and the split-decode workspace is allocated once here, so a decode step can be
captured in a CUDA graph. A layer's window and softcap pick a kernel variant (compiled once per layer
kind, kernels/score_mods.py); its sinks travel as a device pointer.
"""

from __future__ import annotations

import logging

import torch

from overnight.attention.metadata import AttentionMetadata
from overnight.attention.mla import (
    absorb_query,
    latent_attention_ref,
    mla_decode_supported,
    row_contexts,
    write_latent_ref,
)
from overnight.attention.mla_prefill import latent_prefill
from overnight.attention.spec import FULL_ATTENTION, LayerAttention
from overnight.kernels.kv_write import kv_write
from overnight.kernels.mla_decode import latent_write, mla_decode, mla_rows
from overnight.kernels.paged_decode import DecodeConfig, DecodeWorkspace, choose_num_splits, paged_decode
from overnight.kernels.paged_prefill import PrefillConfig, paged_prefill

log = logging.getLogger("overnight")


class TritonAttentionBackend:
    """Implements the AttentionBackend protocol of metadata.py.

    An fp8 cache comes with forward's kv_scale (the layer's (k_scale, v_scale) on the device; the
    cache holds k / k_scale), read by the kernels through a pointer so captured graphs see new values.
    decode_config None: the kernel's default for the cache dtype (and head_dim).
    num_heads, head_dim: the model's query heads and head size, which size the split workspace; a
    layer with other ones (Gemma 4's global layers: 512-wide heads) gets a workspace of its own.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        max_num_seqs: int,
        max_model_len: int,
        device: torch.device | str,
        num_sms: int | None = None,
        decode_config: DecodeConfig | None = None,
        prefill_config: PrefillConfig | None = None,
        mla_prefill_kernel: bool = False,
    ) -> None:
        device = torch.device(device)
        if num_sms is None:
            num_sms = (
                torch.cuda.get_device_properties(device).multi_processor_count
                if device.type == "cuda"
                else 132
            )
        self.num_kv_heads = num_kv_heads
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.num_sms = num_sms
        self.decode_config = decode_config
        self.prefill_config = prefill_config
        # Splitting only happens for small batches, so the workspace is sized by the largest
        # num_decodes * num_splits over all batch sizes, not by max_num_seqs * MAX_SPLITS.
        # A windowed layer's splits share at most its window (num_splits(b, window) <= num_splits(b)).
        split_rows = [b * self.num_splits(b) for b in range(1, max_num_seqs + 1) if self.num_splits(b) > 1]
        self.device = device
        self.max_split_rows = max(split_rows, default=0)
        self.workspace = DecodeWorkspace(self.max_split_rows, num_heads, head_dim, device)
        self._workspaces = {(num_heads, head_dim): self.workspace}
        self._mla_logged = False
        self.mla_prefill_kernel = mla_prefill_kernel  # attention/variants.py's mla-prefill-kernel

    def workspace_for(self, num_heads: int, head_dim: int) -> DecodeWorkspace:
        """The split workspace of layers with these head counts and sizes. One the constructor did not
        make is allocated the first time such a layer decodes, eagerly (cuda_graph.py runs each batch
        size once before capturing it), and is kept for good, so a captured graph's pointer stays."""
        ws = self._workspaces.get((num_heads, head_dim))
        if ws is None:
            ws = DecodeWorkspace(self.max_split_rows, num_heads, head_dim, self.device)
            self._workspaces[(num_heads, head_dim)] = ws
        return ws

    def num_splits(self, num_decodes: int, window: int | None = None, chunk: int | None = None) -> int:
        """Splits per decode: static per batch size and layer kind. A windowed (chunked) layer reads at
        most its window (chunk) plus part of a page per request, so its splits are chosen for that
        length."""
        return choose_num_splits(
            num_decodes, self.num_kv_heads, _read_len(self.max_model_len, window, chunk), self.num_sms
        )

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
        if meta.num_decodes > self.max_num_seqs:
            raise ValueError(f"{meta.num_decodes} decodes exceed max_num_seqs={self.max_num_seqs}")
        if k is not None and v is not None:  # None: a layer reading another layer's cache
            kv_write(k, v, kv_cache, meta.slot_mapping, kv_scale)
        return paged_attention(
            q,
            kv_cache,
            meta,
            scale,
            kv_scale=kv_scale,
            num_splits=self.num_splits(meta.num_decodes, layer.sliding_window, layer.attention_chunk),
            workspace=self.workspace_for(q.shape[1], q.shape[2]),
            decode_config=self.decode_config,
            prefill_config=self.prefill_config,
            layer=layer,
            sinks=sinks,
        )

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
        """Latent attention (attention/mla.py): the rows written and the decodes attended by the Triton
        kernels of kernels/mla_decode.py (captured in decode graphs); prefill chunks decompressed and
        attended all at once by attention/mla_prefill.py's kernels (eager steps only). Widths the decode
        kernel does not take run wholly on the PyTorch path, eagerly (model_runner.capture_graphs), with
        one log line. kv_scale: an FP8 cache's (latent,
        rope) scales on the device, read by every path."""
        rank = w_uk.shape[2]
        if not mla_decode_supported(rank, q_pe.shape[-1]):
            if not self._mla_logged:
                self._mla_logged = True
                log.warning(
                    "latent attention of widths %d + %d has no Triton kernel: the PyTorch path runs, "
                    "without CUDA graphs",
                    rank,
                    q_pe.shape[-1],
                )
            write_latent_ref(rows, kv_cache, meta.slot_mapping, kv_scale, rank)
            return latent_attention_ref(q_nope, q_pe, kv_cache, meta, scale, w_uk, w_uv, kv_scale)
        latent_write(rows, kv_cache, meta.slot_mapping, kv_scale, rank)
        nd = meta.num_decodes
        if meta.num_prefills and self.mla_prefill_kernel:  # every row absorbed, in one launch
            row_req, row_lens = row_contexts(meta, q_nope.shape[0])
            q_lat = absorb_query(q_nope, q_pe, w_uk)
            o_lat = mla_rows(q_lat, kv_cache, meta.block_tables, row_req, row_lens, scale, rank, kv_scale)
            return torch.einsum("thr,hvr->thv", o_lat, w_uv)
        if meta.num_prefills:  # batched and decompressed (attention/mla_prefill.py)
            out = latent_prefill(q_nope, q_pe, kv_cache, meta, scale, w_uk, w_uv, kv_scale)
        else:
            out = q_nope.new_empty(q_nope.shape[0], w_uv.shape[0], w_uv.shape[1])
        if nd:
            q_lat = absorb_query(q_nope[:nd], q_pe[:nd], w_uk)
            o_lat = mla_decode(q_lat, kv_cache, meta.block_tables, meta.seq_lens, scale, rank, nd, kv_scale)
            out[:nd] = torch.einsum("thr,hvr->thv", o_lat, w_uv)
        return out


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
    layer: LayerAttention = FULL_ATTENTION,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of every query row over its request's cached context; q, out: [T, Hq, D].

    num_splits (decode only) defaults to choose_num_splits(num_decodes, Hkv, max_model_len or
    meta.max_seq_len); pass it explicitly (and a preallocated workspace) under CUDA-graph capture.
    kv_scale: [2] float32 (k_scale, v_scale) of an fp8 cache, on the device; None: unscaled.
    Rows owned by no request (CUDA-graph padding) are not written: nothing here may depend on where the
    real rows end, or a captured graph would bake in one step's count.
    layer: the window, chunk and softcap (spec.py); sinks: [Hq] float32 sink logits on q's device, or None.
    """
    window, softcap, chunk = layer.sliding_window, layer.logit_softcap, layer.attention_chunk
    if out is None:
        out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd > 0:
        if num_splits is None:
            length = _read_len(max_model_len or meta.max_seq_len, window, chunk)
            num_splits = choose_num_splits(nd, kv_cache.shape[3], length)
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
            window=window,
            softcap=softcap,
            sinks=sinks,
            chunk=chunk,
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
            window=window,
            softcap=softcap,
            sinks=sinks,
            key_limit=meta.key_limit,
            chunk=chunk,
        )
    return out


def _read_len(length: int, window: int | None, chunk: int | None) -> int:
    """The most context tokens a decode row of the layer reads: a window or chunk bounds it."""
    for bound in (window, chunk):
        if bound is not None:
            length = min(length, bound)
    return length
