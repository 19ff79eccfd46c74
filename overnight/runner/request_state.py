"""The runner's own copy of each running request, kept up to date from SchedulerOutput diffs.

Each request holds a row ("slot") of a persistent block table, so a step gathers the rows it needs
instead of rebuilding the table from lists. A launched step may run ahead of the host: the token it
samples is "pending" until its result is read, and the next step takes that token straight from the
device (see model_runner.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from overnight.engine.step_io import SchedulerOutput
from overnight.multimodal.inputs import MultiModalInputs
from overnight.pooling_params import PoolingParams
from overnight.sampling_params import SamplingParams

if TYPE_CHECKING:
    import xgrammar as xgr


@dataclass(slots=True, eq=False)
class Guide:
    """One sequence's grammar state."""

    matcher: xgr.GrammarMatcher
    consumed: int = 0  # output tokens the matcher has accepted
    # No more masks from the matcher; the row allows only the stop tokens. Either it accepted a stop
    # token: the request is over, but a step launched before the engine read that token still samples
    # it (a token the engine drops). Or it refused a token (the mask makes that impossible; a guard): the
    # request then ends instead of running on unconstrained.
    ended: bool = False
    # StructuredOutputsParams.start_after: the text the output must show before the grammar starts; the
    # row is unconstrained until then. `tail` holds the output's last characters while it waits.
    waiting_for: str | None = None
    tail: str = ""


@dataclass(slots=True, eq=False)
class RunnerRequest:
    req_id: str
    token_ids: list[int]  # known tokens: prompt + outputs whose ids reached the host
    num_prompt_tokens: int
    params: SamplingParams
    seed: int
    slot: int  # row in the block table
    num_blocks: int  # entries of its group-0 table (RequestStates.table_lens holds every group's)
    num_computed_tokens: int
    num_pending: int = 0  # tokens sampled by launched steps, not yet in token_ids
    # Structured outputs: the grammar matcher (runner/grammar_mask.py), made when first sampled. A
    # preempted request's state is dropped with it; the new state's matcher replays the outputs.
    guide: Guide | None = None
    pooling: PoolingParams | None = None  # a pooling request (its "sample" is the pooled vector)
    lora_id: int = 0  # its LoRA adapter's lora_int_id; 0: the base model
    multi_modal: MultiModalInputs | None = None  # its images and M-RoPE positions

    @property
    def num_output_tokens(self) -> int:
        """Output tokens including pending ones: the index of the next token drawn."""
        return len(self.token_ids) + self.num_pending - self.num_prompt_tokens


@dataclass(slots=True)
class ScheduledRequest:
    state: RunnerRequest
    num_tokens: int  # tokens computed this step
    start: int = 0  # first position computed (num_computed_tokens before the step)
    samples: bool = False  # the step reaches the end of the known + pending tokens


class RequestStates:
    def __init__(self, max_num_reqs: int = 1024, max_blocks_per_req: int = 256, num_groups: int = 1) -> None:
        self.reqs: dict[str, RunnerRequest] = {}
        # One table per KV cache group (engine/kv_groups.py); a group of a larger block size has fewer
        # entries per request: table_lens[g, slot] of them.
        self.block_table = np.zeros((num_groups, max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.table_lens = np.zeros((num_groups, max_num_reqs), dtype=np.int64)
        self._free_slots = list(range(max_num_reqs - 1, -1, -1))
        self.num_structured = 0  # requests with structured outputs: none means no mask work at all

    def _grow(self) -> None:
        groups, rows, cols = self.block_table.shape
        bigger = np.zeros((groups, rows * 2, cols), dtype=np.int32)
        bigger[:, :rows] = self.block_table
        self.block_table = bigger
        lens = np.zeros((groups, rows * 2), dtype=np.int64)
        lens[:, :rows] = self.table_lens
        self.table_lens = lens
        self._free_slots = list(range(2 * rows - 1, rows - 1, -1)) + self._free_slots

    def _set_blocks(self, st: RunnerRequest, block_ids: list[list[int]]) -> None:
        """Append one list of ids per group (groups of one block size grow by the same count)."""
        lens = self.table_lens[:, st.slot]  # a view: updated in place
        end = int(lens.max()) + max(len(ids) for ids in block_ids)
        if end > self.block_table.shape[2]:
            groups, rows, cols = self.block_table.shape
            wider = np.zeros((groups, rows, max(end, 2 * cols)), dtype=np.int32)
            wider[:, :, :cols] = self.block_table
            self.block_table = wider
        for g, ids in enumerate(block_ids):
            if ids:
                start = int(lens[g])
                self.block_table[g, st.slot, start : start + len(ids)] = ids
                lens[g] = start + len(ids)
        st.num_blocks = int(lens[0])

    def apply(self, out: SchedulerOutput) -> list[ScheduledRequest]:
        """Fold one step's diff into the states; return the scheduled requests, decodes (one token)
        first, as the attention metadata requires, otherwise in schedule order."""
        for rid in out.finished_req_ids:
            st = self.reqs.pop(rid, None)
            if st is not None:
                self._free_slots.append(st.slot)
                if st.params.structured_outputs is not None:
                    self.num_structured -= 1
        for new in out.new_reqs:
            if not self._free_slots:
                self._grow()
            self.table_lens[:, self._free_slots[-1]] = 0
            st = RunnerRequest(
                req_id=new.req_id,
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                params=new.params,
                seed=new.seed,
                slot=self._free_slots.pop(),
                num_blocks=0,
                num_computed_tokens=new.num_computed_tokens,
                pooling=new.pooling,
                lora_id=new.lora_request.lora_int_id if new.lora_request is not None else 0,
                multi_modal=new.multi_modal,
            )
            self._set_blocks(st, new.block_ids)
            self.reqs[new.req_id] = st
            if new.params.structured_outputs is not None:
                self.num_structured += 1
        for cached in out.cached_reqs:
            self._set_blocks(self.reqs[cached.req_id], cached.new_block_ids)
        decodes: list[ScheduledRequest] = []
        prefills: list[ScheduledRequest] = []
        reqs = self.reqs
        for rid, n in out.num_scheduled_tokens.items():
            (decodes if n == 1 else prefills).append(ScheduledRequest(reqs[rid], n))
        return decodes + prefills

    @staticmethod
    def begin(scheduled: list[ScheduledRequest]) -> list[RunnerRequest]:
        """Mark the step launched: advance computed tokens, note who samples. Returns the sampling
        requests in row order."""
        sampled = []
        for s in scheduled:
            st = s.state
            s.start = st.num_computed_tokens
            st.num_computed_tokens += s.num_tokens
            if st.num_computed_tokens == len(st.token_ids) + st.num_pending:
                s.samples = True
                st.num_pending += 1
                sampled.append(st)
        return sampled

    def resolve(self, req_ids: list[str], tokens: list[int]) -> None:
        """A launched step's tokens reached the host."""
        reqs = self.reqs
        for rid, tok in zip(req_ids, tokens):
            st = reqs.get(rid)
            if st is not None:  # dropped meanwhile: finished or preempted
                st.token_ids.append(tok)
                st.num_pending -= 1
