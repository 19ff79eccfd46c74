"""Decode steps as two half-batches whose CUDA graphs replay at once on two streams (--decode-overlap).

A large decode step is GEMMs (compute-bound) then attention (memory-bound), layer after layer, one
after the other. Split into two halves whose graphs replay concurrently, one half's attention can run
beside the other's GEMMs (the idea of "two-batch overlap", NanoFlow). Every bucket b >= SPLIT_FROM is
captured as two graphs over the runner's one set of StepBuffers, h = b // 2:

    rows      [ half 0: 0 .. h | half 1: h .. b ]          ids, pos, seq_lens, tables[g] alike
    slots     [ group 0: 0..h | h..b | group 1: b..b+h | b+h..2b | ... ]   (StepBuffers packs stride b)
    qsl       half 0: the step's own qsl[0 .. h]; half 1: a static arange 0 .. b - h (a decode-only
              step's rows are one query each, so its query starts are the row numbers)

Half 0 thus reads exactly what a single graph of b rows reads for its rows, so the sampled tokens are
the same as without the option. Each half's graph ends by copying its hidden states into its rows of
one preallocated [max bucket, hidden] output (a static address, no allocation per step; a copy of
b x hidden values, small beside the step), so replay returns a view, as a single graph does.

What two concurrent halves must not share: intermediate memory (each half is captured into a memory
pool of its own: half 0 shares the single graphs' pool, which never runs at the same time as it, half
1 has its own) and scratch that a forward writes outside its outputs and the KV cache. The audit:
the attention backend's split-decode workspace (Triton: used whenever num_decodes x KV heads is below
4 programs per SM and contexts may reach 1,024 tokens, e.g. a half of 128 rows of a model with 4 KV
heads) is given to half 1 separately (AttentionBackend.twin); cuBLAS's workspace is kept per stream,
so each half is captured on the stream it replays on (DecodeGraphs._capture_split). Rows never touch each other's KV slots (a slot belongs to one request).
LoRA's slot map and buffers, the hybrids' state-cache batch, latent attention's paths and
tensor-parallel all-reduces are whole-batch state or collectives and are refused with the option
(check_decode_overlap). Gemma 4's per-layer inputs, the MoE kernels' routing and GEMM buffers and
the FP8 activation scales are allocated inside each forward, so in each half's own pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from overnight.attention.metadata import AttentionMetadata
from overnight.config import EngineConfig
from overnight.errors import ConfigError
from overnight.runner.inputs import StepBuffers

# The smallest bucket captured as two halves: a smaller step's GEMMs are mostly weight reads, which two
# halves would each repeat, with little attention to hide behind them (a guess for the GPU to settle).
SPLIT_FROM = 256


def check_decode_overlap(config: EngineConfig) -> None:
    """Raise ConfigError naming the first setting decode_overlap cannot run with. The one check of the
    option, run when the configs are built (before any weight loads) and again by the runner."""
    if not config.runner.decode_overlap:
        return
    runner, arch, sched = config.runner, config.model.arch, config.scheduler

    def refuse(why: str) -> None:
        raise ConfigError(f"decode_overlap {why}")

    if not runner.device.startswith("cuda"):
        refuse(
            "needs CUDA graphs on a GPU (it replays each large decode step as two half-batch graphs on two "
            f"streams), but this engine runs on {runner.device!r}"
        )
    if runner.enforce_eager:
        refuse("needs CUDA graphs, which enforce_eager turns off: use one or the other")
    if config.model.runner == "pooling":
        refuse("splits decode steps, which a pooling runner never runs")
    if config.parallel.tensor_parallel_size > 1:
        refuse(
            "with tensor_parallel_size > 1 is not supported: the two halves' all-reduces on two streams "
            "could run in different orders on different ranks (data_parallel_size works)"
        )
    if config.lora is not None:
        refuse(
            "with enable_lora is not supported: LoRA's row-to-adapter map and buffers belong to the "
            "whole batch"
        )
    if arch.is_mla:
        refuse(f"with latent attention (MLA: {arch.architecture}) is not supported yet")
    if arch.num_linear_layers:
        refuse(
            f"with linear-attention or Mamba layers ({arch.architecture}) is not supported: their "
            "per-request states are handed to a step as one batch"
        )
    largest = min(runner.max_capture_batch_size, sched.max_num_seqs)
    if largest < SPLIT_FROM:
        refuse(
            f"splits decode batches of at least {SPLIT_FROM} requests, but at most {largest} run at once "
            f"(max_num_seqs {sched.max_num_seqs}): raise max_num_seqs or turn decode_overlap off"
        )


@dataclass(frozen=True)
class HalfInputs:
    """One half of a decode-only step of b rows: views of the runner's StepBuffers (no copies)."""

    rows: slice  # its rows of the step: [0, h) or [h, b)
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata  # of KV cache group 0
    group_metas: list[AttentionMetadata]  # per KV cache group ([0] is meta)


def split_rows(b: int) -> tuple[slice, slice]:
    h = b // 2
    return slice(0, h), slice(h, b)


def half_inputs(
    buffers: StepBuffers, b: int, half: int, max_model_len: int, arange: torch.Tensor
) -> HalfInputs:
    """Half `half` (0 or 1) of a decode-only step of b rows that StepBuffers.build packed (pad_to=b).
    arange: a static int32 0, 1, 2, ... of at least b - b // 2 + 1 entries on the buffers' device, half
    1's query starts. max_seq_len is max_model_len, as in a single graph (a captured launch cannot depend
    on the step's lengths)."""
    rows = split_rows(b)[half]
    lo, hi = rows.start, rows.stop
    n = hi - lo
    qsl = buffers.qsl[: n + 1] if half == 0 else arange[: n + 1]
    metas = [
        AttentionMetadata(
            num_reqs=n,
            num_decodes=n,
            num_tokens=n,
            query_start_loc=qsl,
            seq_lens=buffers.seq_lens[lo:hi],
            block_tables=buffers.tables[g, lo:hi],
            slot_mapping=buffers.slots[g * b + lo : g * b + hi],  # group g's run has stride b
            max_query_len=1,
            max_seq_len=max_model_len,
        )
        for g in range(buffers.num_groups)
    ]
    return HalfInputs(rows, buffers.ids[lo:hi], buffers.pos[lo:hi], metas[0], metas)


class SplitGraph:
    """A bucket's two half graphs, replayed concurrently; the same replay() as a torch CUDAGraph, so
    DecodeGraphs keeps one dictionary of both kinds."""

    def __init__(self, graphs: tuple[torch.cuda.CUDAGraph, torch.cuda.CUDAGraph], streams: tuple) -> None:
        self.graphs = graphs
        # Two side streams, created once and shared by every bucket; each half was captured on its own.
        self.streams = streams
        # Recorded anew each step (a wait waits for the latest record), so a replay creates no events.
        self._inputs_ready = torch.cuda.Event()
        self._halves_done = (torch.cuda.Event(), torch.cuda.Event())

    def replay(self) -> None:
        # Each side stream starts after the step's inputs are on the device (the current stream copied
        # them); the current stream goes on (logits, sampling, the next step's copies) after both.
        main = torch.cuda.current_stream()
        self._inputs_ready.record(main)
        for stream, graph, done in zip(self.streams, self.graphs, self._halves_done):
            stream.wait_event(self._inputs_ready)
            with torch.cuda.stream(stream):
                graph.replay()
            done.record(stream)
        for done in self._halves_done:
            main.wait_event(done)
