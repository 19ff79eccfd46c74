"""The load of a sweep level: streaming /v1/completions requests through the OpenAI HTTP API.

Closed loop (a concurrency level): N workers each send a request, wait for its last token, and send
the next. Open loop (--request-rate): arrivals at a fixed mean rate, Poisson (gamma gaps of shape
`burstiness`; 1 is Poisson, larger is more regular) or constant, optionally capped in flight.

Every request streams, so each token's arrival time is known: TTFT, TPOT, ITL, and the tokens that
arrived inside the measured window. Prompts are token-id lists (no tokenizer needed on either side)
of random ids, or prompts from a dataset file; answers run to max_tokens (ignore_eos).

Token counting: a chunk carries its tokens in `logprobs.tokens` when logprobs are asked
(token_timing "logprobs": needed when the server has no tokenizer, as its chunks then carry no text),
else one token per chunk with text. The usage chunk gives the exact total; tokens no chunk showed
are counted at the end of the stream.

Many streams cost the client CPU (one JSON event per token): above 64 streams the load runs in
several processes (spawned), which share one start time and one stop time through shared
values. time.monotonic() is system-wide on Linux, so their timestamps compare.
"""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing as mp
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import TypeVar

import httpx

PromptT = str | list[int]
T = TypeVar("T")


@dataclass(frozen=True)
class Workload:
    input_len: int = 128
    output_len: int = 128
    seed: int = 0
    vocab_low: int = 100  # random ids in [vocab_low, vocab_high): clear of special tokens at the start
    vocab_high: int = 32000
    dataset: tuple[tuple[PromptT, int | None], ...] | None = None  # (prompt, output length or None)


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
        return [self.rng.randrange(w.vocab_low, w.vocab_high) for _ in range(w.input_len)], w.output_len


@dataclass(frozen=True)
class LoadSpec:
    url: str  # http://host:port
    model: str
    workload: Workload
    concurrency: int | None  # closed loop: the workers; with a rate: the cap in flight (None: none)
    request_rate: float | None = None  # requests/s; None: closed loop
    arrival: str = "poisson"  # "poisson" | "constant"
    burstiness: float = 1.0
    token_timing: str = "text"  # "text" | "logprobs"
    api_key: str | None = None
    level: str = "0"  # names the prompt streams, so no two levels send the same prompt
    workers: tuple[int, ...] = ()  # the worker ids this process runs (closed loop)
    rate_share: float = 1.0  # this process's share of the rate (open loop)


@dataclass
class RequestRecord:
    start: float
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    end: float | None = None  # the stream finished; None: cut at the stop, or failed
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None


# -- the shared start/stop --------------------------------------------------------------------------


class LocalControl:
    """Start, stop and warm-up progress when the load runs in this process."""

    def __init__(self) -> None:
        self.t0 = 0.0  # 0: not started yet
        self.stop = math.inf
        self.firsts = 0  # workers that finished their first request
        self.ready = 0  # parts of the load that are connected and waiting for t0

    def start_time(self) -> float:
        return self.t0

    def set_start(self, t: float) -> None:
        self.t0 = t

    def set_stop(self, t: float) -> None:
        self.stop = t

    def mark_ready(self) -> None:
        self.ready += 1

    def num_ready(self) -> int:
        return self.ready

    def stop_time(self) -> float:
        return self.stop

    def first_done(self) -> None:
        self.firsts += 1

    def num_first_done(self) -> int:
        return self.firsts


class SharedControl:
    """The same, in shared memory for spawned load processes."""

    def __init__(self, ctx: mp.context.BaseContext) -> None:
        self.t0 = ctx.Value("d", 0.0)
        self.stop = ctx.Value("d", math.inf)
        self.firsts = ctx.Value("i", 0)
        self.ready = ctx.Value("i", 0)

    def start_time(self) -> float:
        return self.t0.value

    def set_start(self, t: float) -> None:
        self.t0.value = t

    def set_stop(self, t: float) -> None:
        self.stop.value = t

    def mark_ready(self) -> None:
        with self.ready.get_lock():
            self.ready.value += 1

    def num_ready(self) -> int:
        return self.ready.value

    def stop_time(self) -> float:
        return self.stop.value

    def first_done(self) -> None:
        with self.firsts.get_lock():
            self.firsts.value += 1

    def num_first_done(self) -> int:
        return self.firsts.value


Control = LocalControl | SharedControl


# -- one request ------------------------------------------------------------------------------------


