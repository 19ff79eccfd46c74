"""CUDA graphs of decode-only forward passes, one per batch-size bucket, captured once at start-up.

A decode step of a large model is hundreds of small kernel launches; replaying a graph issues them in
one call. The graphs read the runner's static device buffers (StepBuffers: ids, positions, the slot
mapping and block tables of every KV cache group, sequence lengths), so a replay only needs those
filled: a batch of B decodes runs in the smallest bucket b >= B, with rows B..b padded (position 0, no
cache write, empty context).
Everything a captured launch depends on besides those tensors (num_splits of the decode kernel, the
split workspace) is fixed per bucket.
With split_from set (--decode-overlap), buckets from that size up are captured as two half graphs that
replay concurrently on two streams (decode_overlap.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from overnight.attention.metadata import AttentionBackend, AttentionBatch, AttentionMetadata
from overnight.models.interface import CausalLM
from overnight.runner.decode_overlap import SplitGraph, half_inputs, split_rows
from overnight.runner.inputs import StepBuffers

log = logging.getLogger("overnight")


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64, every 16 up to 256, every 32 beyond."""
    sizes = [1, 2, 4]
    b = 8
    while b <= max_batch:
        sizes.append(b)
        b += 8 if b < 64 else 16 if b < 256 else 32
    sizes = [s for s in sizes if s <= max_batch]
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        attention_batch: Callable[
            [AttentionMetadata, list[AttentionMetadata], list[torch.Tensor]], AttentionBatch
        ],
        kv_caches: list[torch.Tensor],
        buffers: StepBuffers,
        max_batch: int,
        max_model_len: int,
        split_from: int | None = None,  # None: every bucket one graph
        second_backend: AttentionBackend | None = None,  # half 1's (AttentionBackend.twin); None: the same
    ) -> None:
        self.model = model
        # The runner's: backend, FP8 scales (read in place by the captured kernels: new values need no
        # recapture) and which KV cache group each layer reads.
        self.attention_batch = attention_batch
        self.kv_caches = kv_caches
        self.buffers = buffers
        self.max_model_len = max_model_len
        self.sizes = bucket_sizes(max_batch)
        self.graphs: dict[int, torch.cuda.CUDAGraph | SplitGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.split_from = split_from
        self.second_backend = second_backend
        # Half 1's query starts (decode_overlap.half_inputs) and the split buckets' one output.
        self._arange: torch.Tensor | None = None
        if split_from is not None:
            self._arange = torch.arange(max_batch + 1, dtype=buffers.qsl.dtype, device=buffers.qsl.device)
        self._split_out: torch.Tensor | None = None

    def bucket_for(self, batch: int) -> int | None:
        for size in self.sizes:
            if size >= batch:
                return size
        return None

    def _meta(self, b: int) -> AttentionMetadata:
        buf = self.buffers
        return AttentionMetadata(
            num_reqs=b,
            num_decodes=b,
            num_tokens=b,
            query_start_loc=buf.qsl[: b + 1],
            seq_lens=buf.seq_lens[:b],
            block_tables=buf.tables[0, :b],
            slot_mapping=buf.slots[:b],
            max_query_len=1,
            max_seq_len=self.max_model_len,
        )

    def _forward(self, b: int) -> torch.Tensor:
        meta = self._meta(b)
        attn = self.attention_batch(meta, self.buffers.group_metas(meta, b, b), self.kv_caches)
        return self.model(self.buffers.ids[:b], self.buffers.pos[:b], attn)

    def is_split(self, b: int) -> bool:
        return self.split_from is not None and b >= self.split_from

    def _forward_half(self, b: int, half: int) -> torch.Tensor:
        """The hidden states of half `half` (0: rows [0, b // 2), 1: the rest) of a bucket of b rows."""
        assert self._arange is not None, "a bucket split without split_from"
        x = half_inputs(self.buffers, b, half, self.max_model_len, self._arange)
        attn = self.attention_batch(x.meta, x.group_metas, self.kv_caches)
        if half == 1 and self.second_backend is not None:
            attn = replace(attn, backend=self.second_backend)
        return self.model(x.input_ids, x.positions, attn)

    def _capture_split(self, b: int, pools: tuple, streams: tuple) -> None:
        """Bucket b as two graphs in separate pools (they run at the same time), each ending with a copy
        of its hidden states into its rows of the shared output."""
        graphs = []
        for half, (rows, pool, stream) in enumerate(zip(split_rows(b), pools, streams)):
            # Warm-up (compiles kernels, makes half 1's split workspaces) and capture on the stream the
            # half replays on: cuBLAS keeps a workspace per stream, so the halves' GEMMs get their own.
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                hidden = self._forward_half(b, half)
            if self._split_out is None:  # sized by the largest bucket, captured first
                self._split_out = torch.empty(
                    (max(self.sizes), hidden.shape[-1]), dtype=hidden.dtype, device=hidden.device
                )
            out = self._split_out
            del hidden
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                out[rows].copy_(self._forward_half(b, half))
            graphs.append(graph)
        assert self._split_out is not None
        self.graphs[b] = SplitGraph((graphs[0], graphs[1]), streams)
        self.outputs[b] = self._split_out[:b]

    @torch.inference_mode()
    def capture(self) -> None:
        buf = self.buffers
        n = max(self.sizes)
        # Harmless contents while capturing: one-token contexts in block 0, no cache writes.
        buf.ids[:n].zero_()
        buf.pos[:n].zero_()
        buf.slots[: buf.num_groups * n].fill_(-1)
        buf.seq_lens[:n].fill_(1)
        buf.tables[:, :n].zero_()
        buf.qsl[: n + 1].copy_(torch.arange(n + 1, dtype=buf.qsl.dtype, device=buf.qsl.device))
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()  # one memory pool for every graph (but split halves 1)
        if self.split_from is not None:
            pools = (pool, torch.cuda.graph_pool_handle())
            device = buf.ids.device
            streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        for b in sorted(self.sizes, reverse=True):  # largest first: smaller ones reuse its memory
            if self.is_split(b):
                self._capture_split(b, pools, streams)
                continue
            self._forward(b)  # warm-up: compiles kernels outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(b)
            self.graphs[b] = graph
            self.outputs[b] = out
        torch.cuda.synchronize()
        split = [b for b in self.sizes if self.is_split(b)]
        log.info(
            "captured %d decode CUDA graphs (batch 1..%d%s) in %.1f s",
            len(self.sizes),
            n,
            f"; {len(split)} from {split[0]} up as two concurrent halves" if split else "",
            time.perf_counter() - start,
        )

    def replay(self, b: int) -> torch.Tensor:
        self.graphs[b].replay()
        return self.outputs[b]
