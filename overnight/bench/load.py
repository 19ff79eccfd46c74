"""The load of a sweep level: streaming /v1/completions requests through the OpenAI HTTP API.

Closed loop (a concurrency level): N workers each send a request, wait for its last token, and send
the next. Worker w starts ramp_s * w / N after the others' common start, and its first answer has a
random length in [1, output_len]: however long a request lives at this level, the workers' phases
then spread evenly over a request's life (the sum of a uniform start and a uniform first length,
folded over one lifetime, is uniform), so they never move in waves, and the ramp spreads the first
prompts' prefill instead of piling it into the first steps.

With answers all of one length, though, nothing spreads phases that something else bunched: every
running request gets one token a step, so clients that once finish together (after a stall, a burst,
a preemption) finish together one life later, and again, for good; the step budget only caps such a
band's density. On the H200 1,024 clients of 512 in / 256 out ran as one band for the whole
window. Workload.output_len_range (`bench sweep --output-len-range`) draws each answer's length around
output_len, so a band dissolves within a few lives, as it does under real answers of varied length.

Open loop (--request-rate): arrivals at a fixed mean rate, Poisson (gamma gaps of shape `burstiness`;
1 is Poisson, larger is more regular) or constant, optionally capped in flight.

Every request streams (client.py), so each token's arrival time is known: TTFT, TPOT, ITL, and the
tokens that arrived inside the measured window. Prompts are token-id lists (no tokenizer needed on
either side) of random ids, or prompts from a dataset file; answers run to max_tokens (ignore_eos).

Many streams cost the client CPU (a JSON event per chunk): above 64 streams the load runs in several
processes (spawned), which share one start time, one stop time and live progress counters (tokens,
prompt tokens, finished requests) through shared memory, so the controller can watch a level reach
its steady state while it runs. time.monotonic() is system-wide on Linux, so timestamps compare.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing as mp
import multiprocessing.connection
import os
import random
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TypeVar

import httpx

from overnight.bench.client import PromptT, RequestRecord, send_one

T = TypeVar("T")


@dataclass(frozen=True)
class Workload:
    input_len: int = 128
    output_len: int = 128
    seed: int = 0
    vocab_low: int = 100  # random ids in [vocab_low, vocab_high): clear of special tokens at the start
    vocab_high: int = 32000
    dataset: tuple[tuple[PromptT, int | None], ...] | None = None  # (prompt, output length or None)
    # Random prompts: each answer's length drawn uniformly from output_len_bounds (0: all equal).
    output_len_range: float = 0.0


def output_len_bounds(w: Workload) -> tuple[int, int]:
    """Shortest and longest answer of random prompts: output_len * (1 -+ output_len_range), rounded."""
    r = w.output_len_range
    return max(1, round(w.output_len * (1 - r))), max(1, round(w.output_len * (1 + r)))


class Prompts:
    """The prompts of one stream (a worker, or one process's arrivals), the same on every run."""

    def __init__(self, workload: Workload, stream: str) -> None:
        self.w = workload
        self.rng = random.Random(f"{workload.seed}/{stream}")
        self.i = self.rng.randrange(len(workload.dataset)) if workload.dataset else 0

    def next(self) -> tuple[PromptT, int]:
        w = self.w
        if w.dataset:
            prompt, n_out = w.dataset[self.i % len(w.dataset)]
            self.i += 1
            return prompt, n_out or w.output_len
        prompt = [self.rng.randrange(w.vocab_low, w.vocab_high) for _ in range(w.input_len)]
        return prompt, self.rng.randint(*output_len_bounds(w)) if w.output_len_range else w.output_len


@dataclass(frozen=True)
class LoadSpec:
    url: str  # http://host:port
    model: str
    workload: Workload
    concurrency: int | None  # closed loop: the workers; with a rate: the cap in flight (None: none)
    request_rate: float | None = None  # requests/s; None: closed loop
    arrival: str = "poisson"  # "poisson" | "constant"
    burstiness: float = 1.0
    token_timing: str = "usage"  # "usage" | "logprobs" | "text" (client.py)
    api_key: str | None = None
    level: str = "0"  # names the prompt streams, so no two levels send the same prompt
    ramp_s: float = 0.0  # closed loop: worker w of N starts ramp_s * w / N after the start
    workers: tuple[int, ...] = ()  # the worker ids this process runs (closed loop)
    rate_share: float = 1.0  # this process's share of the rate (open loop)
    part: int = 0  # this process's slot in the progress counters


# -- the shared start/stop and progress ---------------------------------------------------------------

# Progress counters per part: output tokens, prompt tokens (credited at a request's first token, as the
# window's total tok/s counts them), requests finished without error; and the client's own loop lag since
# the controller last took it (its sum, count of ticks and largest), which says whether the load
# generator kept up: clients that are not running or waiting on the server either wait in its front end
# or were never sent by a client that fell behind, and only this tells the two apart.
OUT, PROMPT, DONE, LAG_SUM, LAG_TICKS, LAG_MAX = range(6)
SLOTS = 6
LAG_TICK_S = 0.05  # the lag monitor's sleep: 20 wake-ups a second per process


class LocalControl:
    """Start, stop and progress when the load runs in this process."""

    def __init__(self, parts: int = 1) -> None:
        self.t0 = 0.0  # 0: not started yet
        self.stop = math.inf
        self.ready = 0  # parts of the load that are connected and waiting for t0
        self.counts = [0.0] * (SLOTS * parts)

    def start_time(self) -> float:
        return self.t0

    def set_start(self, t: float) -> None:
        self.t0 = t

    def set_stop(self, t: float) -> None:
        self.stop = t

    def stop_time(self) -> float:
        return self.stop

    def mark_ready(self) -> None:
        self.ready += 1

    def num_ready(self) -> int:
        return self.ready

    def add(self, part: int, what: int, n: float) -> None:
        self.counts[SLOTS * part + what] += n

    def totals(self) -> tuple[float, float, float]:
        """(output tokens, prompt tokens, finished requests) over every part."""
        c = self.counts
        return sum(c[OUT::SLOTS]), sum(c[PROMPT::SLOTS]), sum(c[DONE::SLOTS])

    def note_lag(self, part: int, lag_s: float) -> None:
        i = SLOTS * part
        self.counts[i + LAG_SUM] += lag_s
        self.counts[i + LAG_TICKS] += 1
        self.counts[i + LAG_MAX] = max(self.counts[i + LAG_MAX], lag_s)

    def take_lag(self) -> tuple[float | None, float | None]:
        """(mean, largest) loop lag in seconds over every part since the last call, which restarts the
        count; None before any tick. A part may add a tick while this clears: one tick lost."""
        c = self.counts
        ticks = sum(c[LAG_TICKS::SLOTS])
        mean = sum(c[LAG_SUM::SLOTS]) / ticks if ticks else None
        top = max(c[LAG_MAX::SLOTS]) if ticks else None
        for i in range(0, len(c), SLOTS):
            c[i + LAG_SUM] = c[i + LAG_TICKS] = c[i + LAG_MAX] = 0.0
        return mean, top


class SharedControl(LocalControl):
    """The same in shared memory, for spawned load processes. Each part writes only its own slots,
    so the counters need no lock."""

    def __init__(self, ctx: mp.context.BaseContext, parts: int) -> None:
        self._t0 = ctx.Value("d", 0.0)
        self._stop = ctx.Value("d", math.inf)
        self._ready = ctx.Value("i", 0)
        self.counts = ctx.Array("d", SLOTS * parts, lock=False)  # type: ignore[assignment]

    def start_time(self) -> float:
        return self._t0.value

    def set_start(self, t: float) -> None:
        self._t0.value = t

    def set_stop(self, t: float) -> None:
        self._stop.value = t

    def stop_time(self) -> float:
        return self._stop.value

    def mark_ready(self) -> None:
        with self._ready.get_lock():
            self._ready.value += 1

    def num_ready(self) -> int:
        return self._ready.value


Control = LocalControl | SharedControl


# -- the loops --------------------------------------------------------------------------------------


async def _sleep_until(t: float) -> None:
    delay = t - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)