async def send_one(
    client: httpx.AsyncClient, spec: LoadSpec, prompt: PromptT, max_tokens: int, rec: RequestRecord
) -> None:
    body: dict[str, object] = {
        "model": spec.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if isinstance(prompt, list):
        rec.prompt_tokens = len(prompt)  # known before the usage chunk, which a cut stream never gets
    if spec.token_timing == "logprobs":
        body["logprobs"] = 0  # the sampled token's only: the cheapest way to see each token
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                rec.error = f"HTTP {r.status_code}: {r.text[:200]}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.monotonic()
                chunk = json.loads(data)
                if chunk.get("error"):
                    rec.error = str(chunk["error"].get("message", chunk["error"]))[:200]
                    return
                usage = chunk.get("usage")
                if usage:
                    rec.prompt_tokens = usage.get("prompt_tokens", 0)
                    rec.output_tokens = usage.get("completion_tokens", 0)
                for choice in chunk.get("choices") or ():
                    n = chunk_tokens(choice)
                    if n:
                        rec.chunk_times.append(now)
                        rec.chunk_tokens.append(n)
    except (httpx.HTTPError, ValueError) as e:
        rec.error = f"{type(e).__name__}: {e}"[:200]
        return
    rec.end = time.monotonic()
    missing = rec.output_tokens - sum(rec.chunk_tokens)
    if missing > 0:  # merged text, or a server that streams no per-token chunks
        rec.chunk_times.append(rec.end)
        rec.chunk_tokens.append(missing)
    if not rec.output_tokens:
        rec.output_tokens = sum(rec.chunk_tokens)


def chunk_tokens(choice: dict) -> int:
    lp = choice.get("logprobs")
    if lp and lp.get("tokens") is not None:
        return len(lp["tokens"])
    # The server sends one chunk per generated token, with empty text when the token shows none yet
    # (no tokenizer, or text held back); a final chunk with only a finish reason carries no token.
    if choice.get("text") or (choice.get("finish_reason") is None and "text" in choice):
        return 1
    return 0


# -- the loops --------------------------------------------------------------------------------------


async def _sleep_until(t: float) -> None:
    delay = t - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)


async def _worker(
    client: httpx.AsyncClient, spec: LoadSpec, w: int, control: Control, records: list[RequestRecord]
) -> None:
    prompts = Prompts(spec.workload, f"{spec.level}/w{w}")
    n = spec.concurrency or 1
    await _sleep_until(control.start_time())
    first = True
    while time.monotonic() < control.stop_time():
        prompt, n_out = prompts.next()
        if first:
            # First answers of 1/N, 2/N, ... of the length: completions spread out at once, so the
            # loop reaches its steady mix within one request's life, not after many synchronized waves.
            n_out = max(1, -(-n_out * (w + 1) // n))
        rec = RequestRecord(start=time.monotonic())
        records.append(rec)
        await send_one(client, spec, prompt, n_out, rec)
        if first:
            control.first_done()
            first = False
        if rec.error is not None:
            await asyncio.sleep(0.05)  # a refusing server must not be hammered in a tight loop


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

    async def one(prompt: PromptT, n_out: int) -> None:
        rec = RequestRecord(start=time.monotonic())
        records.append(rec)
        if cap is None:
            await send_one(client, spec, prompt, n_out, rec)
            return
        async with cap:  # queued on the client side: its TTFT includes the wait, as a user's would
            await send_one(client, spec, prompt, n_out, rec)

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
        while True:
            stop = control.stop_time()
            now = time.monotonic()
            if now >= stop or all(t.done() for t in tasks):
                break
            await asyncio.sleep(min(0.05, stop - now))
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return records


# -- several processes ------------------------------------------------------------------------------


def split(spec: LoadSpec, processes: int) -> list[LoadSpec]:
    """One spec per process: workers dealt round robin, or an equal share of the rate and the cap."""
    if spec.request_rate is None:
        workers = tuple(range(spec.concurrency or 1))
        return [
            replace(spec, workers=workers[p::processes]) for p in range(processes) if workers[p::processes]
        ]
    cap = -(-spec.concurrency // processes) if spec.concurrency else None
    return [
        replace(spec, workers=(p,), rate_share=1.0 / processes, concurrency=cap) for p in range(processes)
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


def _process_main(spec: LoadSpec, control: SharedControl, out: mp.Queue) -> None:
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
    time is set and `controller(control)` runs: it watches the warm-up and sets the stop time. Returns
    every request's record and what the controller returned."""
    specs = split(spec, max(processes, 1))
    if processes <= 1:
        control: Control = LocalControl()
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
    control = SharedControl(ctx)
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


STREAMS_PER_PROCESS = (
    64  # a token event costs the client ~50-150 us of CPU: keep each process well under a core
)


def auto_processes(spec: LoadSpec, cpu_count: int) -> int:
    """One process per STREAMS_PER_PROCESS streams, on at most half the cores (the server may run here)."""
    if spec.request_rate is None:
        streams = spec.concurrency or 1
    else:
        streams = spec.concurrency or math.ceil(spec.request_rate * 4)
    return max(1, min(max(cpu_count // 2, 1), math.ceil(streams / STREAMS_PER_PROCESS)))
