"""Data parallel: N engine processes, requests dealt to the least loaded one, outputs merged.

    caller (LLM, run-batch, bench)                 engine process i = 0 .. N-1
    DataParallelEngine.add_request                 (CUDA_VISIBLE_DEVICES = its tensor_parallel_size GPUs)
      deals to the engine with the least    --AddRequests (batched)-->  Engine.add_request
      outstanding work                                                  steps on its own, back to back
    DataParallelEngine.step                 <--StepOutputs (per step)-- the step's outputs and stats
      returns whatever has arrived, merged

DataParallelEngine has the Engine's request methods (validate, add_request, abort_request, step,
has_unfinished_requests, stats, observers), so the entry points drive it as they drive one engine. Each
process builds an ordinary engine from the same options (data_parallel_size=1, tensor parallel inside it
if asked). Unseeded requests get their seed here, drawn exactly as one engine draws it, and sampling
depends only on a request's seed: a request's output does not depend on which engine ran it.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import random
import signal
import time
import traceback
import weakref
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection, wait

from overnight.config import EngineConfig
from overnight.engine.builder import EngineOptions
from overnight.engine.engine import Engine
from overnight.engine.scheduler import SchedulerStats
from overnight.engine.stats import IterationStats
from overnight.errors import EngineDeadError, InvalidRequestError
from overnight.outputs import RequestOutput
from overnight.parallel.workers import PipeSender, Shutdown, child_env, spawn_environment, stop_processes
from overnight.runner.kv_pool import PoolPlan
from overnight.sampling_params import SamplingParams

# Requests buffered per engine before they are sent without waiting for step().
SEND_BATCH = 64


# -- messages (driver -> engine process) ------------------------------------------------------------


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    stream: bool
    arrival_time: float  # time.monotonic() is one clock for every process of the machine


@dataclass(frozen=True)
class AddRequests:
    items: list[AddRequest]


@dataclass(frozen=True)
class AbortRequests:
    request_ids: list[str]


@dataclass(frozen=True)
class ForwardStats:
    """Send each step's IterationStats from now on (the driver has observers)."""


# -- messages (engine process -> driver) ------------------------------------------------------------


@dataclass(frozen=True)
class EngineReady:
    index: int
    config: EngineConfig  # as the engine process built it for its device
    pool_plan: PoolPlan


@dataclass
class StepOutputs:
    index: int
    outputs: list[RequestOutput]
    stats: SchedulerStats
    iteration: IterationStats | None = None


@dataclass(frozen=True)
class Rejected:
    request_id: str
    error: str


@dataclass(frozen=True)
class EngineFailed:
    index: int
    error: str  # formatted traceback


# -- dealing ----------------------------------------------------------------------------------------


@dataclass
class LoadBook:
    """Outstanding work per engine. A request costs its prompt plus the most tokens it may generate,
    times n; it goes to the engine with the fewest outstanding tokens, then fewest requests, then the
    lowest index, and is released when its final output arrives."""

    num_engines: int
    tokens: list[int] = field(init=False)
    requests: list[int] = field(init=False)
    owner: dict[str, tuple[int, int]] = field(default_factory=dict)  # request id -> (engine, cost)

    def __post_init__(self) -> None:
        self.tokens = [0] * self.num_engines
        self.requests = [0] * self.num_engines

    def assign(self, request_id: str, cost: int) -> int:
        i = min(range(self.num_engines), key=lambda e: (self.tokens[e], self.requests[e], e))
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


def request_cost(num_prompt_tokens: int, params: SamplingParams, max_model_len: int) -> int:
    room = max_model_len - num_prompt_tokens
    new = room if params.max_tokens is None else min(params.max_tokens, room)
    return params.n * (num_prompt_tokens + new)


# -- the engine process -----------------------------------------------------------------------------


def _engine_main(index: int, opts: EngineOptions, conn: Connection) -> None:
    from overnight.engine.builder import build_engine

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver decides when to stop
    try:
        engine = build_engine(replace(opts, data_parallel_size=1))
        conn.send(EngineReady(index, engine.config, engine.pool_plan))  # type: ignore[attr-defined]
        _serve(index, engine, conn)
    except BaseException:
        with contextlib.suppress(OSError, ValueError):
            conn.send(EngineFailed(index, traceback.format_exc()))
        raise SystemExit(1) from None


class _Recorder:
    """An observer that keeps the last step's IterationStats for the driver."""

    def __init__(self) -> None:
        self.last: IterationStats | None = None

    def on_step(self, scheduler: SchedulerStats, iteration: IterationStats) -> None:
        self.last = iteration


