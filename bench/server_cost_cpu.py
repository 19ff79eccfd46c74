"""What the server costs per streamed token on the host, against the engine alone (CPU, no model).

    PYTHONPATH=. python bench/server_cost_cpu.py host [--clients 256] [--step-ms 40] [--profile]
    PYTHONPATH=. python bench/server_cost_cpu.py host --uvicorn asyncio-h11
    PYTHONPATH=. python bench/server_cost_cpu.py host --server-code /tmp/before --modes inproc
    PYTHONPATH=. python bench/server_cost_cpu.py model [--server-code DIR]

`host`: the engine runs on an emulated device (every step sleeps --step-ms, GIL released, as a CUDA
step runs while the host waits), so all the CPU the server process spends is the server's own: the
engine's host work, the handoff to the event loop, HTTP/SSE, JSON. Measured per thread with
pthread CPU clocks, per output token the clients received, for:

    engine alone   the Engine stepping N streaming requests (a closed loop in one thread)
    inproc         the server with its engine in a thread of the HTTP process (--no-engine-process)
    process        the server with its engine in a process of its own (the default for serve)

--profile adds the event loop's profile grouped by what it does (profiling slows the loop: read the
shares, not that run's CPU per token). --uvicorn asyncio-h11 forces uvicorn's pure-Python stack where
uvloop and httptools are installed (auto picks them), for an A/B within one install. --server-code DIR
runs the server from another checkout (e.g. `git archive <commit> overnight | tar -x -C DIR`) for a
before/after.

`model`: the embedded default model on the CPU: `bench throughput` on N requests of fixed lengths,
then the same lengths through the real server (subprocess) at N clients, one steady-state level of the
sweep; prints the ratio.

Clients run in other processes (the sweep's load generator). Numbers are CPU time, so another load
on the machine slows the run but changes them little; wall-clock rates on a shared CPU are not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
VOCAB = 32000


# -- the emulated device (runs inside the server process, old or new code) --------------------------


class _Handle:
    def __init__(self, device, ids, tokens, ready: float) -> None:
        self.device, self.ids, self.tokens, self.ready = device, ids, tokens, ready
        self.out = None

    def result(self):
        from overnight.engine.step_io import ModelRunnerOutput

        if self.out is None:
            delay = self.ready - time.perf_counter()
            if delay > 0:
                time.sleep(delay)  # the device computes; the GIL is free, as in a CUDA sync
            self.device.states.resolve(self.ids, self.tokens)
            self.out = ModelRunnerOutput(self.ids, self.tokens)
        return self.out


class EmulatedDevice:
    """A runner whose step takes step_ms on a 'device' that runs one step ahead of the host."""

    supports_async = True

    def __init__(self, step_ms: float) -> None:
        from overnight.runner.request_state import RequestStates

        self.states = RequestStates()
        self.step_s = step_ms / 1e3
        self.busy_until = 0.0
        self.rng = random.Random(0)

    def launch(self, out):
        sampled = self.states.begin(self.states.apply(out))
        start = max(time.perf_counter(), self.busy_until)
        self.busy_until = start + self.step_s
        ids = [s.req_id for s in sampled]
        return _Handle(self, ids, [self.rng.randrange(100, VOCAB - 1000) for _ in ids], self.busy_until)

    def execute(self, out):
        return self.launch(out).result()


def _source():
    """The model an emulated engine reports: token ids only (no tokenizer), EOS id 2."""
    from overnight.arch import ModelArch
    from overnight.loader.source import ModelSource

    arch = ModelArch("llama", VOCAB, 8, 16, 1, 1, 1, 8)
    return ModelSource("dummy", "emulated", arch, "LlamaForCausalLM", None, (2,), None, None, "emulated")


def emulated_engine(step_ms: float, max_num_seqs: int = 1024):
    import torch

    from overnight.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from overnight.engine.engine import Engine
    from overnight.runner.kv_pool import PoolPlan

    source = _source()
    config = EngineConfig(
        model=ModelConfig(model="emulated", arch=source.arch, dtype=torch.float32),
        cache=CacheConfig(block_size=16, enable_prefix_caching=True),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=8192,
            max_model_len=4096,
            enable_chunked_prefill=True,
        ),
    )
    return Engine(config, EmulatedDevice(step_ms), source, PoolPlan(200_000, 1, 1, False))


def _emulated_factory(step_ms: float, _opts) -> object:
    """ProcessLinks' engine factory, called in the engine process: the emulated engine, whatever the
    options say (module level, so spawn can pickle it by name)."""
    return emulated_engine(step_ms)


def _process_front(step_ms: float):
    """The server's engine-process front: a one-engine DataParallelEngine over ProcessLinks, as
    build_engine makes it for serve, but with the emulated engine as the links' factory."""
    import functools

    from overnight.options import EngineOptions
    from overnight.parallel.dp import DataParallelEngine
    from overnight.parallel.links import ProcessLinks

    # device="cpu": ProcessLinks only picks the device to give the child its environment.
    links = ProcessLinks(EngineOptions(device="cpu"), 1, functools.partial(_emulated_factory, step_ms))
    return DataParallelEngine(links, _source(), None)