def _progress(spec: LoadSpec, control: Control) -> Callable[[int, int], None]:
    def note(out_tokens: int, prompt_tokens: int) -> None:
        control.add(spec.part, OUT, out_tokens)
        if prompt_tokens:
            control.add(spec.part, PROMPT, prompt_tokens)

    return note


def start_offset(spec: LoadSpec, w: int) -> float:
    """Seconds after the common start at which worker w begins."""
    return spec.ramp_s * w / (spec.concurrency or 1)


def first_answer_len(spec: LoadSpec, w: int, n_out: int) -> int:
    """Worker w's first answer: a length drawn uniformly from [1, n_out], the same on every run."""
    return random.Random(f"{spec.workload.seed}/{spec.level}/first{w}").randint(1, n_out)


async def _worker(
    client: httpx.AsyncClient, spec: LoadSpec, w: int, control: Control, records: list[RequestRecord]
) -> None:
    prompts = Prompts(spec.workload, f"{spec.level}/w{w}")
    progress = _progress(spec, control)
    await _sleep_until(control.start_time() + start_offset(spec, w))
    first = True
    while time.monotonic() < control.stop_time():
        prompt, n_out = prompts.next()
        shortened = first
        if first:  # see the module docstring: phases spread whatever a request's life
            n_out = first_answer_len(spec, w, n_out)
            first = False
        rec = RequestRecord(start=time.monotonic(), shortened=shortened)
        records.append(rec)
        await send_one(client, spec, prompt, n_out, rec, progress)
        if rec.error is not None:
            await asyncio.sleep(0.05)  # a refusing server must not be hammered in a tight loop
        elif rec.end is not None:
            control.add(spec.part, DONE, 1)