def _serve(index: int, engine: Engine, conn: Connection) -> None:
    recorder: _Recorder | None = None
    while True:
        try:
            if engine.has_unfinished_requests():
                messages = []
                while conn.poll():
                    messages.append(conn.recv())
            else:
                messages = [conn.recv()]  # idle: block until there is work
        except EOFError:  # the driver is gone
            return
        for msg in messages:
            if isinstance(msg, AddRequests):
                for r in msg.items:
                    try:
                        engine.add_request(
                            r.request_id,
                            r.prompt_token_ids,
                            r.params,
                            prompt=r.prompt,
                            stream=r.stream,
                            arrival_time=r.arrival_time,
                        )
                    except InvalidRequestError as e:
                        conn.send(Rejected(r.request_id, str(e)))
            elif isinstance(msg, AbortRequests):
                for rid in msg.request_ids:
                    engine.abort_request(rid)
            elif isinstance(msg, ForwardStats):
                if recorder is None:
                    recorder = _Recorder()
                    engine.observers.append(recorder)
            elif isinstance(msg, Shutdown):
                return
            else:
                raise TypeError(f"unexpected message {type(msg).__name__}")
        if engine.has_unfinished_requests():
            outputs = engine.step()
            iteration = None
            if recorder is not None:
                iteration, recorder.last = recorder.last, None
            if outputs or iteration is not None:
                conn.send(StepOutputs(index, outputs, engine.stats(), iteration))


# -- the driver -------------------------------------------------------------------------------------


