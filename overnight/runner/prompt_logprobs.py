"""Logprobs of prompt tokens (SamplingParams.prompt_logprobs), from the hidden states of the prefill
chunks that compute them.

The hidden state at position j predicts token j + 1. A chunk computing positions [s, e) of a prompt of
P tokens therefore scores prompt tokens s + 1 .. min(e, P - 1); the hidden state of position P - 1
predicts the first output token, which is the sample, not a prompt logprob. Chunks arrive in order and
the output processor keeps each position once, so chunked prefill and a recompute after preemption
need nothing special. A prefix-cache hit would skip positions, so a request that asks for prompt
logprobs takes none (KVCacheManager.find_cached_prefix).

Memory stays bounded whatever the prompt length: logits are formed a few rows at a time (at most
_LOGITS_BYTES of float32) and reduced at once to the actual token's logprob and rank and the top-k, which
stay on the device until the step's result is read (no host sync of their own).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from overnight.engine.step_io import PromptTokenLogprobs
from overnight.runner.request_state import ScheduledRequest

_LOGITS_BYTES = 256 * 2**20


@dataclass
class PendingPromptLogprobs:
    """One request's prompt logprobs of one step, still on the device."""

    req_id: str
    start: int  # position of the first prompt token scored
    logprob: torch.Tensor  # [T] of the actual prompt token
    rank: torch.Tensor  # [T]
    top_ids: torch.Tensor  # [T, k]
    top_logprobs: torch.Tensor  # [T, k]

    def to_host(self) -> PromptTokenLogprobs:
        return PromptTokenLogprobs(
            start=self.start,
            logprobs=self.logprob.tolist(),
            ranks=self.rank.tolist(),
            top_ids=self.top_ids.tolist(),
            top_logprobs=self.top_logprobs.tolist(),
        )


def wants_prompt_logprobs(scheduled: list[ScheduledRequest]) -> bool:
    return any(s.state.params.prompt_logprobs is not None for s in scheduled)


def compute_prompt_logprobs(
    hidden: torch.Tensor,
    scheduled: list[ScheduledRequest],
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    vocab_size: int,
) -> list[PendingPromptLogprobs]:
    """hidden: [rows, H] of a step whose rows are `scheduled`'s tokens in order (after
    RequestStates.begin). Every rank of a tensor-parallel group calls this alike (compute_logits
    gathers across them)."""
    out: list[PendingPromptLogprobs] = []
    rows_per_piece = max(1, _LOGITS_BYTES // (4 * vocab_size))
    row = 0
    for s in scheduled:
        st = s.state
        first_row, row = row, row + s.num_tokens
        k = st.params.prompt_logprobs
        if k is None:
            continue
        end = min(s.start + s.num_tokens, st.num_prompt_tokens - 1)
        count = end - s.start
        if count <= 0:
            continue
        targets = torch.tensor(st.token_ids[s.start + 1 : end + 1], dtype=torch.int64).to(
            hidden.device, non_blocking=True
        )
        pieces = [
            _score(compute_logits(hidden[first_row + a : first_row + b]), targets[a:b], k)
            for a in range(0, count, rows_per_piece)
            for b in [min(a + rows_per_piece, count)]
        ]
        logprob, rank, top_ids, top_lps = (torch.cat(parts) for parts in zip(*pieces))
        out.append(PendingPromptLogprobs(st.req_id, s.start + 1, logprob, rank, top_ids, top_lps))
    return out


def _score(
    logits: torch.Tensor, targets: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    lp = logits.float().log_softmax(dim=-1)
    actual = lp.gather(1, targets[:, None])[:, 0]
    rank = (lp > actual[:, None]).sum(dim=1) + 1
    if k > 0:
        top = torch.topk(lp, min(k, lp.shape[1]), dim=1)
        return actual, rank, top.indices, top.values
    empty = torch.empty(len(targets), 0, device=lp.device)
    return actual, rank, empty.long(), empty