def serve(mode: str, step_ms: float, profile: bool, stack: str, stream_interval: int) -> None:
    """The server process: print its URL, then answer 'mark' / 'report' lines on stdin with CPU use."""
    import cProfile

    import psutil

    from overnight.metrics import hide_created_series
    from overnight.server.background import BackgroundServer
    from overnight.server.cli import ServerOptions, make_app

    hide_created_series()
    engine = emulated_engine(step_ms) if mode == "inproc" else _process_front(step_ms)
    # Only a forced stack is passed on: a --server-code checkout may predate BackgroundServer's loop/http.
    forced = {"loop": "asyncio", "http": "h11"} if stack == "asyncio-h11" else {}
    # Named only when set, so a --server-code checkout older than the option still runs.
    paced = {"stream_interval": stream_interval} if stream_interval != 1 else {}
    opts = ServerOptions(access_log=False, log_level="warning", **paced)
    app = make_app(engine, opts)
    server = BackgroundServer(app, **forced).start()
    print(server.url, flush=True)
    engine_thread = next(t for t in threading.enumerate() if t.name == "overnight-engine")
    loop = next(o for o in _async_engines()).__dict__["_loop"]
    # What uvicorn picked: the loop's module (asyncio or uvloop) and the HTTP protocol's (h11 or httptools).
    protocol = server.server.config.http_protocol_class
    used = f"{type(loop).__module__.split('.')[0]}+{protocol.__module__.rsplit('.', 1)[-1].removesuffix('_impl')}"
    me = psutil.Process()

    def cpu(t: threading.Thread) -> float:
        return time.clock_gettime(time.pthread_getcpuclockid(t.ident))

    def children_cpu() -> float:
        return sum(sum(c.cpu_times()[:2]) for c in me.children(recursive=True))

    # The loop thread's CPU clock, not wall time: an idle loop waits in epoll, which is no cost, and
    # uvloop waits in C where the profiler cannot see it, so wall time would not compare the stacks.
    prof = cProfile.Profile(time.thread_time)
    mark = None
    for line in sys.stdin:
        now = (
            time.perf_counter(),
            cpu(engine_thread),
            cpu(server._thread),
            children_cpu(),
            sum(me.cpu_times()[:2]),
        )
        if line.strip() == "mark":
            mark = now
            if profile:
                loop.call_soon_threadsafe(prof.enable)
        elif line.strip() == "report":
            text = ""
            if profile:
                done = threading.Event()
                loop.call_soon_threadsafe(lambda ev=done: (prof.disable(), ev.set()))
                done.wait()
                text = _grouped_profile(prof)
            d = [b - a for a, b in zip(mark, now, strict=True)]
            keys = ("wall_s", "engine_thread_s", "loop_thread_s", "engine_process_s", "server_process_s")
            print(json.dumps({**dict(zip(keys, d, strict=True)), "stack": used, "profile": text}), flush=True)
        elif line.strip() == "quit":
            break
    server.stop()


