"""Concurrency sweep through the server: raise the load until the output stops growing (the knee).

    overnight bench sweep --url http://127.0.0.1:8000 --max-concurrency 256   # any OpenAI-compatible server
    overnight bench sweep --model qwen3-8b --load-format dummy --input-len 512 --output-len 256 \\
        --max-concurrency 1024 --out sweep-qwen3-8b          # starts its own server
    overnight bench sweep --request-rate 2 4 8 --burstiness 1  # fixed-rate runs instead of levels

Each level (1, 2, 4, ... up to --max-concurrency) is measured in its steady state (steady.py): the
clients start spread over half a request's expected life with first answers of random lengths, so
they never move in waves; the warm-up lasts until half of them came round once; the window covers
two request lifetimes (at least --window-s) and is judged: total/output tokens against the
workload's (3.0 for 512 in / 256 out) and the output rate of its four quarters. An unsteady window
is measured once more; a level still unsteady is reported and left out of the knee rules.

Per level: output/total tok/s, requests/s, TTFT/TPOT/ITL percentiles, the steady-state verdict, and
from /metrics (when the server has them) the mean running, waiting, KV usage, preemptions and tokens
per step, with the GPU's SM clock, power and temperature (when the server runs on this machine), and
the load generator's own loop lag: when the server holds fewer requests than there are clients, that
lag says whether the rest waited in the server's front end or in a client that fell behind. Raising
stops when output tok/s falls, or grows less than --min-gain over two steps. Writes sweep.json,
sweep.png and a table into --out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator

from overnight.bench.client import TIMINGS
from overnight.bench.knee import LevelPoint, refine_between, stop_reason, verdict
from overnight.bench.steady import WINDOW_LIFETIMES, ramp_seconds
from overnight.bench.target import Target, raise_open_files_limit, server_for, server_info
from overnight.options import add_engine_args


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
    g.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="own server: its --stream-interval (tokens a streamed chunk holds at least)",
    )
    g.add_argument("--api-key", default=None)
    g.add_argument("--input-len", type=int, default=128, help="random prompt tokens per request")
    g.add_argument("--output-len", type=int, default=128, help="tokens per answer (ignore_eos)")
    g.add_argument(
        "--output-len-range",
        type=float,
        default=0.0,
        help="answers of random prompts drawn from output-len x [1 - R, 1 + R] (mean output-len): clients "
        "that a stall bunched drift apart again, as under real answers (load.py); 0: all equal",
    )
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
        default=180.0,
        help="longest warm-up per level (it ends once the ramp is over and half the clients came round)",
    )
    g.add_argument("--window-s", type=float, default=10.0, help="shortest measured window per level")
    g.add_argument("--max-window-s", type=float, default=300.0, help="longest measured window per level")
    g.add_argument(
        "--window-lifetimes",
        type=float,
        default=WINDOW_LIFETIMES,
        help=f"request lifetimes a window covers (default {WINDOW_LIFETIMES:g})",
    )
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
        choices=["auto", *TIMINGS],
        default="auto",
        help="how chunks show tokens (bench/client.py); auto: usage in every chunk where the server "
        "streams it, else text, else logprobs",
    )
    g.add_argument("--client-processes", type=int, default=0, help="load processes (0: one per 64 streams)")
    g.add_argument("--metrics-interval-s", type=float, default=0.5)
    g.add_argument(
        "--server-timeout-s", type=float, default=900.0, help="how long an own server may take to start"
    )
    g.add_argument("--out", default="sweep-results", help="folder for sweep.json, sweep.png, server.log")
    add_engine_args(p)


def run(args: argparse.Namespace) -> int:
    if not 0.0 <= args.output_len_range < 1.0:  # before a server starts
        raise SystemExit(f"--output-len-range must be in [0, 1), got {args.output_len_range}")
    for noisy in ("httpx", "matplotlib"):  # a line per request / per font otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)
    os.makedirs(args.out, exist_ok=True)
    raise_open_files_limit()
    started = time.time()
    try:
        with exit_on_sigterm(), server_for(args) as url:
            result = sweep(args, url)
    except Terminated:
        print_cut_short(args.out, started)
        raise
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
                "all_steady": result["all_steady"],
                "reason": v.get("reason"),
                "out": args.out,
            }
        )
    )
    return 0


class Terminated(SystemExit):
    """The sweep was ended by a SIGTERM (exit status 143)."""


def print_cut_short(out: str, started: float) -> None:
    """The table of the levels a sweep ended by a signal had measured, from the sweep.json it wrote after
    each level (one from before this run, or none, prints nothing): a log's tail then shows them."""
    path = os.path.join(out, "sweep.json")
    try:
        if os.path.getmtime(path) < started:
            return
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return
    print_table(doc)
    print(f"cut short by SIGTERM after {len(doc['levels'])} level(s); no verdict (sweep.json has them)")


