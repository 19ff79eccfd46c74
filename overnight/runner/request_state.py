"""The runner's own copy of each running request, kept up to date from SchedulerOutput diffs."""

from __future__ import annotations

from dataclasses import dataclass

from overnight.engine.step_io import SchedulerOutput
from overnight.sampling_params import SamplingParams


@dataclass(slots=True, eq=False)
class RunnerRequest:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    seed: int
    block_ids: list[int]
    num_computed_tokens: int

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass(slots=True)
class ScheduledRequest:
    state: RunnerRequest
    num_tokens: int  # tokens computed this step, starting at state.num_computed_tokens

    @property
    def samples(self) -> bool:
        """The step reaches the end of the known tokens, so its last row's logits are sampled."""
        return self.state.num_computed_tokens + self.num_tokens >= len(self.state.token_ids)


class RequestStates:
    def __init__(self) -> None:
        self.reqs: dict[str, RunnerRequest] = {}

    def apply(self, out: SchedulerOutput) -> list[ScheduledRequest]:
        """Fold one step's diff into the states; return the scheduled requests, decodes (one token)
        first, as the attention metadata requires, otherwise in schedule order."""
        for rid in out.finished_req_ids:
            self.reqs.pop(rid, None)
        for new in out.new_reqs:
            self.reqs[new.req_id] = RunnerRequest(
                req_id=new.req_id,
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                params=new.params,
                seed=new.seed,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
            )
        for cached in out.cached_reqs:
            if cached.new_block_ids:
                self.reqs[cached.req_id].block_ids.extend(cached.new_block_ids)
        decodes, prefills = [], []
        for rid, n in out.num_scheduled_tokens.items():
            sched = ScheduledRequest(self.reqs[rid], n)
            (decodes if n == 1 else prefills).append(sched)
        return decodes + prefills

    @staticmethod
    def advance(scheduled: list[ScheduledRequest], sampled: dict[str, int]) -> None:
        for s in scheduled:
            s.state.num_computed_tokens += s.num_tokens
            token = sampled.get(s.state.req_id)
            if token is not None:
                s.state.token_ids.append(token)