def _async_engines():
    import gc
    import warnings

    from overnight.server.async_engine import AsyncEngine

    with warnings.catch_warnings():  # isinstance() on every object touches torch's deprecated aliases
        warnings.simplefilter("ignore", FutureWarning)
        return [o for o in gc.get_objects() if isinstance(o, AsyncEngine)]


GROUPS = (  # (label, substrings of a profiled function's file:name) in the order they are tried
    # uvloop's transports are its C classes (TCPTransport, UVStream...); its loop is uvloop.loop.Loop.
    (
        "HTTP (uvicorn, h11/httptools, socket writes)",
        ("uvicorn", "h11", "httptools", "selector_events", "_socket", "uvloop.loop.TCP", "uvloop.loop.UV"),
    ),
    ("framework (starlette, fastapi, anyio)", ("starlette", "fastapi", "anyio")),
    ("JSON encoding", ("json/",)),
    ("chunk objects (openai_api/convert.py)", ("openai_api",)),
    ("stream handler, deltas, handoff (server/)", ("overnight/server",)),
    ("asyncio queues and loop", ("asyncio", "uvloop", "select.epoll", "_contextvars")),
)


def _grouped_profile(prof) -> str:
    import pstats

    stats = pstats.Stats(prof).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, callers)

    def group_of(func, seen: frozenset = frozenset()) -> str:
        file, _, name = func
        own = next((g for g, keys in GROUPS if any(k in f"{file}:{name}" for k in keys)), None)
        callers = stats[func][4] if func in stats else {}
        if own is not None or func in seen or not callers:
            return own or "other"
        # Builtins and stdlib helpers (dataclasses.replace, getattr...) count for the code that called
        # them: the group of the caller they spent the most time under.
        top = max(callers, key=lambda c: callers[c][2])
        return group_of(top, seen | {func})

    total = sum(v[2] for v in stats.values())
    groups: dict[str, float] = {}
    for func, (_, _, tottime, _, _) in stats.items():
        label = group_of(func)
        groups[label] = groups.get(label, 0.0) + tottime
    return json.dumps({g: round(t / total, 3) for g, t in sorted(groups.items(), key=lambda kv: -kv[1])})


# -- the measurements (this process) ----------------------------------------------------------------


def engine_alone(clients: int, input_len: int, output_len: int, seconds: float) -> dict[str, float]:
    """The engine stepping `clients` streaming requests in a closed loop, in this thread, no device time."""
    from overnight.sampling_params import SamplingParams

    engine = emulated_engine(0.0)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    count = 0

    def add() -> None:
        nonlocal count
        prompt = [rng.randrange(100, VOCAB - 1000) for _ in range(input_len)]
        engine.add_request(f"r{count}", prompt, params, stream=True)
        count += 1

    for _ in range(clients):
        add()
    tokens = steps = 0
    c0, t0 = time.thread_time(), time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for out in engine.step():
            tokens += sum(len(c.token_ids) for c in out.outputs)
            if out.finished:
                add()
        steps += 1
    cpu = time.thread_time() - c0
    return {"tokens": tokens, "steps": steps, "engine_us_per_token": 1e6 * cpu / tokens}


