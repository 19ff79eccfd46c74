"""CUDA graphs of decode-only forward passes, one per batch-size bucket, captured once at start-up.

A decode step of a large model is hundreds of small kernel launches; replaying a graph issues them in
one call. The graphs read the runner's static device buffers (StepBuffers: ids, positions, the slot
mapping and block tables of every KV cache group, sequence lengths), so a replay only needs those
filled: a batch of B decodes runs in the smallest bucket b >= B, with rows B..b padded (position 0, no
cache write, empty context).
Everything a captured launch depends on besides those tensors (num_splits of the decode kernel, the
split workspace) is fixed per bucket.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from overnight.attention.metadata import AttentionBatch, AttentionMetadata
from overnight.models.interface import CausalLM
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
    ) -> None:
        self.model = model
        # The runner's: backend, FP8 scales (read in place by the captured kernels: new values need no
        # recapture) and which KV cache group each layer reads.
        self.attention_batch = attention_batch
        self.kv_caches = kv_caches
        self.buffers = buffers
        self.max_model_len = max_model_len
        self.sizes = bucket_sizes(max_batch)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

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
        pool = torch.cuda.graph_pool_handle()  # one memory pool for every graph
        for b in sorted(self.sizes, reverse=True):  # largest first: smaller ones reuse its memory
            self._forward(b)  # warm-up: compiles kernels outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(b)
            self.graphs[b] = graph
            self.outputs[b] = out
        torch.cuda.synchronize()
        log.info(
            "captured %d decode CUDA graphs (batch 1..%d) in %.1f s",
            len(self.sizes),
            n,
            time.perf_counter() - start,
        )

    def replay(self, b: int) -> torch.Tensor:
        self.graphs[b].replay()
        return self.outputs[b]
