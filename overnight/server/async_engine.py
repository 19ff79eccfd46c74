"""The engine behind an event loop: one thread steps the engine while HTTP handlers add and abort requests.

    handlers (event loop thread)                     engine thread
    generate(): Add ------------> commands (queue) --> engine.add_request / abort_request
                                                       engine.step()
    per-request asyncio.Queue <-- call_soon_threadsafe <-- outputs of the step

Invariants: only the engine thread touches the Engine's mutable state (queues, KV blocks, outputs); only
the event loop touches the per-request queues. Commands are applied in the order they were sent, so an
abort always finds the add it follows. The thread sleeps on the command queue while no request is
unfinished, and steps back to back while one is.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from overnight.engine.interfaces import AddRequest, EngineClient
from overnight.engine.scheduler import SchedulerStats
from overnight.errors import EngineDeadError
from overnight.lora.request import LoRARequest
from overnight.metrics.prometheus import PrometheusObserver
from overnight.multimodal.inputs import MultiModalInputs
from overnight.outputs import EngineOutput
from overnight.pooling_params import RequestParams
from overnight.sampling_params import SamplingParams
from overnight.server.deltas import Pacer, coalesce

log = logging.getLogger("overnight.server")


@dataclass(frozen=True, slots=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True, slots=True)
class Stop:
    """Abort whatever is left and end the thread."""


Command = AddRequest | AbortRequest | Stop
# One request of a generate_many call: (request id, prompt text if known, prompt token ids).
PromptSpec = tuple[str, str | None, list[int]]


class AsyncEngine:
    def __init__(self, engine: EngineClient, metrics: PrometheusObserver | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        # request id -> (the queue of the handler that waits for it, the request's index there)
        self._streams: dict[str, tuple[asyncio.Queue, int]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: BaseException | None = None  # set when a step failed: the engine is dead
        # Requests added and not yet finished, with their n (engine thread only): what a Stop aborts,
        # and what an abort counts when the engine front returns no final output (engines in other
        # processes). Kept here so any front is driven the same way.
        self._live: dict[str, int] = {}
        # Written by the engine thread after every iteration; read anywhere (one reference swap).
        self.stats: SchedulerStats = engine.stats()

    # -- lifecycle (event loop) ---------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="overnight-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Abort every unfinished request and end the engine thread."""
        if self._thread is None:
            return
        self._stopping = True
        self._commands.put(Stop())
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def num_waiting(self) -> int:
        """Requests not yet running: the scheduler's queue plus adds the thread has not applied yet."""
        return self.stats.num_waiting + self._commands.qsize()

    # -- requests (event loop) ----------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: RequestParams,
        prompt: str | None = None,
        stream: bool = True,
    ) -> AsyncGenerator[EngineOutput]:
        """Outputs of one request until it finishes: deltas when stream, else only the final one."""
        prompts = [(request_id, prompt, prompt_token_ids)]
        async with aclosing(self.generate_many(prompts, params, stream)) as outputs:
            async for _, out in outputs:
                yield out

    async def generate_many(
        self,
        prompts: list[PromptSpec],
        params: RequestParams,
        stream: bool = True,
        lora_request: LoRARequest | None = None,
        multi_modal: MultiModalInputs | None = None,
    ) -> AsyncGenerator[tuple[int, EngineOutput]]:
        """(index in `prompts`, output) for several requests (request id, text, token ids) sharing params,
        in the order outputs arrive, until all have finished (RequestOutputs for SamplingParams,
        one PoolingRequestOutput each for PoolingParams).

        Closing the iterator early (a client gone, a cancelled task) aborts the unfinished requests, which
        frees their KV blocks; iterate it inside contextlib.aclosing() so that happens at once."""
        async with aclosing(
            self.generate_batches(prompts, params, stream, lora_request=lora_request, multi_modal=multi_modal)
        ) as batches:
            async for batch in batches:
                for item in batch:
                    yield item

    async def generate_batches(
        self,
        prompts: list[PromptSpec],
        params: RequestParams,
        stream: bool = True,
        stream_interval: int = 1,
        lora_request: LoRARequest | None = None,
        multi_modal: MultiModalInputs | None = None,  # a chat prompt's images (one prompt)
    ) -> AsyncGenerator[list[tuple[int, EngineOutput]]]:
        """generate_many's outputs, as the lists that were waiting each time this task woke: one entry
        per prompt index, streamed deltas that queued up merged (server/deltas.py). A loop that falls
        behind the engine thus sends fewer, larger chunks instead of falling further behind.
        stream_interval > 1 holds each prompt's deltas until they carry that many tokens (deltas.Pacer)."""
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self.error}")
        if self._thread is None or self._stopping:
            raise EngineDeadError("the engine is not running")
        q: asyncio.Queue[tuple[int, EngineOutput | BaseException]] = asyncio.Queue()
        pacer = Pacer(stream_interval) if stream and stream_interval > 1 else None
        now = time.monotonic()
        unfinished: set[str] = set()
        for index, (request_id, text, ids) in enumerate(prompts):
            self._streams[request_id] = (q, index)
            unfinished.add(request_id)
            self._commands.put(
                AddRequest(request_id, list(ids), params, text, stream, now, lora_request, multi_modal)
            )
        try:
            while unfinished:
                waiting = [await q.get()]
                while not q.empty():
                    waiting.append(q.get_nowait())
                error = next((item for _, item in waiting if isinstance(item, BaseException)), None)
                if error is not None:  # what came before it is still delivered
                    waiting = waiting[: next(i for i, (_, item) in enumerate(waiting) if item is error)]
                batch = coalesce(waiting)  # type: ignore[arg-type]  # (the errors were cut off above)
                for _, out in batch:
                    if out.finished:
                        unfinished.discard(out.request_id)
                        self._streams.pop(out.request_id, None)
                if pacer is not None:
                    batch = pacer.due(batch) + (pacer.flush() if error is not None else [])
                if batch:
                    yield batch
                if error is not None and unfinished:  # (after the last final, nothing waits for it)
                    raise error
        finally:
            for request_id in unfinished:
                self._streams.pop(request_id, None)
                self._commands.put(AbortRequest(request_id))

    def abort(self, request_id: str) -> None:
        self._commands.put(AbortRequest(request_id))

    def _deliver(self, items: list[tuple[str, EngineOutput | BaseException]]) -> None:
        for request_id, item in items:
            target = self._streams.get(request_id)
            if target is not None:  # else the handler already left (it sent the abort)
                q, index = target
                q.put_nowait((index, item))

    def _fail_all(self, error: BaseException) -> None:
        for q, index in self._streams.values():
            q.put_nowait((index, error))

    # -- the engine thread --------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            stop = False
            while not stop:
                idle = not engine.has_unfinished_requests()
                replies: list[tuple[str, EngineOutput | BaseException]] = []
                stop = self._apply(self._take_commands(block=idle), replies)
                if not stop and engine.has_unfinished_requests():
                    for out in engine.step():
                        replies.append((out.request_id, out))
                        if out.finished:
                            self._live.pop(out.request_id, None)
                self._publish(replies)
            # Anyone still waiting (an add that raced the stop) hears that nothing more will come.
            self._call_loop(self._fail_all, EngineDeadError("the server is shutting down"))
        except BaseException as e:  # noqa: BLE001 - any failure kills the engine; handlers must hear it
            log.exception("engine thread failed")
            self.error = e
            self._call_loop(self._fail_all, EngineDeadError(f"the engine stopped after an error: {e}"))

    def _take_commands(self, block: bool) -> list[Command]:
        commands = []
        if block:
            commands.append(self._commands.get())
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(
        self, commands: list[Command], replies: list[tuple[str, EngineOutput | BaseException]]
    ) -> bool:
        """Returns True on Stop (after aborting everything left)."""
        engine = self.engine
        for cmd in commands:
            if isinstance(cmd, AddRequest):
                try:
                    engine.add_request(
                        cmd.request_id,
                        cmd.prompt_token_ids,
                        cmd.params,
                        prompt=cmd.prompt,
                        stream=cmd.stream,
                        arrival_time=cmd.arrival_time,
                        lora_request=cmd.lora_request,
                        multi_modal=cmd.multi_modal,
                    )
                    # what an abort ends, for the aborted-requests counter (a pooled prompt is one)
                    params = cmd.params
                    self._live[cmd.request_id] = params.n if isinstance(params, SamplingParams) else 1
                except Exception as e:  # noqa: BLE001 - handlers validate first; this is the backstop
                    replies.append((cmd.request_id, e))
            elif isinstance(cmd, AbortRequest):
                self._abort(cmd.request_id, replies)
            else:
                for rid in list(self._live):
                    self._abort(rid, replies)
                return True
        return False

    def _abort(self, request_id: str, replies: list[tuple[str, EngineOutput | BaseException]]) -> None:
        n = self._live.pop(request_id, 0)
        final = self.engine.abort_request(request_id)
        if final is None:  # already finished, never added, or a front that keeps no outputs
            if n and self.metrics is not None:
                self.metrics.record_aborted(n)
            return
        replies.append((request_id, final))
        if self.metrics is not None:
            self.metrics.record_aborted(sum(c.finish_reason == "abort" for c in final.outputs))

    def _publish(self, replies: list[tuple[str, EngineOutput | BaseException]]) -> None:
        stats = self.engine.stats()
        self.stats = stats
        if self.metrics is not None:
            # Aborts and adds change the queues outside a step: keep the gauges current for scrapes.
            self.metrics.update_gauges(stats)
        if replies:
            self._call_loop(self._deliver, replies)

    def _call_loop(self, fn: Callable[[Any], None], arg: Any) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:  # the loop closed between the check and the call
            pass
