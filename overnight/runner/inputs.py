"""One step's model inputs, built on the host with numpy into reusable buffers.

On CUDA the host side is pinned memory, double-buffered (the copy of step N may still be in flight
while step N+1 is prepared), and the device side is one set of static tensors that CUDA graphs read.
Host work per step is a few vectorized passes plus one Python pass over the scheduled requests.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from overnight.attention.metadata import AttentionMetadata
from overnight.runner.logits_processors import build_logits_edits
from overnight.runner.request_state import RequestStates, RunnerRequest, ScheduledRequest
from overnight.runner.sampler import SamplingBatch


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64 (device)
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata  # of KV cache group 0
    group_metas: list[AttentionMetadata]  # per KV cache group ([0] is meta): its tables and slots
    sample_rows: torch.Tensor  # [S] rows of the hidden states whose logits are sampled
    sampled: list[RunnerRequest]  # the S requests, in row order
    pending_rows: torch.Tensor | None  # rows whose input id is a token still on the device
    pending_src: torch.Tensor | None  # index of that token in the previous step's samples


class _HostSet:
    """Host-side staging tensors (pinned on CUDA) and numpy views of them."""

    def __init__(self, max_tokens: int, max_reqs: int, max_blocks: int, num_groups: int, pin: bool) -> None:
        def alloc(shape, dtype):
            return torch.zeros(shape, dtype=dtype, pin_memory=pin)

        self.ids = alloc(max_tokens, torch.int64)
        self.pos = alloc(max_tokens, torch.int64)
        # Slot mappings of the step's rows, one run of num_rows per KV cache group, packed.
        self.slots = alloc(num_groups * max_tokens, torch.int64)
        self.qsl = alloc(max_reqs + 1, torch.int32)
        self.seq_lens = alloc(max_reqs, torch.int32)
        # Block-table rows of this step packed densely ([num_reqs, need]), so the host-to-device copy
        # is one contiguous transfer: a strided copy from host memory would make torch stage it through
        # pageable memory, which waits for the GPU and kills the overlap of host and device work.
        self.tables = alloc(num_groups * max_reqs * max_blocks, torch.int32)
        self.sample_rows = alloc(max_reqs, torch.int64)
        self.pending = alloc(2 * max_reqs, torch.int64)  # [rows | sources], packed the same way
        self.event: torch.cuda.Event | None = None  # set once this set's copies are enqueued


class StepBuffers:
    """Static device buffers of a step. With several KV cache groups (engine/kv_groups.py) each group
    has its own block tables, tables[g], and slot mapping: a step of num_rows rows packs them as

        slots  [ group 0: num_rows | group 1: num_rows | ... ]

    so a decode graph of b rows always reads group g's at slots[g * b : (g + 1) * b]. Group g's blocks
    hold group_block_sizes[g] tokens (kv_groups.py: block scales), its slots count in those."""

    def __init__(
        self,
        max_tokens: int,
        max_reqs: int,
        max_blocks: int,
        block_size: int,
        device: torch.device,
        num_groups: int = 1,
        group_block_sizes: tuple[int, ...] | None = None,  # None: block_size for every group
    ) -> None:
        self.device = device
        self.block_size = block_size
        sizes = group_block_sizes or (block_size,) * num_groups
        if len(sizes) != num_groups:
            raise ValueError(f"{len(sizes)} block sizes for {num_groups} KV cache groups")
        # Groups by block size: one slot computation per size ([0]: block_size for every group).
        by_size: dict[int, list[int]] = {}
        for g, bs in enumerate(sizes):
            by_size.setdefault(bs, []).append(g)
        self._sizes = [(bs, np.array(gs)) for bs, gs in by_size.items()]
        self.max_blocks = max_blocks
        self.num_groups = num_groups
        cuda = device.type == "cuda"
        self.hosts = [
            _HostSet(max_tokens, max_reqs, max_blocks, num_groups, cuda) for _ in range(2 if cuda else 1)
        ]
        self._turn = 0

        def dev(t: torch.Tensor) -> torch.Tensor:
            return torch.zeros_like(t, device=device) if cuda else t

        h = self.hosts[0]
        # Device-side static tensors (on CPU: the host tensors themselves).
        self.ids = dev(h.ids)
        self.pos = dev(h.pos)
        self.slots = dev(h.slots)
        self.qsl = dev(h.qsl)
        self.seq_lens = dev(h.seq_lens)
        # The graphs' block table keeps a fixed row stride (max_blocks); each step's packed rows land
        # in a staging tensor first and are spread into it by a device-side copy.
        self.tables = torch.zeros((num_groups, max_reqs, max_blocks), dtype=torch.int32, device=device)
        self.tables_staging = dev(h.tables)
        self.sample_rows = dev(h.sample_rows)
        self.pending = dev(h.pending)

    def build(
        self,
        scheduled: list[ScheduledRequest],
        states: RequestStates,
        prev_index: dict[str, int],
        pad_to: int | None = None,
    ) -> StepInputs:
        """scheduled: decodes first, RequestStates.begin() already applied (start/samples set).
        prev_index: request id -> row of the previous step's sampled tokens, for pending inputs.
        pad_to: a decode-only batch padded to a CUDA-graph size (padding rows write nothing)."""
        h = self.hosts[self._turn]
        self._turn = (self._turn + 1) % len(self.hosts)
        if h.event is not None:
            h.event.synchronize()  # its previous copies have long finished in practice
        bs = self.block_size
        num_reqs = len(scheduled)
        lens = np.fromiter((s.num_tokens for s in scheduled), dtype=np.int64, count=num_reqs)
        starts = np.fromiter((s.start for s in scheduled), dtype=np.int64, count=num_reqs)
        slots_of = np.fromiter((s.state.slot for s in scheduled), dtype=np.int64, count=num_reqs)
        qsl = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(lens, out=qsl[1:])
        num_tokens = int(qsl[-1])
        seq_lens = starts + lens

        ids = h.ids.numpy()
        pend_rows: list[int] = []
        pend_src: list[int] = []
        row = 0
        for s in scheduled:
            toks = s.state.token_ids
            end = s.start + s.num_tokens
            if end <= len(toks):
                if s.num_tokens == 1:
                    ids[row] = toks[s.start]
                else:
                    ids[row : row + s.num_tokens] = toks[s.start : end]
            else:  # the one token to compute was sampled by the previous step, still on the device
                assert s.num_tokens == 1 and s.start == len(toks), "only a decode input can be pending"
                ids[row] = 0
                pend_rows.append(row)
                pend_src.append(prev_index[s.state.req_id])
            row += s.num_tokens

        total = pad_to if pad_to is not None else num_tokens
        pos = h.pos.numpy()
        if num_reqs == num_tokens:  # decode only: one row per request
            pos[:num_tokens] = starts
        else:
            pos[:num_tokens] = np.arange(num_tokens) - np.repeat(qsl[:-1] - starts, lens)
        need = int((seq_lens.max() + bs - 1) // bs)
        groups = self.num_groups
        tables = states.block_table[:, slots_of, :need]  # [groups, num_reqs, need]
        row_req = np.repeat(np.arange(num_reqs), lens) if num_reqs != num_tokens else np.arange(num_reqs)
        p = pos[:num_tokens]
        num_rows = max(total, num_tokens)
        slot_np = h.slots.numpy()[: groups * num_rows].reshape(groups, num_rows)
        if len(self._sizes) == 1:
            gbs = self._sizes[0][0]
            slot_np[:, :num_tokens] = tables[:, row_req, p // gbs].astype(np.int64) * gbs + p % gbs
        else:
            for gbs, gs in self._sizes:
                slot_np[gs, :num_tokens] = (
                    tables[gs[:, None], row_req, p // gbs].astype(np.int64) * gbs + p % gbs
                )
        packed = h.tables.numpy()[: groups * num_reqs * need].reshape(groups, num_reqs, need)
        packed[:] = tables
        h.qsl.numpy()[: num_reqs + 1] = qsl
        h.seq_lens.numpy()[:num_reqs] = seq_lens
        if total > num_tokens:  # padding rows: position 0, no cache write, empty context
            ids[num_tokens:total] = 0
            pos[num_tokens:total] = 0
            slot_np[:, num_tokens:total] = -1
            h.seq_lens.numpy()[num_reqs:total] = 0
            h.qsl.numpy()[num_reqs + 1 : total + 1] = num_tokens
        req_rows = num_reqs if pad_to is None else total

        sampled = [s.state for s in scheduled if s.samples]
        sample_rows = qsl[1:][[i for i, s in enumerate(scheduled) if s.samples]] - 1
        h.sample_rows.numpy()[: len(sampled)] = sample_rows
        npend = len(pend_rows)
        if npend:
            h.pending.numpy()[:npend] = pend_rows
            h.pending.numpy()[npend : 2 * npend] = pend_src

        if self.device.type == "cuda":
            self.ids[:num_rows].copy_(h.ids[:num_rows], non_blocking=True)
            self.pos[:num_rows].copy_(h.pos[:num_rows], non_blocking=True)
            self.slots[: groups * num_rows].copy_(h.slots[: groups * num_rows], non_blocking=True)
            self.qsl[: req_rows + 1].copy_(h.qsl[: req_rows + 1], non_blocking=True)
            self.seq_lens[:req_rows].copy_(h.seq_lens[:req_rows], non_blocking=True)
            n = groups * num_reqs * need
            self.tables_staging[:n].copy_(h.tables[:n], non_blocking=True)
            self.sample_rows[: len(sampled)].copy_(h.sample_rows[: len(sampled)], non_blocking=True)
            if npend:
                self.pending[: 2 * npend].copy_(h.pending[: 2 * npend], non_blocking=True)
            h.event = torch.cuda.Event()
            h.event.record()
        rows = self.tables_staging[: groups * num_reqs * need].view(groups, num_reqs, need)
        self.tables[:, :num_reqs, :need].copy_(rows, non_blocking=True)

        # Host copies for planners that run during this step's launch (before this set is reused).
        qsl_cpu = h.qsl[: req_rows + 1]
        sl_cpu = h.seq_lens[:req_rows]
        meta = AttentionMetadata(
            num_reqs=req_rows,
            num_decodes=req_rows if num_reqs == num_tokens else _count_decodes(lens),
            num_tokens=num_rows,
            query_start_loc=self.qsl[: req_rows + 1],
            seq_lens=self.seq_lens[:req_rows],
            block_tables=self.tables[0, :req_rows],
            slot_mapping=self.slots[:num_rows],
            max_query_len=int(lens.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=sl_cpu,
        )
        return StepInputs(
            input_ids=self.ids[:num_rows],
            positions=self.pos[:num_rows],
            meta=meta,
            group_metas=self.group_metas(meta, num_rows, req_rows),
            sample_rows=self.sample_rows[: len(sampled)],
            sampled=sampled,
            pending_rows=self.pending[:npend] if npend else None,
            pending_src=self.pending[npend : 2 * npend] if npend else None,
        )

    def group_metas(self, meta: AttentionMetadata, num_rows: int, req_rows: int) -> list[AttentionMetadata]:
        """meta (group 0's) and, for every further KV cache group, the same with its own tables and
        slot mapping."""
        if self.num_groups == 1:
            return [meta]
        return [meta] + [
            replace(
                meta,
                block_tables=self.tables[g, :req_rows],
                slot_mapping=self.slots[g * num_rows : (g + 1) * num_rows],
            )
            for g in range(1, self.num_groups)
        ]


def _count_decodes(lens: np.ndarray) -> int:
    n = 0
    while n < len(lens) and lens[n] == 1:
        n += 1
    return n


def build_sampling_batch(
    reqs: list[RunnerRequest], eos_token_ids: tuple[int, ...], device: torch.device
) -> SamplingBatch:
    """Per-row sampling settings. An all-greedy batch with no extras (the common case of batch
    jobs) builds no tensors at all."""
    params = [r.params for r in reqs]
    all_greedy = all(p.is_greedy for p in params)
    asked = [p.sampled_logprobs is not None for p in params]
    any_logprobs = any(asked)
    pen_rows = [i for i, p in enumerate(params) if p.needs_penalties]
    banned = []
    for i, (r, p) in enumerate(zip(reqs, params)):
        if p.min_tokens and r.num_output_tokens < p.min_tokens:
            ids = list(p.stop_token_ids or []) + ([] if p.ignore_eos else list(eos_token_ids))
            if ids:
                banned.append((i, ids))
    if all_greedy:
        empty = torch.empty(0, device=device)
        batch = SamplingBatch(
            temperature=empty,
            top_k=empty,
            top_p=empty,
            min_p=empty,
            seeds=empty,
            positions=empty,
            all_greedy=True,
            any_top_k=False,
            any_top_p=False,
            any_min_p=False,
            max_logprobs=None,
        )
    else:
        greedy = [p.is_greedy for p in params]

        def dev(values: list, dtype: torch.dtype) -> torch.Tensor:
            # Pinned staging: a copy from pageable memory would wait for the GPU (no overlap).
            t = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
            return t.to(device, non_blocking=True)

        batch = SamplingBatch(
            temperature=dev([0.0 if g else p.temperature for g, p in zip(greedy, params)], torch.float32),
            top_k=dev([p.top_k for p in params], torch.int64),
            top_p=dev([p.top_p for p in params], torch.float32),
            min_p=dev([p.min_p for p in params], torch.float32),
            seeds=dev([r.seed for r in reqs], torch.int64),
            positions=dev([r.num_output_tokens for r in reqs], torch.int64),
            all_greedy=False,
            any_top_k=any(p.top_k > 0 for g, p in zip(greedy, params) if not g),
            any_top_p=any(p.top_p < 1.0 for g, p in zip(greedy, params) if not g),
            any_min_p=any(p.min_p > 0 for g, p in zip(greedy, params) if not g),
            max_logprobs=None,
            max_top_k=max(p.top_k for p in params),
            all_top_k=all(p.top_k > 0 for p in params),
        )
    if any_logprobs:
        batch.max_logprobs = max(p.sampled_logprobs or 0 for p in params)
        batch.wants_logprobs = asked
    if pen_rows:
        batch.penalty_rows = pen_rows
        batch.presence = torch.tensor([params[i].presence_penalty for i in pen_rows], device=device)
        batch.frequency = torch.tensor([params[i].frequency_penalty for i in pen_rows], device=device)
        batch.repetition = torch.tensor([params[i].repetition_penalty for i in pen_rows], device=device)
        batch.prompt_ids = [reqs[i].token_ids[: reqs[i].num_prompt_tokens] for i in pen_rows]
        batch.output_ids = [reqs[i].token_ids[reqs[i].num_prompt_tokens :] for i in pen_rows]
    batch.banned = banned or None
    batch.edits = build_logits_edits(reqs, device)
    return batch