@contextlib.contextmanager
def exit_on_sigterm() -> Iterator[None]:
    """Inside, a SIGTERM (`timeout`, `kill`, a job scheduler) ends the sweep as Ctrl-C does: the clean-up
    runs, so the load processes stop and the server it started drains and exits before the sweep does
    (a GPU freed for whatever runs next). A second SIGTERM during that clean-up ends it at once. The
    previous handler comes back on the way out (the sweep may run inside another program)."""

    def on_term(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise Terminated(128 + signum)

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def save(result: dict, out: str) -> None:
    """sweep.json, rewritten after every level: a run cut short keeps what it measured."""
    tmp = os.path.join(out, "sweep.json.tmp")
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, os.path.join(out, "sweep.json"))


# -- the sweep ----------------------------------------------------------------------------------------


def levels_up_to(top: int) -> list[int]:
    levels = [1 << i for i in range(top.bit_length()) if 1 << i <= top]
    return levels if levels[-1] == top else levels + [top]


def sweep(args: argparse.Namespace, url: str) -> dict[str, object]:
    from overnight.bench import level
    from overnight.bench.steady import next_lifetime

    info = server_info(url, args.api_key)
    target = Target(url, str(info["model"]), args.api_key, bool(info.get("metrics")), bool(info.get("local")))
    workload = level.workload_from_args(args, info)
    timing = args.token_timing
    if timing == "auto":
        timing = level.probe_token_timing(target, workload)
    rates = args.request_rate
    if rates:
        xs: list[float] = sorted(rates)
    elif args.levels:
        xs = sorted(set(args.levels))
    else:
        seats = info.get("max_num_seqs")
        top = args.max_concurrency or (1 << max(2 * int(seats) - 1, 1).bit_length() if seats else 256)
        xs = levels_up_to(top)
    lifetime = level.probe_lifetime(target, workload, timing)
    print(
        f"sweep of {info['model']} at {url}: {'rates' if rates else 'levels'} {xs}, token timing by "
        f"{timing}, one request alone {lifetime:.2f} s, /metrics {'yes' if target.has_metrics else 'no'}, "
        f"GPU clocks {'read here' if target.local else 'not read (remote)'}",
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
                "output_len_range": args.output_len_range,
                "dataset": args.dataset,
                "seed": args.seed,
                "vocab_high": workload.vocab_high,
                "token_timing": timing,
            },
            "settings": {
                "warmup_s_max": args.warmup_s,
                "window_s_min": args.window_s,
                "window_s_max": args.max_window_s,
                "window_lifetimes": args.window_lifetimes,
                "stream_interval": None if args.url else args.stream_interval,  # own server only
                "steady": steady_settings(),
                "min_gain": args.min_gain,
                "arrival": args.arrival if rates else None,
                "burstiness": args.burstiness if rates else None,
            },
            "complete": final,
            "all_steady": all(r["steady"]["steady"] for r in rows),
            "levels": ordered,
            "verdict": verdict(points, args.min_gain, stopped).to_dict()
            if final and any(p.steady for p in points)
            else None,
        }

    def measure(x: float) -> None:
        nonlocal lifetime
        if rows and not rates:
            prev = rows[-1]
            lifetime = next_lifetime(float(prev["lifetime_s"] or lifetime), float(prev["requests_s"]), int(x))
        row = level.measure_level(args, target, workload, x, bool(rates), timing, lifetime)
        if ramp_too_short(row, args.warmup_s):
            # A sweep that starts at many clients ramps on the probe's lifetime of one request alone:
            # the clients then start nearly together and move as one band (vLLM's server at 256
            # clients on the H200). Measure the level again, ramped on the lifetime it showed.
            print(
                f"  {x:g}: ramp {row['ramp_s']} s was short for a {row['lifetime_s']} s request life; "
                "measuring again",
                file=sys.stderr,
            )
            lifetime = float(row["lifetime_s"])
            row = level.measure_level(args, target, workload, x, bool(rates), timing, lifetime)
        st = row["steady"]
        print(
            f"  {row['x']:g}: {row['output_tok_s']:.1f} out tok/s, total/output {st['total_per_output']} "
            f"(workload {st['expected_total_per_output']}), sub-windows {st['sub_output_tok_s']}: "
            f"{'steady' if st['steady'] else 'NOT steady: ' + st['reason']}; TTFT p50 {row['ttft_ms']['p50']} "
            f"ms, window {row['window_s']} s after {row['warmup_s']} s",
            file=sys.stderr,
        )
        rows.append(row)
        save(document(final=False), args.out)

    def steady_series() -> list[float]:
        return [float(r["output_tok_s"]) for r in rows if r["steady"]["steady"]]

    for x in xs:
        measure(x)
        reason = stop_reason(steady_series(), args.min_gain) if rows[-1]["steady"]["steady"] else None
        if reason is not None and stopped == "end":
            stopped = reason
        if reason is not None and not args.all_levels:
            break
    steady_rows = [r for r in rows if r["steady"]["steady"]]
    if args.refine and stopped != "end" and len(steady_rows) >= 2 and not rates:  # the knee lies between
        mid = refine_between(float(steady_rows[-2]["x"]), float(steady_rows[-1]["x"]))
        if mid is not None:
            measure(mid)
    return document(final=True)