class DataParallelEngine:
    """N engine processes behind the Engine's request methods (see the module docstring).

    config is the engines' config with max_num_seqs summed over them: what the group runs at once.
    """

    def __init__(self, opts: EngineOptions) -> None:
        from overnight.engine.builder import pick_device
        from overnight.loader.resolve import resolve_source

        self.num_engines = n = opts.data_parallel_size
        # Resolved here too (a file read, no weights): a wrong model name fails before any process starts.
        source = resolve_source(opts.model, opts.load_format)
        if opts.served_model_name:
            source = replace(source, served_name=opts.served_model_name)
        self.source = source
        self.vocab_size = source.arch.vocab_size
        self.tokenizer = None
        if not opts.skip_tokenizer_init:
            from overnight.tokenizer.tokenizer import load_tokenizer

            self.tokenizer = load_tokenizer(
                replace(source, tokenizer_path=opts.tokenizer) if opts.tokenizer else source
            )

        device = pick_device(opts.device)  # no CUDA context: only counts devices
        groups = _device_groups(device, n, opts.tensor_parallel_size)
        child_opts = replace(opts, device="cuda" if device.type == "cuda" else str(device))
        threads = None if device.type == "cuda" else (os.cpu_count() or 1) // n
        ctx = mp.get_context("spawn")
        self._procs: list[mp.process.BaseProcess] = []
        self._conns: list[Connection] = []
        self._senders: list[PipeSender] = []
        for i in range(n):
            ours, theirs = ctx.Pipe()
            # Not a daemon: an engine process starts its own tensor parallel workers.
            proc = ctx.Process(target=_engine_main, args=(i, child_opts, theirs), name=f"overnight-dp{i}")
            with spawn_environment(child_env(threads, groups[i])):
                proc.start()
            theirs.close()
            self._procs.append(proc)
            self._conns.append(ours)
            self._senders.append(PipeSender(ours, f"overnight-dp{i}-send"))
        self._finalizer = weakref.finalize(self, stop_processes, self._procs, self._senders, self._conns)

        ready: dict[int, EngineReady] = {}
        while len(ready) < n:
            for msg in self._receive():
                if not isinstance(msg, EngineReady):
                    raise EngineDeadError(f"unexpected message {type(msg).__name__} at start-up")
                ready[msg.index] = msg
        base = ready[0].config
        self.config = replace(
            base, scheduler=replace(base.scheduler, max_num_seqs=n * base.scheduler.max_num_seqs)
        )
        self.pool_plan = ready[0].pool_plan
        self.max_model_len = base.scheduler.max_model_len
        self.observers: list = []
        self.book = LoadBook(n)
        self._pending: list[list[AddRequest]] = [[] for _ in range(n)]
        self._rng = random.Random(base.model.seed)
        self._stats: list[SchedulerStats | None] = [None] * n
        self._forwarding = False
        self._carry: list[RequestOutput] = []
        self.num_steps = 0

    # -- requests (the Engine's methods) ----------------------------------------------------------

    def validate(self, ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError if this prompt and params cannot be served: one engine's checks,
        run on this object's identical max_model_len, vocab_size, tokenizer and config."""
        Engine.validate(self, ids, params)  # type: ignore[arg-type]

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        *,
        prompt: str | None = None,
        stream: bool = False,
        arrival_time: float | None = None,
    ) -> None:
        params = params or SamplingParams()
        if request_id in self.book.owner:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        self.validate(prompt_token_ids, params)
        if params.seed is None:  # the draw one engine would make, so outputs match one engine's
            params = replace(params, seed=self._rng.getrandbits(63))
        item = AddRequest(
            request_id,
            list(prompt_token_ids),
            params,
            prompt,
            stream,
            time.monotonic() if arrival_time is None else arrival_time,
        )
        i = self.book.assign(request_id, request_cost(len(prompt_token_ids), params, self.max_model_len))
        self._pending[i].append(item)
        if len(self._pending[i]) >= SEND_BATCH:
            self._flush(i)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Forget the request here at once and stop it in its engine; its final output is not kept."""
        i = self.book.release(request_id)
        if i is None or not self._finalizer.alive:  # unknown, or every engine process is gone
            return None
        kept = [r for r in self._pending[i] if r.request_id != request_id]
        if len(kept) < len(self._pending[i]):
            self._pending[i] = kept
        else:
            self._send(i, AbortRequests([request_id]))
        return None

    def has_unfinished_requests(self) -> bool:
        return bool(self.book.owner)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.book.owner)

    def stats(self) -> SchedulerStats:
        known = [s for s in self._stats if s is not None]
        if not known:
            return SchedulerStats(0, 0, 0.0, 0, 0, 0)
        return SchedulerStats(
            num_running=sum(s.num_running for s in known),
            num_waiting=sum(s.num_waiting for s in known),
            kv_cache_usage=sum(s.kv_cache_usage for s in known) / len(known),
            num_preemptions_total=sum(s.num_preemptions_total for s in known),
            prefix_cache_queries=sum(s.prefix_cache_queries for s in known),
            prefix_cache_hits=sum(s.prefix_cache_hits for s in known),
        )

    def step(self) -> list[RequestOutput]:
        """Send buffered requests, then return the outputs that have arrived (waiting for at least
        one message while any request is unfinished)."""
        if self.observers and not self._forwarding:
            self._forwarding = True
            for i in range(self.num_engines):
                self._send(i, ForwardStats())
        for i in range(self.num_engines):
            self._flush(i)
        outputs, self._carry = self._carry, []
        if outputs or not self.book.owner:
            return outputs
        rejected: list[Rejected] = []
        for msg in self._receive():
            if isinstance(msg, Rejected):
                self.book.release(msg.request_id)
                rejected.append(msg)
                continue
            if not isinstance(msg, StepOutputs):
                raise EngineDeadError(f"unexpected message {type(msg).__name__}")
            self._stats[msg.index] = msg.stats
            for out in msg.outputs:
                if out.request_id not in self.book.owner:
                    continue  # aborted here after the engine produced it
                if out.finished:
                    self.book.release(out.request_id)
                outputs.append(out)
            if msg.iteration is not None and self.observers:
                stats = self.stats()
                for obs in self.observers:
                    obs.on_step(stats, msg.iteration)
        self.num_steps += 1
        if rejected:  # cannot happen after validate() passed; the other outputs wait for the next step
            self._carry = outputs
            raise InvalidRequestError(f"request {rejected[0].request_id}: {rejected[0].error}")
        return outputs

    def shutdown(self) -> None:
        self._finalizer()

    # -- plumbing ---------------------------------------------------------------------------------

    def _flush(self, i: int) -> None:
        if self._pending[i]:
            items, self._pending[i] = self._pending[i], []
            self._send(i, AddRequests(items))

    def _send(self, i: int, msg: object) -> None:
        if not self._finalizer.alive:
            raise EngineDeadError("the data parallel engines have been shut down")
        self._senders[i].send(msg)

    def _receive(self) -> list[object]:
        """Block until some engine process has something to say; return all that is waiting."""
        sentinels = {p.sentinel: i for i, p in enumerate(self._procs)}
        ready = wait([*self._conns, *sentinels])
        messages: list[object] = []
        for i, conn in enumerate(self._conns):
            if conn not in ready:
                continue
            try:
                while conn.poll():
                    msg = conn.recv()
                    if isinstance(msg, EngineFailed):
                        self._fail(i, msg.error)
                    messages.append(msg)
            except (EOFError, OSError):
                self._fail(i, "(no message: the process is gone)")
        for s in ready:
            if isinstance(s, int) and not self._conns[sentinels[s]].poll():
                self._fail(sentinels[s], "(no message: the process is gone)")
        return messages

    def _fail(self, index: int, error: str) -> None:
        proc = self._procs[index]
        proc.join(1.0)
        stop_processes(self._procs, self._senders, self._conns, grace_s=0.0)
        self._finalizer.detach()
        raise EngineDeadError(
            f"data parallel engine {index} failed (exit code {proc.exitcode}); it reported:\n{error}"
        )


def _device_groups(device, n: int, tp: int) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES for each engine process: tp consecutive GPUs from the configured one."""
    if device.type != "cuda":
        return [None] * n
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = (
        [d.strip() for d in visible.split(",") if d.strip()]
        if visible
        else [str(i) for i in range(torch.cuda.device_count())]
    )
    ids = ids[device.index or 0 :]
    if len(ids) < n * tp:
        raise InvalidRequestError(
            f"data_parallel_size {n} x tensor_parallel_size {tp} needs {n * tp} GPUs; {len(ids)} are visible"
        )
    return [",".join(ids[i * tp : (i + 1) * tp]) for i in range(n)]


def build_data_parallel_engine(opts: EngineOptions) -> DataParallelEngine:
    return DataParallelEngine(opts)