def arrival_gap(rng: random.Random, rate: float, arrival: str, burstiness: float) -> float:
    if arrival == "constant":
        return 1.0 / rate
    return rng.gammavariate(burstiness, 1.0 / (rate * burstiness))  # mean 1/rate


async def _arrivals(
    client: httpx.AsyncClient, spec: LoadSpec, control: Control, records: list[RequestRecord]
) -> None:
    assert spec.request_rate is not None
    rate = spec.request_rate * spec.rate_share
    prompts = Prompts(spec.workload, f"{spec.level}/r{spec.workers}")
    rng = random.Random(f"{spec.workload.seed}/{spec.level}/gaps{spec.workers}")
    cap = asyncio.Semaphore(spec.concurrency) if spec.concurrency else None
    inflight: set[asyncio.Task] = set()
    progress = _progress(spec, control)

    async def one(prompt: PromptT, n_out: int) -> None:
        rec = RequestRecord(start=time.monotonic())
        records.append(rec)
        if cap is None:
            await send_one(client, spec, prompt, n_out, rec, progress)
        else:
            async with cap:  # queued on the client side: its TTFT includes the wait, as a user's would
                await send_one(client, spec, prompt, n_out, rec, progress)
        if rec.end is not None and rec.error is None:
            control.add(spec.part, DONE, 1)

    t = control.start_time()
    try:
        while True:
            t += arrival_gap(rng, rate, spec.arrival, spec.burstiness)
            await _sleep_until(t)
            if time.monotonic() >= control.stop_time():
                return
            task = asyncio.create_task(one(*prompts.next()))
            inflight.add(task)
            task.add_done_callback(inflight.discard)
    finally:
        for task in list(inflight):
            task.cancel()
        await asyncio.gather(*inflight, return_exceptions=True)


async def _watch_lag(spec: LoadSpec, control: Control) -> None:
    """How late this loop wakes from a short sleep: a loop busy with more streams than it can parse
    falls behind, and every request it sends and every token it reads then comes late."""
    while True:
        t = time.monotonic()
        await asyncio.sleep(LAG_TICK_S)
        control.note_lag(spec.part, max(time.monotonic() - t - LAG_TICK_S, 0.0))


async def drive(spec: LoadSpec, control: Control) -> list[RequestRecord]:
    """Run this process's share of the load from control's start until its stop time, then cut what
    is in flight (closing a stream aborts its request on the server)."""
    records: list[RequestRecord] = []
    n = max(len(spec.workers), spec.concurrency or 0, 1)
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else None
    timeout = httpx.Timeout(None, connect=60.0)
    async with httpx.AsyncClient(
        base_url=spec.url, limits=limits, timeout=timeout, headers=headers
    ) as client:
        control.mark_ready()
        while control.start_time() == 0.0:
            await asyncio.sleep(0.005)
        if spec.request_rate is None:
            tasks = [asyncio.create_task(_worker(client, spec, w, control, records)) for w in spec.workers]
        else:
            tasks = [asyncio.create_task(_arrivals(client, spec, control, records))]
        lag = asyncio.create_task(_watch_lag(spec, control))
        while True:
            stop = control.stop_time()
            now = time.monotonic()
            if now >= stop or all(t.done() for t in tasks):
                break
            await asyncio.sleep(min(0.05, stop - now))
        for t in [*tasks, lag]:
            t.cancel()
        await asyncio.gather(*tasks, lag, return_exceptions=True)
    return records


