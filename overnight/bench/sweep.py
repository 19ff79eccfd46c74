"""Concurrency sweep through the server: raise the load until the output stops growing (the knee).

    overnight bench sweep --url http://127.0.0.1:8000 --max-concurrency 256
    overnight bench sweep --model qwen3-8b --load-format dummy --input-len 512 --output-len 256 \\
        --max-concurrency 1024 --out sweep-qwen3-8b          # starts its own server
    overnight bench sweep --request-rate 2 4 8 --burstiness 1  # fixed-rate runs instead of levels

Each level (1, 2, 4, ... up to --max-concurrency) warms up until every client has finished one request
(at most --warmup-s), then measures --window-s: output/total tok/s, requests/s, TTFT/TPOT/ITL
percentiles, and from /metrics the mean running, waiting, KV usage and preemptions, with the GPU's SM
clock, power and temperature. Raising stops when output tok/s falls, or grows less than --min-gain
over two steps. Writes sweep.json, sweep.png and a table into --out.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from overnight.bench.knee import LevelPoint, refine_between, stop_reason, verdict
from overnight.options import add_engine_args, options_from_args, options_to_flags


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = __doc__
    g = p.add_argument_group("sweep")
    g.add_argument("--url", default=None, help="a running server; without it the sweep starts its own")
    g.add_argument(
        "--server",
        choices=["process", "thread"],
        default="process",
        help="own server as a subprocess (default: its CPU is apart from the client's) or a thread",
    )
    g.add_argument("--api-key", default=None)
    g.add_argument("--input-len", type=int, default=128, help="random prompt tokens per request")
    g.add_argument("--output-len", type=int, default=128, help="tokens per answer (ignore_eos)")
    g.add_argument(
        "--dataset",
        default=None,
        help='JSONL of {"prompt": text or token ids, "output_len"?: N} instead of random prompts',
    )
    g.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="random ids stay below this (default: the model's vocabulary, or 32000 with --url)",
    )
    g.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="the last level (default: 2 x the server's max_num_seqs); with --request-rate, a cap",
    )
    g.add_argument(
        "--levels", type=int, nargs="+", default=None, help="explicit levels instead of 1, 2, 4, ..."
    )
    g.add_argument(
        "--warmup-s",
        type=float,
        default=10.0,
        help="longest warm-up per level; it ends earlier once every client finished a request",
    )
    g.add_argument("--window-s", type=float, default=10.0, help="measured seconds per level")
    g.add_argument("--min-gain", type=float, default=0.05, help="growth over two steps that keeps raising")
    g.add_argument(
        "--refine",
        action="store_true",
        help="once growth stopped, also measure halfway between the last two levels",
    )
    g.add_argument("--all-levels", action="store_true", help="measure every level, past the knee too")
    g.add_argument(
        "--request-rate",
        type=float,
        nargs="+",
        default=None,
        help="fixed-rate runs (requests/s) instead of concurrency levels",
    )
    g.add_argument("--arrival", choices=["poisson", "constant"], default="poisson")
    g.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the gaps between arrivals: 1 Poisson, larger more regular",
    )
    g.add_argument(
        "--token-timing",
        choices=["auto", "text", "logprobs"],
        default="auto",
        help="how chunks show tokens; auto asks for logprobs when the server streams no text",
    )
    g.add_argument("--client-processes", type=int, default=0, help="load processes (0: one per 64 streams)")
    g.add_argument("--metrics-interval-s", type=float, default=0.5)
    g.add_argument(
        "--server-timeout-s", type=float, default=900.0, help="how long an own server may take to start"
    )
    g.add_argument("--out", default="sweep-results", help="folder for sweep.json, sweep.png, server.log")
    add_engine_args(p)


def run(args: argparse.Namespace) -> int:
    for noisy in ("httpx", "matplotlib"):  # a line per request / per font otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)
    os.makedirs(args.out, exist_ok=True)
    raise_open_files_limit()
    with server_for(args) as url:
        result = sweep(args, url)
    save(result, args.out)
    print_table(result)
    try:
        from overnight.bench.plot import plot_sweep

        plot_sweep(result, os.path.join(args.out, "sweep.png"))
    except ImportError as e:
        print(f"no plot: {e} (pip install matplotlib)", file=sys.stderr)
    v = result["verdict"] or {}
    print(
        json.dumps(
            {
                "x": result["x"],
                "knee": v.get("knee_x"),
                "best": v.get("best_x"),
                "peak_output_tok_s": v.get("best_output_tok_s"),
                "reason": v.get("reason"),
                "out": args.out,
            }
        )
    )
    return 0


def save(result: dict, out: str) -> None:
    """sweep.json, rewritten after every level: a run cut short keeps what it measured."""
    tmp = os.path.join(out, "sweep.json.tmp")
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, os.path.join(out, "sweep.json"))


def raise_open_files_limit() -> None:
    """A socket per stream on both ends: 1024 streams overrun the usual soft limit of 1024 open files.
    Raised to the hard limit here, and inherited by an own server and the load processes."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = hard if hard != resource.RLIM_INFINITY else 1 << 16
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ImportError, ValueError, OSError):
        pass  # not on this platform, or not allowed: streams beyond the limit will fail and be counted