def through_server(args: argparse.Namespace, mode: str) -> dict[str, object]:
    from overnight.bench.level import window_stats
    from overnight.bench.load import LoadSpec, Workload, run_async, run_load

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([args.server_code or ROOT, ROOT]))
    cmd = [
        sys.executable,
        __file__,
        "_serve",
        mode,
        str(args.step_ms),
        args.uvicorn,
        str(args.stream_interval),
    ] + (["--profile"] if args.profile else [])
    server = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        url = server.stdout.readline().strip()
        if not url.startswith("http"):
            raise RuntimeError(f"the server did not start ({mode})")
        timing = args.timing or ("text" if args.server_code else "usage")
        workload = Workload(args.input_len, args.output_len, vocab_high=VOCAB - 1000)
        spec = LoadSpec(url, "emulated", workload, concurrency=args.clients, token_timing=timing, ramp_s=1.0)

        async def controller(control):
            await asyncio.sleep(args.warmup_s)
            w0 = time.monotonic()
            server.stdin.write("mark\n")
            server.stdin.flush()
            await asyncio.sleep(args.window_s)
            server.stdin.write("report\n")
            server.stdin.flush()
            w1 = time.monotonic()
            control.set_stop(w1)
            return w0, w1

        records, (w0, w1) = run_async(run_load(spec, args.client_processes, controller))
        report = json.loads(server.stdout.readline())
    finally:
        if server.poll() is None:
            server.stdin.write("quit\n")
            server.stdin.flush()
            server.wait(30)
    stats = window_stats(records, w0, w1)
    tokens = stats["output_tokens"]
    chunks = sum(1 for r in records for t in r.chunk_times if w0 <= t < w1)
    wall = report["wall_s"]
    row: dict[str, object] = {
        "mode": mode,
        "server_code": args.server_code or "this checkout",
        "stack": report["stack"],
        "output_tok_s": stats["output_tok_s"],
        "ideal_tok_s": round(args.clients / (args.step_ms / 1e3), 1),
        "tokens_per_chunk": round(tokens / chunks, 2) if chunks else None,
    }
    for key in ("engine_thread_s", "loop_thread_s", "engine_process_s", "server_process_s"):
        row[key.replace("_s", "_us_per_token")] = round(1e6 * report[key] / tokens, 1)
        row[key.replace("_s", "_busy")] = round(report[key] / wall, 3)
    if report["profile"]:
        row["loop_profile"] = json.loads(report["profile"])
    return row


def host(args: argparse.Namespace) -> None:
    rows: list[dict[str, object]] = []
    alone = engine_alone(args.clients, args.input_len, args.output_len, seconds=5.0)
    print(
        f"engine alone, {args.clients} streams: {alone['engine_us_per_token']:.1f} us/token", file=sys.stderr
    )
    for mode in args.modes:
        rows.append(through_server(args, mode))
        print(json.dumps(rows[-1]), file=sys.stderr)
    print(
        f"\n{args.clients} clients, {args.input_len} in / {args.output_len} out, device step {args.step_ms} ms"
    )
    head = f"{'server':<42} {'tok/s':>8} {'ideal':>7} {'tok/chunk':>9} {'engine thr':>10} {'loop thr':>9} {'engine proc':>11} {'process':>8}"
    print(head + "   (CPU us per output token)")
    print("-" * len(head))
    print(f"{'engine alone (no server)':<42} {'':>8} {'':>7} {'':>9} {alone['engine_us_per_token']:>10.1f}")
    for r in rows:
        name = f"{r['mode']} {r['stack']} ({'before' if args.server_code else 'this checkout'})"
        print(
            f"{name:<42} {r['output_tok_s']:>8.0f} {r['ideal_tok_s']:>7.0f} {r['tokens_per_chunk']!s:>9} "
            f"{r['engine_thread_us_per_token']:>10.1f} {r['loop_thread_us_per_token']:>9.1f} "
            f"{r['engine_process_us_per_token']:>11.1f} {r['server_process_us_per_token']:>8.1f}"
        )
        if "loop_profile" in r:
            print(f"    event loop: {r['loop_profile']}")
    print(
        json.dumps({"clients": args.clients, "step_ms": args.step_ms, "engine_alone": alone, "servers": rows})
    )


# -- the real model ---------------------------------------------------------------------------------


