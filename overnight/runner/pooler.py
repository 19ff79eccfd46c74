"""The runner's pooling step: a pooling request's prompt may be computed over several steps (chunked
prefill), so what its pooling needs is carried from chunk to chunk here, and the vector is made in the
step that computes its last token:

    LAST  the last token's hidden state (only the final chunk matters)
    CLS   the first token's state, kept from the first chunk
    MEAN  the running fp32 sum of the chunks' states, divided by the prompt length at the end

A preempted request loses what was carried (the runner drops its state) and starts over, as its KV does.
The arithmetic is layers/pooler.py's, to which tests compare this. A decoder sequence classifier pools
the last token and runs its head (`classify`) and activation on those rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from overnight.config import PoolerConfig
from overnight.engine.step_io import ModelRunnerOutput
from overnight.layers.pooler import classifier_head, embedding_head, split_rows, to_device
from overnight.runner.request_state import RunnerRequest, ScheduledRequest


class ChunkedPooler:
    def __init__(
        self,
        config: PoolerConfig,
        device: torch.device,
        classify: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """classify: a sequence classifier's head, last-token states [P, H] -> logits [P, labels]
        float32 (config.classifier says how they become scores)."""
        assert (classify is None) == (config.classifier is None), "a classifier pools through its head"
        self.config = config
        self.device = device
        self.classify = classify
        self.carried: dict[str, torch.Tensor] = {}  # CLS: the first state; MEAN: the sum so far

    def drop(self, req_ids: set[str]) -> None:
        for rid in req_ids:
            self.carried.pop(rid, None)

    def pool(
        self, scheduled: list[ScheduledRequest], hidden: torch.Tensor, query_start_loc: np.ndarray
    ) -> tuple[list[RunnerRequest], torch.Tensor]:
        """The requests whose prompt ends this step, and their embeddings [P, H] (head applied).
        scheduled is in row order; query_start_loc [len(scheduled) + 1] on the host."""
        kind = self.config.pooling_type
        done = [i for i, s in enumerate(scheduled) if s.samples]
        if kind == "LAST":
            rows = hidden[to_device(query_start_loc[1:][done] - 1, hidden.device)].float()
        elif kind == "CLS":
            rows = self._cls(scheduled, hidden, query_start_loc, done)
        else:
            rows = self._mean(scheduled, hidden, query_start_loc, done)
        finished = [scheduled[i].state for i in done]
        classifier = self.config.classifier
        if classifier is not None and self.classify is not None:
            active = [r.pooling is None or r.pooling.use_activation is not False for r in finished]
            return finished, classifier_head(self.classify(rows), classifier.activation, active)
        dims = [r.pooling.dimensions if r.pooling else None for r in finished]
        norm = self._normalize(finished)
        return finished, embedding_head(rows, dims, norm)

    def _normalize(self, reqs: list[RunnerRequest]) -> list[bool]:
        default = self.config.normalize
        return [
            default if r.pooling is None or r.pooling.normalize is None else r.pooling.normalize for r in reqs
        ]

    def _cls(
        self, scheduled: list[ScheduledRequest], hidden: torch.Tensor, qsl: np.ndarray, done: list[int]
    ) -> torch.Tensor:
        for i, s in enumerate(scheduled):
            if s.start == 0:  # this chunk holds the first token
                self.carried[s.state.req_id] = hidden[int(qsl[i])].float()
        if not done:
            return hidden.new_empty(0, hidden.shape[1], dtype=torch.float32)
        return torch.stack([self.carried.pop(scheduled[i].state.req_id) for i in done])

    def _mean(
        self, scheduled: list[ScheduledRequest], hidden: torch.Tensor, qsl: np.ndarray, done: list[int]
    ) -> torch.Tensor:
        lens = np.diff(qsl)
        seq_of_row = to_device(np.repeat(np.arange(len(scheduled)), lens), hidden.device)
        sums = hidden.new_zeros(len(scheduled), hidden.shape[1], dtype=torch.float32)
        sums.index_add_(0, seq_of_row, hidden.float())
        finishing = set(done)
        for i, s in enumerate(scheduled):
            rid = s.state.req_id
            prior = self.carried.pop(rid, None)
            if prior is not None:
                sums[i] += prior
            if i not in finishing:
                self.carried[rid] = sums[i].clone()
        counts = to_device([scheduled[i].state.num_prompt_tokens for i in done], hidden.device)
        return sums[to_device(done, hidden.device, np.int64)] / counts[:, None].to(torch.float32)


@dataclass
class PooledStep:
    """A launched pooling step; result() waits for its vectors on the host (once; then cached)."""

    req_ids: list[str]
    rows: torch.Tensor  # on the host: pinned and filled asynchronously on CUDA
    dimensions: list[int | None]
    event: torch.cuda.Event | None
    _result: ModelRunnerOutput | None = None

    @classmethod
    def launch(cls, finished: list[RunnerRequest], rows: torch.Tensor) -> PooledStep:
        dims = [r.pooling.dimensions if r.pooling else None for r in finished]
        ids = [r.req_id for r in finished]
        if not rows.is_cuda:
            return cls(ids, rows, dims, None)
        host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
        host.copy_(rows, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return cls(ids, host, dims, event)

    def result(self) -> ModelRunnerOutput:
        if self._result is None:
            if self.event is not None:
                self.event.synchronize()
            vectors = split_rows(self.rows, self.dimensions)
            self._result = ModelRunnerOutput([], [], pooled_req_ids=self.req_ids, pooled=vectors)
        return self._result