# -- the server ---------------------------------------------------------------------------------------


@contextmanager
def server_for(args: argparse.Namespace) -> Iterator[str]:
    if args.url:
        yield args.url.rstrip("/")
    elif args.server == "thread":
        from overnight.build import build_engine
        from overnight.metrics import hide_created_series
        from overnight.server.background import BackgroundServer
        from overnight.server.cli import ServerOptions, make_app

        hide_created_series()
        engine = build_engine(options_from_args(args, mode="server"))
        app = make_app(engine, ServerOptions(access_log=False, log_level="warning"), model_arg=args.model)
        with BackgroundServer(app, log_level="warning") as server:
            yield server.url
    else:
        yield from _subprocess_server(args)


def _subprocess_server(args: argparse.Namespace) -> Iterator[str]:
    with socket.socket() as s:  # a free port; the tiny race with other programs is accepted
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "overnight",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--no-access-log",
        "--log-level",
        "warning",
        *engine_flags(args),
    ]
    log_path = os.path.join(args.out, "server.log")
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        print(f"starting the server: {' '.join(cmd[1:])} (log: {log_path})", file=sys.stderr)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_healthy(url, proc, args.server_timeout_s, log_path)
            yield url
        finally:
            proc.terminate()  # SIGTERM: a graceful drain
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine options given to the sweep, as `overnight serve` flags (only those off their default)."""
    return options_to_flags(options_from_args(args, mode="server"))


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float, log_path: str) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            with open(log_path) as f:
                tail = f.read()[-3000:]
            raise RuntimeError(f"the server exited ({proc.returncode}) during start-up:\n{tail}")
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server did not start within {timeout_s:.0f} s (log: {log_path})")
        time.sleep(0.5)


def server_info(url: str, api_key: str | None) -> dict[str, object]:
    """The served model and, where the server has a /metrics page that shows them, its limits. Raises
    ServerUnreachableError (one line on the command line) when the server is down or wants a key."""
    from overnight.bench.metrics_reader import parse_metrics
    from overnight.bench.reach import first_model, get
    from overnight.errors import ServerUnreachableError

    card = first_model(url, api_key)
    info: dict[str, object] = {"url": url, "model": card["id"], "max_model_len": card.get("max_model_len")}
    try:
        info.update(parse_metrics(get(url, "/metrics", api_key).text).limits)
    except (ServerUnreachableError, ValueError):  # a server without our /metrics page: no limits known
        pass
    return info


# -- the sweep ----------------------------------------------------------------------------------------


def levels_up_to(top: int) -> list[int]:
    levels = [1 << i for i in range(top.bit_length()) if 1 << i <= top]
    return levels if levels[-1] == top else levels + [top]


def sweep(args: argparse.Namespace, url: str) -> dict[str, object]:
    from overnight.bench.level import measure_level, probe_token_timing, workload_from_args

    info = server_info(url, args.api_key)
    workload = workload_from_args(args, info)
    timing = args.token_timing
    if timing == "auto":
        timing = probe_token_timing(url, str(info["model"]), workload, args.api_key)
    rates = args.request_rate
    if rates:
        xs: list[float] = sorted(rates)
    elif args.levels:
        xs = sorted(set(args.levels))
    else:
        seats = info.get("max_num_seqs")
        top = args.max_concurrency or (1 << max(2 * int(seats) - 1, 1).bit_length() if seats else 256)
        xs = levels_up_to(top)
    print(
        f"sweep of {info['model']} at {url}: {'rates' if rates else 'levels'} {xs}, token timing by {timing}",
        file=sys.stderr,
    )

    rows: list[dict[str, object]] = []
    stopped = "end"

    def document(final: bool) -> dict[str, object]:
        ordered = sorted(rows, key=lambda r: float(r["x"]))
        points = [to_point(r) for r in ordered]
        gpu = next((r["gpu"]["gpu"] for r in ordered if r["gpu"]["gpu"] != "n/a"), "")
        return {
            "x": "request_rate" if rates else "concurrency",
            "server": info,
            "gpu": gpu,
            "workload": {
                "input_len": args.input_len,
                "output_len": args.output_len,
                "dataset": args.dataset,
                "seed": args.seed,
                "token_timing": timing,
            },
            "settings": {
                "warmup_s": args.warmup_s,
                "window_s": args.window_s,
                "min_gain": args.min_gain,
                "arrival": args.arrival if rates else None,
                "burstiness": args.burstiness if rates else None,
            },
            "complete": final,
            "levels": ordered,
            "verdict": verdict(points, args.min_gain, stopped).to_dict() if final and rows else None,
        }

    def measure(x: float) -> None:
        row = measure_level(args, url, str(info["model"]), workload, x, rate_mode=bool(rates), timing=timing)
        print(
            f"  {row['x']:g}: {row['output_tok_s']:.1f} out tok/s, TTFT p50 {row['ttft_ms']['p50']} ms, "
            f"running {row['mean_running']}, waiting {row['mean_waiting']}, KV {row['mean_kv_usage']:.0%}",
            file=sys.stderr,
        )
        rows.append(row)
        save(document(final=False), args.out)

    for x in xs:
        measure(x)
        reason = stop_reason([float(r["output_tok_s"]) for r in rows], args.min_gain)
        if reason is not None and stopped == "end":
            stopped = reason
        if reason is not None and not args.all_levels:
            break
    if args.refine and stopped != "end" and len(rows) >= 2 and not rates:  # the knee lies between them
        mid = refine_between(float(rows[-2]["x"]), float(rows[-1]["x"]))
        if mid is not None:
            measure(mid)
    return document(final=True)


def to_point(row: dict) -> LevelPoint:
    def number(key: str) -> float | None:
        v = row["gpu"].get(key)
        return float(v) if isinstance(v, (int, float)) else None  # "n/a" without a GPU

    return LevelPoint(
        x=float(row["x"]),
        output_tok_s=float(row["output_tok_s"]),
        mean_kv_usage=row["mean_kv_usage"],
        mean_waiting=row["mean_waiting"],
        mean_running=row["mean_running"],
        max_num_seqs=row["max_num_seqs"],
        sm_clock_mhz=number("sm_clock_mhz_median"),
        preemptions=row["preemptions"],
        power_w=number("power_w_median"),
    )


def print_table(result: dict) -> None:
    x_name = "conc" if result["x"] == "concurrency" else "req/s in"
    head = (
        f"{x_name:>8} {'out tok/s':>10} {'tot tok/s':>10} {'req/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'TPOT p50':>9} {'ITL p99':>8} {'run':>6} {'wait':>6} {'KV':>5} {'preempt':>7} {'SM MHz':>7} "
        f"{'W':>5} {'temp':>5}"
    )
    print(
        f"\n{result['server']['model']}  in {result['workload']['input_len']} / out "
        f"{result['workload']['output_len']} tokens  {result['gpu']}  (latencies in ms)"
    )
    print(head)
    print("-" * len(head))

    def ms(d: dict, q: str) -> str:
        return "-" if d[q] is None else f"{d[q]:.1f}"

    for r in result["levels"]:
        g = r["gpu"]
        print(
            f"{r['x']:>8g} {r['output_tok_s']:>10.1f} {r['total_tok_s']:>10.1f} {r['requests_s']:>7.2f} "
            f"{ms(r['ttft_ms'], 'p50'):>9} {ms(r['ttft_ms'], 'p99'):>9} {ms(r['tpot_ms'], 'p50'):>9} "
            f"{ms(r['itl_ms'], 'p99'):>8} {r['mean_running']:>6.1f} {r['mean_waiting']:>6.1f} "
            f"{r['mean_kv_usage']:>5.0%} {r['preemptions']:>7} {g['sm_clock_mhz_median']!s:>7} "
            f"{g['power_w_median']!s:>5} {g['temp_c_max']!s:>5}"
        )
    v = result["verdict"]
    if v:
        print(
            f"best {v['best_x']:g} ({v['best_output_tok_s']:.1f} out tok/s); knee {v['knee_x']:g} "
            f"({v['knee_output_tok_s']:.1f}); stopped: {v['stopped']}; {v['reason']}: {v['detail']}"
        )