def model(args: argparse.Namespace) -> None:
    """bench throughput and the server at N clients on the default model, in one run."""
    import httpx

    from overnight.bench.throughput import run_ours
    from overnight.bench.workloads import custom
    from overnight.options import EngineOptions
    from overnight.parallel.workers import free_port

    n, lin, lout = args.clients, args.input_len, args.output_len
    # max_num_seqs n: the engine alone runs as many at once as the server has clients
    offline, _ = run_ours(
        EngineOptions(max_model_len=512, max_num_seqs=n), custom(4 * n, (lin, lin), (lout, lout))
    )
    print(f"offline: {offline.output_tok_s} out tok/s", file=sys.stderr)
    port = free_port()
    env = dict(os.environ, PYTHONPATH=args.server_code or ROOT)  # the server: this checkout's, or a before
    serve_cmd = [
        sys.executable,
        "-m",
        "overnight",
        "serve",
        "--port",
        str(port),
        "--max-model-len",
        "512",
        "--no-access-log",
        "--log-level",
        "warning",
    ]
    os.makedirs(args.out, exist_ok=True)
    log = open(os.path.join(args.out, "server.log"), "w")  # noqa: SIM115 - open while the server runs
    server = subprocess.Popen(serve_cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start (log: {args.out}/server.log)")
            time.sleep(0.5)
        sweep = [
            sys.executable,
            "-m",
            "overnight",
            "bench",
            "sweep",
            "--url",
            url,
            "--levels",
            str(n),
            "--input-len",
            str(lin),
            "--output-len",
            str(lout),
            "--window-s",
            str(args.window_s),
            "--out",
            args.out,
        ]
        subprocess.run(sweep, env=dict(os.environ, PYTHONPATH=ROOT), check=True, stdout=subprocess.DEVNULL)
    finally:
        server.terminate()
        server.wait(60)
    with open(os.path.join(args.out, "sweep.json")) as f:
        level = json.load(f)["levels"][0]
    ratio = level["output_tok_s"] / offline.output_tok_s
    who = f"server ({args.server_code or 'this checkout'})"
    print(f"\ndefault model, {n} clients, {lin} in / {lout} out (CPU)")
    print(f"{'offline bench throughput':<40} {offline.output_tok_s:>8.1f} out tok/s")
    print(
        f"{who:<40} {level['output_tok_s']:>8.1f} out tok/s  ({ratio:.0%} of offline; steady: {level['steady']['steady']})"
    )
    print(
        json.dumps(
            {
                "server_code": args.server_code,
                "offline_tok_s": offline.output_tok_s,
                "server_tok_s": level["output_tok_s"],
                "ratio": round(ratio, 3),
                "steady": level["steady"],
            }
        )
    )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_serve":
        serve(sys.argv[2], float(sys.argv[3]), "--profile" in sys.argv, sys.argv[4], int(sys.argv[5]))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["host", "model"])
    p.add_argument("--modes", nargs="+", default=["inproc", "process"], choices=["inproc", "process"])
    p.add_argument("--server-code", default=None, help="run the server from this checkout (a before)")
    p.add_argument("--clients", type=int, default=256, help="(model: use ~16 on a CPU)")
    p.add_argument("--step-ms", type=float, default=40.0)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--warmup-s", type=float, default=4.0)
    p.add_argument("--window-s", type=float, default=8.0)
    p.add_argument("--client-processes", type=int, default=2)
    p.add_argument(
        "--timing", default=None, help="token timing of the clients (default: usage; text for --server-code)"
    )
    p.add_argument("--profile", action="store_true", help="profile the event loop, grouped by what it does")
    p.add_argument(
        "--uvicorn",
        default="auto",
        choices=["auto", "asyncio-h11"],
        help="the server's event loop and HTTP parser: uvicorn's auto (uvloop and httptools where "
        "installed) or forced asyncio and h11",
    )
    p.add_argument("--stream-interval", type=int, default=1, help="the server's --stream-interval (tokens)")
    p.add_argument("--out", default="/tmp/server-cost")
    args = p.parse_args()
    host(args) if args.what == "host" else model(args)


if __name__ == "__main__":
    main()
