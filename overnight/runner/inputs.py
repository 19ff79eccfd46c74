"""Building one step's model inputs from the scheduled requests, vectorized with numpy so the host
work per step grows as little as possible with the batch."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from overnight.attention.metadata import AttentionMetadata
from overnight.runner.request_state import RunnerRequest, ScheduledRequest
from overnight.runner.sampler import SamplingBatch


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [S] rows of the hidden states whose logits are sampled
    sampled: list[RunnerRequest]  # the S requests, in row order


def build_step_inputs(
    scheduled: list[ScheduledRequest], block_size: int, device: torch.device
) -> StepInputs:
    """scheduled must list decodes (one token) first; see attention/metadata.py for the layout."""
    num_reqs = len(scheduled)
    lens = np.fromiter((s.num_tokens for s in scheduled), dtype=np.int64, count=num_reqs)
    starts = np.fromiter((s.state.num_computed_tokens for s in scheduled), dtype=np.int64, count=num_reqs)
    qsl = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(lens, out=qsl[1:])
    num_tokens = int(qsl[-1])
    seq_lens = starts + lens

    ids: list[int] = []
    for s in scheduled:
        st = s.state
        ids.extend(st.token_ids[st.num_computed_tokens : st.num_computed_tokens + s.num_tokens])
    req_of_row = np.repeat(np.arange(num_reqs), lens)
    positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(qsl[:-1] - starts, lens)

    width = max(len(s.state.block_ids) for s in scheduled)
    tables = np.zeros((num_reqs, width), dtype=np.int32)
    for i, s in enumerate(scheduled):
        b = s.state.block_ids
        tables[i, : len(b)] = b
    slots = tables[req_of_row, positions // block_size].astype(np.int64) * block_size + positions % block_size

    num_decodes = 0
    while num_decodes < num_reqs and lens[num_decodes] == 1:
        num_decodes += 1
    sample_idx = [i for i, s in enumerate(scheduled) if s.samples]
    sample_rows = qsl[1:][sample_idx] - 1

    qsl_t = torch.from_numpy(qsl.astype(np.int32))
    seq_t = torch.from_numpy(seq_lens.astype(np.int32))
    meta = AttentionMetadata(
        num_reqs=num_reqs,
        num_decodes=num_decodes,
        num_tokens=num_tokens,
        query_start_loc=qsl_t.to(device, non_blocking=True),
        seq_lens=seq_t.to(device, non_blocking=True),
        block_tables=torch.from_numpy(tables).to(device, non_blocking=True),
        slot_mapping=torch.from_numpy(slots).to(device, non_blocking=True),
        max_query_len=int(lens.max()),
        max_seq_len=int(seq_lens.max()),
        query_start_loc_cpu=qsl_t,
        seq_lens_cpu=seq_t,
    )
    return StepInputs(
        input_ids=torch.tensor(ids, dtype=torch.int64).to(device, non_blocking=True),
        positions=torch.from_numpy(positions).to(device, non_blocking=True),
        meta=meta,
        sample_rows=torch.from_numpy(sample_rows).to(device, non_blocking=True),
        sampled=[scheduled[i].state for i in sample_idx],
    )


def build_sampling_batch(
    reqs: list[RunnerRequest], eos_token_ids: tuple[int, ...], device: torch.device
) -> SamplingBatch:
    params = [r.params for r in reqs]
    greedy = [p.is_greedy for p in params]
    temperature = [0.0 if g else p.temperature for g, p in zip(greedy, params)]
    asked = [p.logprobs is not None for p in params]
    batch = SamplingBatch(
        temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
        top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
        top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
        min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
        seeds=torch.tensor([r.seed for r in reqs], dtype=torch.int64, device=device),
        positions=torch.tensor([r.num_output_tokens for r in reqs], dtype=torch.int64, device=device),
        all_greedy=all(greedy),
        any_top_k=any(p.top_k > 0 for g, p in zip(greedy, params) if not g),
        any_top_p=any(p.top_p < 1.0 for g, p in zip(greedy, params) if not g),
        any_min_p=any(p.min_p > 0 for g, p in zip(greedy, params) if not g),
        max_logprobs=max((p.logprobs or 0 for p in params if p.logprobs is not None), default=None)
        if any(asked)
        else None,
        wants_logprobs=asked if any(asked) else None,
    )
    rows = [i for i, p in enumerate(params) if p.needs_penalties]
    if rows:
        batch.penalty_rows = rows
        batch.presence = torch.tensor([params[i].presence_penalty for i in rows], device=device)
        batch.frequency = torch.tensor([params[i].frequency_penalty for i in rows], device=device)
        batch.repetition = torch.tensor([params[i].repetition_penalty for i in rows], device=device)
        batch.prompt_ids = [reqs[i].token_ids[: reqs[i].num_prompt_tokens] for i in rows]
        batch.output_ids = [reqs[i].token_ids[reqs[i].num_prompt_tokens :] for i in rows]
    banned = []
    for i, (r, p) in enumerate(zip(reqs, params)):
        if r.num_output_tokens < p.min_tokens:
            ids = list(p.stop_token_ids or []) + ([] if p.ignore_eos else list(eos_token_ids))
            if ids:
                banned.append((i, ids))
    batch.banned = banned or None
    return batch
