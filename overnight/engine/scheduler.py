"""The scheduler: which tokens of which requests the next forward pass computes."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from overnight.config import SchedulerConfig, decode_row_cap
from overnight.engine.admission import Admission
from overnight.engine.kv_cache_manager import KVCacheManager
from overnight.engine.request import Request, RequestStatus
from overnight.engine.state_snapshots import StateSnapshots
from overnight.engine.step_io import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from overnight.lora.residency import LoRAResidency


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions_total: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    lora_loads_total: int = 0  # adapters copied into a device slot
    lora_swaps_total: int = 0  # of those, loads that evicted another adapter
    # Steps in which planned admission held a waiting request back to keep room in the KV pool for the
    # running requests' growth (admission.py): the pool is the limit even where its usage is not high.
    kv_admission_deferrals_total: int = 0
    # Decode steps that computed a row cap's requests and left the newest to the next step
    # (SchedulerConfig.decode_row_caps: the int4 GEMM's whole row tiles).
    decode_row_capped_total: int = 0


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        *,
        lora: LoRAResidency | None = None,
        snapshots: StateSnapshots | None = None,
    ) -> None:
        self.config = config
        self.kv = kv
        self.lora = lora  # LoRA adapters' device slots: who may start (lora/residency.py)
        # Hybrid models with prefix caching: where chunks end and which states are kept for hits.
        self.snapshots = snapshots
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._gone_since_last_step: set[str] = set()
        self._sent_to_runner: set[str] = set()  # requests whose state the runner holds
        self.num_preemptions_total = 0
        self.decode_row_capped_total = 0  # steps a decode row cap held (_decode_rows)
        # Planned admission: start only what the pool can grow to its end (None: whatever fits now).
        planned = config.admission == "planned"
        self.admission = (
            Admission(kv, config.admission_tail_share, config.admission_step_tokens) if planned else None
        )

    # -- queue management -------------------------------------------------------------------------

    def add(self, req: Request) -> None:
        self.requests[req.req_id] = req
        self.waiting.append(req)

    def abort(self, req_ids: list[str]) -> list[Request]:
        aborted = []
        for rid in req_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            self._finish(req, RequestStatus.FINISHED_ABORTED)
            aborted.append(req)
        return aborted

    def finish_stopped(self, req: Request, stop_reason: str | int | None) -> None:
        """End a running request for a reason found outside the scheduler (a stop string)."""
        if req.is_finished:
            return
        req.stop_reason = stop_reason
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:  # preempted while a step ran ahead
            self.waiting.remove(req)
        self._finish(req, RequestStatus.FINISHED_STOPPED)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        self.kv.free(req)
        self.kv.forget(req)
        if self.snapshots is not None:
            self.snapshots.forget(req)
        self.requests.pop(req.req_id, None)
        self._drop_from_runner(req)

    def _drop_from_runner(self, req: Request) -> None:
        if req.req_id in self._sent_to_runner:
            self._sent_to_runner.discard(req.req_id)
            self._gone_since_last_step.add(req.req_id)

    def _preempt(self, req: Request) -> None:
        """Free the last running request's blocks; it recomputes later (its full blocks may still be
        cached)."""
        assert self.running[-1] is req
        self.running.pop()
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(req)
        self._drop_from_runner(req)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage,
            num_preemptions_total=self.num_preemptions_total,
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            lora_loads_total=self.lora.num_loads if self.lora else 0,
            lora_swaps_total=self.lora.num_swaps if self.lora else 0,
            kv_admission_deferrals_total=self.admission.deferrals if self.admission else 0,
            decode_row_capped_total=self.decode_row_capped_total,
        )

    # -- the step ---------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        # The rule: every request has num_computed_tokens and num_tokens, and each step hands out a
        # budget of max_num_batched_tokens. Running requests are served first, in admission order,
        # each asking for num_tokens - num_computed_tokens (one token while decoding; a prompt's rest
        # otherwise, cut to what is left of the budget: that cut is chunked prefill). Then waiting
        # requests are admitted in arrival order, starting past their prefix-cache hit, while the
        # budget, max_num_seqs and free KV blocks allow, and while the running requests can still grow
        # to their planned end in the pool (admission.py: look-ahead, so decoding rarely preempts). When a running request cannot get KV blocks,
        # the most recently admitted running request is preempted (blocks freed, recomputed later).
        # Prefill, decode, cache hits, mixed batches and resumed preemptions are one code path.
        # With LoRA, a waiting request whose adapter can get no device slot now is passed over (and
        # later new adapters wait behind it: lora/residency.py); the others may still start.
        # Hybrid models (snapshots set): a prefill chunk also ends at each state checkpoint of its
        # request (even without chunked prefill), a hit is cut back to the last saved state, and the
        # step records which states to save (state_snapshots.py).
        # Images whose tokens attend both ways (Gemma 3: MultiModalInputs.whole_images) are computed in
        # one chunk: a chunk that would end inside one ends before it (or waits for a step with room;
        # the engine refuses images larger than the whole budget).
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        saves: list[tuple[str, int]] = []
        snapshots = self.snapshots
        now = time.monotonic()

        preemptions_before = self.num_preemptions_total
        # Past a row cap this step, only the first `served` running requests are computed (_decode_rows).
        served = self._decode_rows()
        i = 0
        while i < min(served, len(self.running)) and budget > 0:
            req = self.running[i]
            n = min(req.num_remaining, budget)
            if n <= 0:
                i += 1
                continue
            start = req.num_computed_tokens
            if snapshots is not None:  # end the chunk at a state checkpoint
                n = snapshots.clip(req, start, n)
            if req.multi_modal is not None:  # never inside an image computed whole
                n = req.multi_modal.split_point(start + n) - start
                if n <= 0:  # the image does not fit what is left of the budget: next step
                    i += 1
                    continue
            while True:
                new_ids = self.kv.allocate(req, n)
                if new_ids is not None:
                    break
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    break
            if new_ids is None:  # req preempted itself: nothing left behind it to schedule
                break
            self._advance(req, n)
            num_scheduled[req.req_id] = n
            if snapshots is not None and (snap := snapshots.save_after(req, start, n)) is not None:
                saves.append((req.req_id, snap))
            if new_ids:
                cached_reqs.append(CachedRequestData(req.req_id, new_ids))
            budget -= n
            i += 1

        # A preemption this step means the pool is full: admitting now would only preempt again.
        pool_full = self.num_preemptions_total > preemptions_before
        admission = self.admission
        if admission is not None:
            admission.end_step(pool_full)
        planned = admission is None
        lora = self.lora
        lora_waits: list[Request] = []  # passed over this step: their adapter has no device slot yet
        if lora is not None:
            lora.begin_step(r.lora_request for r in self.running)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            if pool_full:
                break
            req = self.waiting[0]
            if req.num_pending:  # preempted while a step ran ahead: wait for its token
                break
            if lora is not None and not lora.can_admit(req.lora_request):
                lora_waits.append(self.waiting.popleft())
                continue
            if not planned:  # built once a step, only when someone may start
                assert admission is not None
                admission.begin(self.running)
                planned = True
            if admission is not None and not admission.admits(req, len(self.waiting) + len(lora_waits)):
                break
            hit = self.kv.find_cached_prefix(req)
            restore = None
            if snapshots is not None:  # a hit only as long as a saved state
                hit, restore = snapshots.admit(req, hit)
            num_hit = hit.num_blocks * self.kv.block_size if hit is not None else 0
            n = req.num_tokens - num_hit
            if n > budget:
                if not self.config.enable_chunked_prefill:
                    break
                n = budget
            if snapshots is not None:
                n = snapshots.clip(req, num_hit, n)
            if req.multi_modal is not None:
                n = req.multi_modal.split_point(num_hit + n) - num_hit
                if n <= 0:  # its first image does not fit what is left of the budget
                    break
            new_ids = self.kv.allocate(req, n, hit)
            if new_ids is None:
                break
            self.waiting.popleft()
            if lora is not None:
                lora.admit(req.lora_request)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
                req.first_scheduled_time = now
            self.kv.record_prefix_query(req, num_hit)
            req.num_computed_tokens = num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._sent_to_runner.add(req.req_id)
            new_reqs.append(
                NewRequestData(
                    req_id=req.req_id,
                    token_ids=list(req.all_token_ids),
                    num_prompt_tokens=req.num_prompt_tokens,
                    params=req.params,
                    seed=req.seed,
                    block_ids=new_ids,
                    num_computed_tokens=num_hit,
                    resumed=req.num_preemptions > 0,
                    pooling=req.pooling_params,
                    lora_request=req.lora_request,
                    multi_modal=req.multi_modal,
                    restore_snapshot=restore,
                )
            )
            self._advance(req, n)
            num_scheduled[req.req_id] = n
            if snapshots is not None and (snap := snapshots.save_after(req, num_hit, n)) is not None:
                saves.append((req.req_id, snap))
            budget -= n

        self.waiting.extendleft(reversed(lora_waits))
        gone, self._gone_since_last_step = self._gone_since_last_step, set()
        return SchedulerOutput(
            new_reqs=new_reqs,
            cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=gone,
            lora_loads=lora.take_loads() if lora is not None else [],
            state_saves=saves,
        )

    def _decode_rows(self) -> int:
        """How many of the running requests this step may compute: all of them, or a row cap's
        (SchedulerConfig.decode_row_caps) where every running request decodes one token, their count
        is past the cap and within its reach, and requests wait. Those past the cap, the last admitted,
        wait a step (their KV stays; they decode when those ahead finish): where the GEMMs pad rows to
        whole tiles, the cap's rows take less time per token. Not while nothing waits: then those left
        behind would finish alone in a tail of small steps."""
        running = len(self.running)
        if not self.waiting or not self.config.decode_row_caps:
            return running
        cap = decode_row_cap(self.config.decode_row_caps, running)
        if cap is None or any(r.num_remaining > 1 for r in self.running):
            return running
        self.decode_row_capped_total += 1
        return cap

    @staticmethod
    def _advance(req: Request, n: int) -> None:
        """Count n tokens as computed when the step is scheduled (a launched step runs ahead of the
        host). A step that reaches the end of the known and pending tokens samples one more."""
        req.num_computed_tokens += n
        if req.num_computed_tokens == len(req.all_token_ids) + req.num_pending:
            req.num_pending += 1

    def update(
        self, out: SchedulerOutput, runner_out: ModelRunnerOutput
    ) -> tuple[list[Request], list[Request]]:
        """Fold a finished step's sampled tokens in: append them, apply token-level stops, register
        newly full blocks in the prefix cache; end the pooling requests whose vector came.

        Returns (requests that got a token this step, requests that finished this step)."""
        requests = self.requests
        advanced: list[Request] = []
        finished: list[Request] = []
        now = time.monotonic()
        if self.snapshots is not None and out.state_saves:
            self.snapshots.commit(out.state_saves)
        running = RequestStatus.RUNNING
        preempted = RequestStatus.PREEMPTED
        for rid, token in zip(runner_out.req_ids, runner_out.sampled_token_ids):
            req = requests.get(rid)
            if req is None or (req.status is not running and req.status is not preempted):
                continue  # aborted, or already ended while this step ran
            req.num_pending -= 1
            req.all_token_ids.append(token)
            if req.first_token_time is None:
                req.first_token_time = now
            advanced.append(req)
            status = req.check_stop(token)
            if status is not None:
                if req.status != RequestStatus.RUNNING:  # preempted while this step ran ahead
                    self.waiting.remove(req)
                self._finish(req, status)
                finished.append(req)
        for rid in runner_out.pooled_req_ids:
            req = requests.get(rid)
            if req is None or (req.status is not running and req.status is not preempted):
                continue
            req.num_pending -= 1
            if req.status is running:  # its prompt's full blocks stay findable for equal prefixes
                self.kv.cache_computed_blocks(req)
            else:  # preempted after its last chunk was launched: the vector is complete all the same
                self.waiting.remove(req)
            self._finish(req, RequestStatus.FINISHED_STOPPED)
            finished.append(req)
        if finished:  # one pass instead of a list removal per finished request
            self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]
        if self.kv.enable_caching:
            bs = self.kv.block_size
            for rid in out.num_scheduled_tokens:
                req = requests.get(rid)
                # Cheap test first: most steps complete no block.
                if req is not None and req.num_computed_tokens // bs > req.num_cached_blocks:
                    if req.status is running or req.status is preempted:
                        self.kv.cache_computed_blocks(req)
        return advanced, finished
