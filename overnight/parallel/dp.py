"""Data parallel: N engines, requests dealt to the least loaded one, outputs merged.

    caller (LLM, run-batch, bench)               engine i = 0 .. N-1: a process on this machine
    DataParallelEngine.add_request               (CUDA_VISIBLE_DEVICES = its GPUs), or a Ray actor
      deals to the engine with the least  --AddRequests (batched)-->  Engine.add_request
      outstanding work                                                steps on its own, back to back
    DataParallelEngine.step               <--StepOutputs (per step)-- the step's outputs and stats
      returns whatever has arrived, merged

DataParallelEngine implements EngineClient (engine/interfaces.py), so the entry points drive it as they
drive one engine. Each engine is an ordinary engine built in its own process from the same options
(data_parallel_size=1, tensor parallel inside it if asked) by the factory the links were given. Unseeded requests get their seed here, drawn exactly as one engine draws it, and sampling
depends only on a request's seed: a request's output does not depend on which engine ran it.

Images are preprocessed once, here in the front (the entry points' ImageProcessor, in its thread pool),
and a request carries its MultiModalInputs: pixels, placeholder-expanded ids, M-RoPE positions and each
image's content hash. The front needs the decoded image anyway (its token count sets the prompt, its
length checks and its dealing cost; an undecodable image must fail before it is dealt), and the hash the
prefix cache keys on is then one value on every engine by construction. The price is the payload: a
1024x1024 photo is 274 KB as JPEG (q90), 2.2 MB as PNG, and 23 MB of float32 pixels for Qwen2.5-VL (a
70x70 patch grid), unpickled in ~5 ms; against the ~90 ms of CPU its preprocessing takes that is small,
but an image-heavy run at many engines is bound by the front's cores (preprocessing in each engine from
the encoded bytes is the way out there).

How the engines are reached is an EngineLinks (links.py): ProcessLinks (a lost process is fatal), RayLinks in
ray.py (a lost actor is replaced and its requests are dealt again to the others, from the start).
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from overnight.engine.interfaces import AddRequest, StepTimings
from overnight.engine.scheduler import SchedulerStats
from overnight.engine.stats import StatsObserver
from overnight.engine.validation import limits_of, validate_images, validate_request
from overnight.errors import EngineDeadError, InvalidRequestError
from overnight.loader.source import ModelSource
from overnight.lora.request import LoRARequest
from overnight.multimodal.inputs import MultiModalInputs
from overnight.outputs import EngineOutput, RequestOutput
from overnight.parallel.links import (
    AbortRequests,
    AddRequests,
    EngineLinks,
    EngineLost,
    EngineReady,
    ForwardStats,
    Rejected,
    StepOutputs,
)
from overnight.parallel.output_codec import unpack
from overnight.pooling_params import PoolingParams, RequestParams
from overnight.sampling_params import SamplingParams

if TYPE_CHECKING:
    from overnight.structured.compiler import GrammarCompiler
    from overnight.tokenizer.tokenizer import Tokenizer

log = logging.getLogger("overnight")

# Requests buffered per engine before they are sent without waiting for step().
SEND_BATCH = 64


# -- dealing ----------------------------------------------------------------------------------------


@dataclass
class LoadBook:
    """Outstanding work per engine. A request costs its prompt plus the most tokens it may generate,
    times n; it goes to the up engine with the fewest outstanding tokens, then fewest requests, then
    the lowest index, and is released when its final output arrives."""

    num_engines: int
    tokens: list[int] = field(init=False)
    requests: list[int] = field(init=False)
    owner: dict[str, tuple[int, int]] = field(default_factory=dict)  # request id -> (engine, cost)
    down: set[int] = field(default_factory=set)  # engines lost and not back yet: dealt nothing

    def __post_init__(self) -> None:
        self.tokens = [0] * self.num_engines
        self.requests = [0] * self.num_engines

    def assign(self, request_id: str, cost: int) -> int | None:
        """The engine to send the request to; None while every engine is down."""
        up = [e for e in range(self.num_engines) if e not in self.down]
        if not up:
            return None
        i = min(up, key=lambda e: (self.tokens[e], self.requests[e], e))
        self.tokens[i] += cost
        self.requests[i] += 1
        self.owner[request_id] = (i, cost)
        return i

    def release(self, request_id: str) -> int | None:
        entry = self.owner.pop(request_id, None)
        if entry is None:
            return None
        i, cost = entry
        self.tokens[i] -= cost
        self.requests[i] -= 1
        return i

    def take_back(self, index: int) -> list[str]:
        """Mark engine `index` down; release and return the requests it held."""
        self.down.add(index)
        lost = [rid for rid, (i, _) in self.owner.items() if i == index]
        for rid in lost:
            self.release(rid)
        return lost


def request_cost(num_prompt_tokens: int, params: RequestParams, max_model_len: int) -> int:
    if isinstance(params, PoolingParams):  # a prefill, nothing generated
        return num_prompt_tokens
    room = max_model_len - num_prompt_tokens
    new = room if params.max_tokens is None else min(params.max_tokens, room)
    return params.num_samples * (num_prompt_tokens + new)


# -- the driver -------------------------------------------------------------------------------------


class DataParallelEngine:
    """N engines behind one EngineClient (see the module docstring). source and tokenizer are the
    model's, resolved once by the caller (every engine has the same).

    config is the engines' config with max_num_seqs summed over them: what the group runs at once.
    """

    def __init__(
        self,
        links: EngineLinks,
        source: ModelSource,
        tokenizer: Tokenizer | None,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        self.links = links
        self.num_engines = n = links.num_engines
        self.source = source
        self.vocab_size = source.arch.vocab_size
        self.tokenizer = tokenizer
        self.timings: StepTimings | None = None  # the steps run in the engines' processes
        # Structured outputs are compiled here to validate them, and again (cached) in each engine
        # process: requests carry only their params, never a compiled grammar.
        self.grammars = grammars

        ready: dict[int, EngineReady] = {}
        while len(ready) < n:
            for msg in self.links.receive():
                if isinstance(msg, EngineLost):
                    continue  # lost while starting: the links start it again or raise
                if not isinstance(msg, EngineReady):
                    raise EngineDeadError(f"unexpected message {type(msg).__name__} at start-up")
                ready[msg.index] = msg
        base = ready[0].config
        sched = base.scheduler
        self.config = replace(base, scheduler=replace(sched, max_num_seqs=n * sched.max_num_seqs))
        self.pool_plan = ready[0].pool_plan
        self.max_model_len = sched.max_model_len
        self.observers: list[StatsObserver] = []
        self.book = LoadBook(n)
        self.num_steps = 0
        self._items: dict[str, AddRequest] = {}  # outstanding requests, kept to deal them again
        self._pending: list[list[AddRequest]] = [[] for _ in range(n)]
        self._rng = random.Random(base.model.seed)
        self._stats: list[SchedulerStats | None] = [None] * n
        self._forwarding = False
        self._carry: list[EngineOutput] = []
        self._homeless: list[AddRequest] = []  # dealt while every engine was down

    # -- requests (the Engine's methods) ----------------------------------------------------------

    def validate(self, ids: list[int], params: RequestParams) -> None:
        """Raise InvalidRequestError if this prompt and params cannot be served: one engine's checks
        (every engine behind this front has the same model and limits)."""
        limits = limits_of(self.config, self.vocab_size, self.tokenizer is not None)
        validate_request(ids, params, limits, self.grammars)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: RequestParams | None = None,
        *,
        prompt: str | None = None,
        stream: bool = False,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        multi_modal: MultiModalInputs | None = None,
    ) -> None:
        if params is None:
            params = PoolingParams() if self.config.model.runner == "pooling" else SamplingParams()
        if request_id in self.book.owner:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        self.validate(prompt_token_ids, params)
        if multi_modal is not None:  # checked here too, so a bad one never reaches an engine
            budget = self.config.scheduler.max_num_batched_tokens
            validate_images(prompt_token_ids, params, multi_modal, self.max_model_len, budget)
        if isinstance(params, SamplingParams) and params.seed is None:
            # the draw one engine would make, so outputs match one engine's
            params = replace(params, seed=self._rng.getrandbits(63))
        arrival = time.monotonic() if arrival_time is None else arrival_time
        self._deal(
            AddRequest(
                request_id, list(prompt_token_ids), params, prompt, stream, arrival, lora_request, multi_modal
            )
        )

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Forget the request here at once and stop it in its engine; its final output is not kept."""
        i = self.book.release(request_id)
        self._items.pop(request_id, None)
        self._homeless = [r for r in self._homeless if r.request_id != request_id]
        if i is None or not self.links.alive:
            return None
        kept = [r for r in self._pending[i] if r.request_id != request_id]
        if len(kept) < len(self._pending[i]):
            self._pending[i] = kept
        else:
            self.links.send(i, AbortRequests([request_id]))
        return None

    def has_unfinished_requests(self) -> bool:
        return bool(self.book.owner or self._homeless)

    def unfinished_request_ids(self) -> list[str]:
        return [*self.book.owner, *(r.request_id for r in self._homeless)]

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.book.owner) + len(self._homeless)

    def stats(self) -> SchedulerStats:
        known = [s for s in self._stats if s is not None]
        if not known:
            return SchedulerStats(0, 0, 0.0, 0, 0, 0)
        # With nothing outstanding the engines hold nothing either (their last report may predate the
        # aborts that emptied them: an idle engine sends nothing).
        idle = not self.has_unfinished_requests()
        return SchedulerStats(
            num_running=0 if idle else sum(s.num_running for s in known),
            num_waiting=0 if idle else sum(s.num_waiting for s in known),
            kv_cache_usage=0.0 if idle else sum(s.kv_cache_usage for s in known) / len(known),
            num_preemptions_total=sum(s.num_preemptions_total for s in known),
            prefix_cache_queries=sum(s.prefix_cache_queries for s in known),
            prefix_cache_hits=sum(s.prefix_cache_hits for s in known),
            lora_loads_total=sum(s.lora_loads_total for s in known),
            lora_swaps_total=sum(s.lora_swaps_total for s in known),
        )

    def step(self) -> list[EngineOutput]:
        """Send buffered requests, then return the outputs that have arrived (waiting for at least
        one message while any request is unfinished)."""
        if bool(self.observers) != self._forwarding:  # observers came or went
            self._forwarding = bool(self.observers)
            for i in range(self.num_engines):
                self.links.send(i, ForwardStats(self._forwarding))
        for i in range(self.num_engines):
            self._flush(i)
        outputs, self._carry = self._carry, []
        if outputs or not self.has_unfinished_requests():
            return outputs
        rejected: list[Rejected] = []
        for msg in self.links.receive():
            if isinstance(msg, StepOutputs):
                outputs += self._accept(msg)
            elif isinstance(msg, Rejected):
                if self._owned_by(msg.request_id, msg.index):
                    self.book.release(msg.request_id)
                    self._items.pop(msg.request_id, None)
                    rejected.append(msg)
            elif isinstance(msg, EngineLost):
                self._deal_again(msg.index, msg.reason)
            elif isinstance(msg, EngineReady):  # a replacement is up
                self.book.down.discard(msg.index)
                if self._forwarding:
                    self.links.send(msg.index, ForwardStats())
                homeless, self._homeless = self._homeless, []
                for item in homeless:
                    self._deal(item)
            else:
                raise EngineDeadError(f"unexpected message {type(msg).__name__}")
        self.num_steps += 1
        if rejected:  # cannot happen after validate() passed; the other outputs wait for the next step
            self._carry = outputs
            raise InvalidRequestError(f"request {rejected[0].request_id}: {rejected[0].error}")
        return outputs

    def shutdown(self) -> None:
        self.links.close()

    # -- plumbing ---------------------------------------------------------------------------------

    def _deal(self, item: AddRequest) -> None:
        cost = request_cost(len(item.prompt_token_ids), item.params, self.max_model_len)
        i = self.book.assign(item.request_id, cost)
        if i is None:  # every engine is down: wait for a replacement
            self._homeless.append(item)
            return
        self._items[item.request_id] = item
        self._pending[i].append(item)
        if len(self._pending[i]) >= SEND_BATCH:
            self._flush(i)

    def _deal_again(self, index: int, reason: str) -> None:
        """Engine `index` is gone with its requests: deal them to the engines still up, from the start."""
        self._pending[index] = []
        self._stats[index] = None
        lost = self.book.take_back(index)
        log.warning(
            "engine %d was lost (%s); dealing its %d requests again", index, reason.splitlines()[0], len(lost)
        )
        for rid in lost:
            self._deal(self._items[rid])

    def _owned_by(self, request_id: str, index: int) -> bool:
        entry = self.book.owner.get(request_id)
        return entry is not None and entry[0] == index

    def _accept(self, msg: StepOutputs) -> list[EngineOutput]:
        self._stats[msg.index] = msg.stats
        accepted = []
        for out in unpack(msg.outputs, self._prompt_of):
            if not self._owned_by(out.request_id, msg.index):
                continue  # aborted here, or dealt again after its engine was lost
            if out.finished:
                self.book.release(out.request_id)
                self._items.pop(out.request_id, None)
            accepted.append(out)
        if msg.iteration is not None and self.observers:
            stats = self.stats()
            for obs in self.observers:
                obs.on_step(stats, msg.iteration)
        return accepted

    def _prompt_of(self, request_id: str) -> tuple[str | None, list[int]] | None:
        item = self._items.get(request_id)
        return None if item is None else (item.prompt, item.prompt_token_ids)

    def _flush(self, i: int) -> None:
        if self._pending[i]:
            items, self._pending[i] = self._pending[i], []
            self.links.send(i, AddRequests(items))
