"""The wire between a data parallel driver and its engines: typed messages, the engine's serving loop,
and EngineLinks, how the driver reaches the engines (ProcessLinks: spawned processes on this machine;
RayLinks in ray.py: Ray actors).

    driver -> engine   AddRequests, AbortRequests, ForwardStats, Shutdown
    engine -> driver   EngineReady, StepOutputs, Rejected, EngineFailed (fatal), EngineLost (from links)
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait
from typing import Protocol

from overnight.config import EngineConfig
from overnight.engine.interfaces import AddRequest, EngineClient
from overnight.engine.pool_plan import PoolPlan
from overnight.engine.scheduler import SchedulerStats
from overnight.engine.stats import IterationStats
from overnight.errors import EngineDeadError, InvalidRequestError
from overnight.logs import LogSetup
from overnight.options import EngineOptions
from overnight.parallel.output_codec import PackedOutput, pack
from overnight.parallel.workers import (
    PipeSender,
    Shutdown,
    child_env,
    leave_stopping_to_driver,
    spawn_environment,
    stop_processes,
)

# Builds one engine from options, in the engine's own process (the composition root's build_engine):
# injected, so the parallel fronts never import what assembles them.
EngineFactory = Callable[[EngineOptions], EngineClient]

# -- messages (driver -> engine) ------------------------------------------------------------------


@dataclass(frozen=True)
class AddRequests:
    items: list[AddRequest]


@dataclass(frozen=True)
class AbortRequests:
    request_ids: list[str]


@dataclass(frozen=True)
class ForwardStats:
    """Send each step's IterationStats from now on (the driver has observers), or stop (on=False)."""

    on: bool = True


# -- messages (engine -> driver) ------------------------------------------------------------------


@dataclass(frozen=True)
class EngineReady:
    index: int
    config: EngineConfig  # as the engine built it for its device
    pool_plan: PoolPlan


@dataclass
class StepOutputs:
    index: int
    outputs: list[PackedOutput]  # output_codec.pack(): the front unpacks them with their prompts
    stats: SchedulerStats
    iteration: IterationStats | None = None


@dataclass(frozen=True)
class Rejected:
    index: int
    request_id: str
    error: str


@dataclass(frozen=True)
class EngineFailed:
    """The engine raised: a bug or a broken device; fatal to the whole group."""

    index: int
    error: str  # formatted traceback


@dataclass(frozen=True)
class EngineLost:
    """The engine's host went away (a killed actor, a lost node); its links may bring it back."""

    index: int
    reason: str


# -- the engine side --------------------------------------------------------------------------------


class _Recorder:
    """An observer that keeps the last step's IterationStats for the driver."""

    def __init__(self) -> None:
        self.last: IterationStats | None = None

    def on_step(self, scheduler: SchedulerStats, iteration: IterationStats) -> None:
        self.last = iteration


def serve_engine(
    index: int,
    engine: EngineClient,
    receive: Callable[[bool], list[object] | None],
    send: Callable[[object], None],
) -> None:
    """The engine's loop: take the driver's messages (receive(block) returns those waiting, blocking
    for one when block is true, or None once the driver is gone), step while work is left, send each
    step's outputs. Returns on Shutdown or when the driver is gone."""
    recorder: _Recorder | None = None
    while True:
        messages = receive(not engine.has_unfinished_requests())  # idle: block until there is work
        if messages is None:
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
                            lora_request=r.lora_request,
                            multi_modal=r.multi_modal,
                        )
                    except InvalidRequestError as e:
                        send(Rejected(index, r.request_id, str(e)))
            elif isinstance(msg, AbortRequests):
                for rid in msg.request_ids:
                    engine.abort_request(rid)
            elif isinstance(msg, ForwardStats):
                if msg.on and recorder is None:
                    recorder = _Recorder()
                    engine.observers.append(recorder)
                elif not msg.on and recorder is not None:
                    engine.observers.remove(recorder)
                    recorder = None
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
                send(StepOutputs(index, pack(outputs), engine.stats(), iteration))


def _engine_main(
    index: int, opts: EngineOptions, factory: EngineFactory, conn: Connection, log_setup: LogSetup
) -> None:
    leave_stopping_to_driver()
    log_setup.apply()

    def receive(block: bool) -> list[object] | None:
        try:
            if block:
                return [conn.recv()]
            messages = []
            while conn.poll():
                messages.append(conn.recv())
            return messages
        except (EOFError, OSError):  # the driver is gone
            return None

    # Step outputs go through a writer thread: a driver slow to read (a busy HTTP process) must not
    # block the step loop on a full pipe (it did, ~9 ms a step, in bench/server_cost_cpu.py).
    sender = PipeSender(conn, f"overnight-dp{index}-out")
    try:
        engine = factory(opts)
        sender.send(EngineReady(index, engine.config, engine.pool_plan))
        serve_engine(index, engine, receive, sender.send)
        sender.close(timeout=10.0)
    except BaseException:
        sender.close(timeout=10.0)  # what was queued first, so the failure is the last message
        with contextlib.suppress(OSError, ValueError):
            conn.send(EngineFailed(index, traceback.format_exc()))
        raise SystemExit(1) from None


# -- links: how the driver reaches its engines ------------------------------------------------------


class EngineLinks(Protocol):
    num_engines: int

    def send(self, index: int, msg: object) -> None: ...

    def receive(self) -> list[object]:
        """Block until some engine has something to say; return all that is waiting."""
        ...

    def close(self) -> None: ...

    @property
    def alive(self) -> bool:
        """False once closed or failed: nothing more can be sent."""
        ...


class ProcessLinks:
    """One spawned process per engine, pipes both ways; a dead process raises EngineDeadError.
    Each process builds its engine as factory(opts) (opts: one engine's options)."""

    def __init__(self, opts: EngineOptions, num_engines: int, factory: EngineFactory) -> None:
        from overnight.runner.device import pick_device

        self.num_engines = n = num_engines
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
            proc = ctx.Process(
                target=_engine_main,
                args=(i, child_opts, factory, theirs, LogSetup.capture()),
                name=f"overnight-dp{i}",
            )
            with spawn_environment(child_env(threads, groups[i])):
                proc.start()
            theirs.close()
            self._procs.append(proc)
            self._conns.append(ours)
            self._senders.append(PipeSender(ours, f"overnight-dp{i}-send"))
        self._finalizer = weakref.finalize(self, stop_processes, self._procs, self._senders, self._conns)

    def send(self, index: int, msg: object) -> None:
        if not self._finalizer.alive:
            raise EngineDeadError("the data parallel engines have been shut down")
        self._senders[index].send(msg)

    def receive(self) -> list[object]:
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

    def close(self) -> None:
        self._finalizer()

    @property
    def alive(self) -> bool:
        return self._finalizer.alive

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
    if visible:
        ids = [d.strip() for d in visible.split(",") if d.strip()]
    else:
        ids = [str(i) for i in range(torch.cuda.device_count())]
    ids = ids[device.index or 0 :]
    if len(ids) < n * tp:
        raise InvalidRequestError(
            f"data_parallel_size {n} x tensor_parallel_size {tp} needs {n * tp} GPUs; {len(ids)} are visible"
        )
    return [",".join(ids[i * tp : (i + 1) * tp]) for i in range(n)]