# -- several processes ------------------------------------------------------------------------------


def split(spec: LoadSpec, processes: int) -> list[LoadSpec]:
    """One spec per process: workers dealt round robin (so each process's start offsets spread over
    the whole ramp), or an equal share of the rate and the cap."""
    if spec.request_rate is None:
        workers = tuple(range(spec.concurrency or 1))
        dealt = [workers[p::processes] for p in range(processes) if workers[p::processes]]
        return [replace(spec, workers=ws, part=p) for p, ws in enumerate(dealt)]
    cap = -(-spec.concurrency // processes) if spec.concurrency else None
    return [
        replace(spec, workers=(p,), rate_share=1.0 / processes, concurrency=cap, part=p)
        for p in range(processes)
    ]


def run_async(coro: Awaitable[T]) -> T:
    """asyncio.run, on uvloop where it is installed: it roughly halves the client's CPU per token event,
    which is what a load of many streams spends its time on."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)  # type: ignore[arg-type]
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)  # type: ignore[arg-type]


def _exit_with_parent() -> None:
    """End this load process when the process that spawned it dies. A parent killed outright (SIGKILL, a
    crash, a timeout that signals the parent alone) runs no clean-up, and its load processes would go on
    sending requests forever: to the next server that takes the port, on the same machine, as a load
    nobody sees. Leaving abruptly closes the streams, which aborts their requests on the server."""
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        mp.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _process_main(spec: LoadSpec, control: SharedControl, out: mp.Queue) -> None:
    _exit_with_parent()
    try:
        records = run_async(drive(spec, control))
        out.put(("ok", records))
    except BaseException as e:  # noqa: BLE001 - the parent must hear of any failure
        out.put(("error", f"{type(e).__name__}: {e}"))


async def run_load(
    spec: LoadSpec,
    processes: int,
    controller: Callable[[Control], Awaitable[T]],
) -> tuple[list[RequestRecord], T]:
    """Run the load in `processes` processes (1: this one). Once every part is connected, the start
    time is set and `controller(control)` runs: it watches the progress and sets the stop time.
    Returns every request's record and what the controller returned."""
    specs = split(spec, max(processes, 1))
    if processes <= 1:
        control: Control = LocalControl(len(specs))
        parts = [asyncio.create_task(drive(s, control)) for s in specs]
        try:
            await _start_when_ready(control, len(parts), lambda: any(p.done() for p in parts))
            result = await controller(control)
        except BaseException:
            control.set_stop(0.0)
            await asyncio.gather(*parts, return_exceptions=True)
            raise
        done = await asyncio.gather(*parts)
        return [r for part in done for r in part], result
    ctx = mp.get_context("spawn")
    control = SharedControl(ctx, len(specs))
    out = ctx.Queue()
    procs = [ctx.Process(target=_process_main, args=(s, control, out), daemon=True) for s in specs]
    for p in procs:
        p.start()
    try:
        await _start_when_ready(control, len(procs), lambda: not all(p.is_alive() for p in procs))
        result = await controller(control)
        records: list[RequestRecord] = []
        for _ in procs:
            status, payload = await asyncio.to_thread(out.get, True, 300.0)
            if status != "ok":
                raise RuntimeError(f"a load process failed: {payload}")
            records.extend(payload)
    except BaseException:
        control.set_stop(0.0)
        raise
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    return records, result


async def _start_when_ready(control: Control, parts: int, failed: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 120.0
    while control.num_ready() < parts:
        if failed() or time.monotonic() > deadline:
            raise RuntimeError("the load processes did not start")
        await asyncio.sleep(0.01)
    control.set_start(time.monotonic())


# A token event costs the client ~50-150 us of CPU: keep each process well under a core.
STREAMS_PER_PROCESS = 64


def auto_processes(spec: LoadSpec, cpu_count: int) -> int:
    """One process per STREAMS_PER_PROCESS streams, on at most half the cores (the server may run here)."""
    if spec.request_rate is None:
        streams = spec.concurrency or 1
    else:
        streams = spec.concurrency or math.ceil(spec.request_rate * 4)
    return max(1, min(max(cpu_count // 2, 1), math.ceil(streams / STREAMS_PER_PROCESS)))
