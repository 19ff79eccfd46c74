"""What the attention layers see of one engine step: the flattened batch and the paged KV cache.

A step's query tokens are flattened into one list of T rows. Requests are ordered decodes first:

    rows  [0 ........ num_decodes) [num_decodes ............................... num_tokens)
          one query token each      prefill chunks (any length >= 1), request after request

Request i owns rows query_start_loc[i] .. query_start_loc[i+1]. Its context after this step holds
seq_lens[i] tokens, so query row j of request i sits at absolute position
seq_lens[i] - query_len[i] + j and attends (causally) to context positions 0 .. that position (or, with
key_limit, 0 .. key_limit[row]).

KV cache of one layer (one tensor, K and V stacked):

    kv_cache[2, num_blocks, block_size, num_kv_heads, head_dim]
             ^K/V  ^physical block id  ^slot in block

Token position p of request i lives in block block_tables[i, p // block_size], slot p % block_size,
i.e. flat slot  block * block_size + p % block_size. slot_mapping[row] gives that flat slot for each new
token of this step (-1 for padding rows, which must not be written).

With sliding-window layers the engine keeps several KV cache groups (engine/kv_groups.py): each group
has its own block_tables and slot_mapping (so one AttentionMetadata per group, the rest identical), and
several layers of different groups share one physical cache tensor (a block id belongs to one group at
a time). block_size above is the layer's page, kv_cache.shape[2]: a group of block scale k (its layers
need 1/k of the tensor's slot per token) has pages of k x the engine's block size, and its tables and
slot mapping count in those. A windowed group's table entries before the window hold ids of blocks already given back
(any contents): nothing may read positions outside a layer's window.

An FP8 cache stores K / k_scale and V / v_scale; the layer's (k_scale, v_scale) pair is a float32
device tensor of shape [2] (a row of the runner's kv_scales, see kv_quant.py), None for a cache that is
stored unscaled in the compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from overnight.attention.kv_quant import calibrate_kv_scale_
from overnight.attention.linear_state import LinearStateBatch
from overnight.attention.spec import FULL_ATTENTION, LayerAttention


@dataclass
class AttentionMetadata:
    num_reqs: int
    num_decodes: int  # the first num_decodes requests have exactly one query token
    num_tokens: int  # rows of q/k/v this step (padding included when a CUDA graph pads the batch)
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, on the model's device
    seq_lens: torch.Tensor  # [num_reqs] int32, context length after this step's tokens
    block_tables: torch.Tensor  # [num_reqs, max_blocks_per_req] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64, flat cache slot per row, -1 = do not write
    max_query_len: int
    max_seq_len: int
    # Host copies, so reference code and planners need no device sync.
    query_start_loc_cpu: torch.Tensor | None = None
    seq_lens_cpu: torch.Tensor | None = None
    # [num_tokens] int32 on the device: the last key position each row sees. None: causal (a row sees
    # up to its own position). A row inside an image whose tokens attend both ways (Gemma 3) sees up to
    # its image's last token, always in the same prefill chunk (the scheduler never splits one); a
    # sliding window still counts back from the row's own position. Only steps with such images set
    # it: decode steps (and the CUDA graphs) never do.
    key_limit: torch.Tensor | None = None

    @property
    def num_prefills(self) -> int:
        return self.num_reqs - self.num_decodes


class AttentionBackend(Protocol):
    """Writes this step's K/V into the paged cache, then attends. q: [T, Hq, D]; k, v: [T, Hkv, D].

    kv_scale: the layer's [2] float32 (k_scale, v_scale) of a quantized cache; None: no scaling.
    layer: the layer's window and softcap (spec.py); sinks: [Hq] float32 learned sink logits, or None.
    k and v None: the cache already holds this step's K/V (a layer that reads the cache of an earlier
    layer, as Gemma 4's KV-shared layers do): nothing is written.
    """

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
    ) -> torch.Tensor: ...

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
        """Latent attention (mla.py): writes this step's rows [T, R + P] into the one-plane cache, then
        attends. q_nope [T, H, Dn], q_pe [T, H, P] (rotated); w_uk [H, Dn, R], w_uv [H, Dv, R] (views of
        kv_b_proj's weight). kv_scale: an FP8 cache's [2] float32 (latent scale, rope scale), None for
        one in the compute dtype. Returns [T, H, Dv]."""
        ...


@dataclass
class AttentionBatch:
    """Passed to model.forward as an argument: the step's metadata, every layer's cache, the backend,
    and for an FP8 cache every layer's scales.

    kv_caches[layer] is the tensor holding that layer's cache (shared layers: their source's). With
    several KV cache groups, layer_group[layer] picks its metadata in group_metas, and layer_source[layer]
    the layer whose scales it reads; layer_group None: every layer reads `meta` (one group)."""

    meta: AttentionMetadata
    kv_caches: list[torch.Tensor]
    backend: AttentionBackend
    kv_scales: torch.Tensor | None = None  # [num_layers, 2] float32 (k_scale, v_scale); None: unscaled
    # Set each layer's scales from this step's K/V before they are written (one calibration step).
    calibrate_kv_scales: bool = False
    group_metas: list[AttentionMetadata] | None = None
    layer_group: tuple[int, ...] | None = None
    layer_source: tuple[int, ...] | None = None
    # Hybrid models: the linear-attention layers' per-request states (linear_state.py); None otherwise.
    states: LinearStateBatch | None = None

    def mla(
        self,
        layer_idx: int,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        rows: torch.Tensor,
        scale: float,
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
    ) -> torch.Tensor:
        """Latent attention of layer `layer_idx` (AttentionBackend.forward_mla); its layout is uniform
        (one group). An FP8 cache's row of kv_scales holds (latent scale, rope scale) (mla.py); a
        calibration step sets them from this step's latents and rotated keys before they are written."""
        cache = self.kv_caches[layer_idx]
        if self.kv_scales is None:
            return self.backend.forward_mla(q_nope, q_pe, rows, cache, self.meta, scale, w_uk, w_uv)
        kv_scale = self.kv_scales[layer_idx]  # a view: the pointer stays fixed for CUDA graphs
        if self.calibrate_kv_scales:
            n, rank = self.meta.num_tokens, w_uk.shape[2]
            calibrate_kv_scale_(kv_scale, rows[:n, :rank], rows[:n, rank:], cache.dtype)
        return self.backend.forward_mla(q_nope, q_pe, rows, cache, self.meta, scale, w_uk, w_uv, kv_scale)

    def __call__(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        scale: float,
        *,
        layer: LayerAttention = FULL_ATTENTION,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of layer `layer_idx`; k and v None: read the cache only (AttentionBackend)."""
        cache = self.kv_caches[layer_idx]
        meta, owner = self.meta, layer_idx
        if self.layer_group is not None:
            assert self.group_metas is not None and self.layer_source is not None
            meta, owner = self.group_metas[self.layer_group[layer_idx]], self.layer_source[layer_idx]
        if self.kv_scales is None:
            return self.backend.forward(q, k, v, cache, meta, scale, layer=layer, sinks=sinks)
        kv_scale = self.kv_scales[owner]  # a view: the pointer stays fixed for CUDA graphs
        if self.calibrate_kv_scales and k is not None and v is not None:
            n = meta.num_tokens
            calibrate_kv_scale_(kv_scale, k[:n], v[:n], cache.dtype)
        return self.backend.forward(q, k, v, cache, meta, scale, kv_scale, layer=layer, sinks=sinks)