def ramp_too_short(row: dict, warmup_s_max: float) -> bool:
    """A closed-loop level whose ramp was under half of what its measured lifetime asks for."""
    ramp, life = row.get("ramp_s"), row.get("lifetime_s")
    if not row.get("concurrency") or row.get("request_rate") or not ramp or not life:
        return False
    return float(ramp) < 0.5 * ramp_seconds(float(life), warmup_s_max / 2)


def steady_settings() -> dict[str, float]:
    from overnight.bench import steady

    names = ("RAMP_LIFETIMES", "WARMUP_COMPLETIONS", "SUB_WINDOWS", "RATIO_TOLERANCE", "SPREAD_TOLERANCE")
    return {n.lower(): getattr(steady, n) for n in names}


def to_point(row: dict) -> LevelPoint:
    def number(key: str) -> float | None:
        v = row["gpu"].get(key)
        return float(v) if isinstance(v, (int, float)) else None  # "n/a" without a GPU

    return LevelPoint(
        x=float(row["x"]),
        output_tok_s=float(row["output_tok_s"]),
        mean_kv_usage=row.get("mean_kv_usage"),
        mean_waiting=row.get("mean_waiting"),
        mean_running=row.get("mean_running"),
        max_num_seqs=row.get("max_num_seqs"),
        sm_clock_mhz=number("sm_clock_mhz_median"),
        preemptions=row.get("preemptions"),
        power_w=number("power_w_median"),
        steady=bool(row["steady"]["steady"]),
        clients=row.get("concurrency") if not row.get("request_rate") else None,
        client_lag_ms=(row.get("client_lag_ms") or {}).get("mean"),
    )


def print_table(result: dict) -> None:
    x_name = "conc" if result["x"] == "concurrency" else "req/s in"
    head = (
        f"{x_name:>8} {'out tok/s':>10} {'tot tok/s':>10} {'tot/out':>7} {'steady':>6} {'req/s':>7} "
        f"{'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'ITL p99':>8} {'run':>6} {'wait':>6} {'KV':>5} "
        f"{'tok/step':>8} {'SM MHz':>7} {'W':>5} {'lag ms':>6}"
    )
    print(
        f"\n{result['server']['model']}  in {result['workload']['input_len']} / out "
        f"{result['workload']['output_len']} tokens  {result['gpu']}  (latencies in ms; lag ms: the load generator's mean loop lag)"
    )
    print(head)
    print("-" * len(head))

    def ms(d: dict, q: str) -> str:
        return "-" if d[q] is None else f"{d[q]:.1f}"

    def num(v: object, fmt: str) -> str:
        return "-" if not isinstance(v, (int, float)) else format(v, fmt)

    for r in result["levels"]:
        g, st = r["gpu"], r["steady"]
        print(
            f"{r['x']:>8g} {r['output_tok_s']:>10.1f} {r['total_tok_s']:>10.1f} "
            f"{num(st['total_per_output'], '.2f'):>7} {'yes' if st['steady'] else 'NO':>6} "
            f"{r['requests_s']:>7.2f} {ms(r['ttft_ms'], 'p50'):>9} {ms(r['ttft_ms'], 'p99'):>9} "
            f"{ms(r['tpot_ms'], 'p50'):>9} {ms(r['itl_ms'], 'p99'):>8} {num(r.get('mean_running'), '.1f'):>6} "
            f"{num(r.get('mean_waiting'), '.1f'):>6} {num(r.get('mean_kv_usage'), '.0%'):>5} "
            f"{num(r.get('mean_tokens_per_step'), '.0f'):>8} {g['sm_clock_mhz_median']!s:>7} "
            f"{g['power_w_median']!s:>5} {num((r.get('client_lag_ms') or {}).get('mean'), '.1f'):>6}"
        )
    for r in result["levels"]:
        if not r["steady"]["steady"]:
            print(f"level {r['x']:g} not steady: {r['steady']['reason']}")
    v = result["verdict"]
    if v:
        print(
            f"best {v['best_x']:g} ({v['best_output_tok_s']:.1f} out tok/s); knee {v['knee_x']:g} "
            f"({v['knee_output_tok_s']:.1f}); stopped: {v['stopped']}; {v['reason']}: {v['detail']}"
        )
