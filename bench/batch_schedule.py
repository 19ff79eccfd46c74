"""run-batch's schedule, measured on one engine built once (the same BatchRunner the command uses).

1. prefix: lines sharing 8 long prompt prefixes, interleaved at random, through a KV pool too small
   to hold every prefix beside the running batch. Output tok/s and prefix-cache hit rate with
   look-ahead (--schedule lookahead), in file order (--schedule fifo), and first come first served
   (every line submitted at once, in file order: how `vllm run-batch` submits) on our engine.
2. order: --max-in-flight 8, --schedule fifo and a long answer at the head of every stretch: the
   wall time of --order input against --order completion (finished lines that wait for an earlier one
   spill to disk instead of holding new lines back).

    PYTHONPATH=. python bench/batch_schedule.py          # CPU: the embedded SmolLM2-135M, fp32
    PYTHONPATH=. python bench/batch_schedule.py --gpu    # H200: Qwen3-8B dummy weights, bf16

Every run is checked first (each custom_id once, in input order, no failure, every answer its full
max_tokens); the CPU preset also compares the greedy texts of look-ahead and fifo. A run still going
after the preset's run_limit_s is stopped and shown as "cut short" (its rate counts finished lines
only). A table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, replace

sys.path.insert(0, ".")

from overnight.batch.ordering import OutputOrder  # noqa: E402
from overnight.batch.output import Sink  # noqa: E402
from overnight.batch.reader import read_lines  # noqa: E402
from overnight.batch.runner import BatchRunner  # noqa: E402
from overnight.batch.spill import Spill  # noqa: E402
from overnight.batch.summary import Summary  # noqa: E402
from overnight.batch.timeline import Timeline  # noqa: E402
from overnight.bench.gpu_info import sm_clock_now  # noqa: E402
from overnight.build import build_engine  # noqa: E402
from overnight.entrypoints.submission import FifoOrder, make_order  # noqa: E402
from overnight.loader.resolve import resolve_source  # noqa: E402
from overnight.options import EngineOptions  # noqa: E402


@dataclass(frozen=True)
class Preset:
    model: str | None
    load_format: str
    dtype: str
    max_model_len: int
    max_num_seqs: int | None  # None: the batch default for the device
    # prefix experiment
    lines: int
    prefixes: int
    prefix_len: int
    suffix_len: tuple[int, int]
    max_tokens: int
    pool_tokens: int  # the KV pool, in tokens
    # order experiment
    order_lines: int
    stretch: int  # a long answer at the head of every `stretch` lines
    long_tokens: int
    short_tokens: int
    warm_lines: int
    fcfs_budget_s: float  # skip the first-come-first-served run once this much time has passed
    run_limit_s: float  # a run still going after this long is stopped and reported as cut short


CPU = Preset(  # sized for a small CPU: prefill-heavy, since CPU decode gains little from a fuller batch
    model=None,
    load_format="auto",
    dtype="float32",
    max_model_len=512,
    max_num_seqs=16,
    lines=64,
    prefixes=8,
    prefix_len=256,
    suffix_len=(8, 16),
    max_tokens=4,
    pool_tokens=1280,  # 8 prefixes take 2,048
    order_lines=96,
    stretch=32,
    long_tokens=64,
    short_tokens=4,
    warm_lines=8,
    fcfs_budget_s=3600.0,
    run_limit_s=1200.0,
)
GPU = Preset(
    model="qwen3-8b",
    load_format="dummy",
    dtype="auto",
    max_model_len=2048,
    max_num_seqs=None,
    lines=4000,
    prefixes=8,
    prefix_len=1500,
    suffix_len=(32, 96),
    max_tokens=64,
    pool_tokens=16384,  # 8 prefixes take 12,000
    order_lines=1024,
    stretch=256,
    long_tokens=1024,
    short_tokens=16,
    warm_lines=256,
    fcfs_budget_s=240.0,
    run_limit_s=150.0,
)


def line(cid: str, prompt: list[int], max_tokens: int) -> bytes:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return (
        json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": body}) + "\n"
    ).encode()


def write_prefix_file(path: str, p: Preset, vocab: int, seed: int = 0) -> dict[str, int]:
    """The file's custom_ids in order, each with its max_tokens."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000, vocab) for _ in range(p.prefix_len)] for _ in range(p.prefixes)]
    lengths = {}
    with open(path, "wb") as f:
        for i in range(p.lines):
            suffix = [rng.randrange(1000, vocab) for _ in range(rng.randint(*p.suffix_len))]
            f.write(line(f"p{i}", prefixes[rng.randrange(p.prefixes)] + suffix, p.max_tokens))
            lengths[f"p{i}"] = p.max_tokens
    return lengths


def write_order_file(path: str, p: Preset, vocab: int, seed: int = 1) -> dict[str, int]:
    rng = random.Random(seed)
    lengths = {}
    with open(path, "wb") as f:
        for i in range(p.order_lines):
            n = p.long_tokens if i % p.stretch == 0 else p.short_tokens
            f.write(line(f"o{i}", [rng.randrange(1000, vocab) for _ in range(rng.randint(16, 48))], n))
            lengths[f"o{i}"] = n
    return lengths


def kv_bytes_per_token(model: str | None, load_format: str, dtype_bytes: int) -> int:
    arch = resolve_source(model, load_format).arch
    return 2 * arch.num_hidden_layers * arch.num_key_value_heads * arch.head_dim * dtype_bytes


class CutShort(Exception):
    pass


def with_deadline(step, limit_s: float):
    """engine.step that raises CutShort once limit_s have passed (the runner then aborts what runs)."""
    deadline = time.perf_counter() + limit_s

    def step_until_deadline():
        if time.perf_counter() > deadline:
            raise CutShort
        return step()

    return step_until_deadline


def run(
    engine,
    path: str,
    lengths: dict[str, int],
    *,
    schedule: str,
    order: str,
    max_in_flight: int | None,
    limit_s: float = 1e9,
):
    """One pass of run-batch's runner over `path`; checks the output and returns (summary, texts).
    A run cut short by limit_s returns its summary with status "cut short" and is not checked."""
    engine.kv.pool.reset_prefix_cache()  # every run starts cold
    sched = engine.config.scheduler
    out_path = path + f".{schedule}.{order}.out"
    spill = Spill(out_path + ".spill")
    window = EngineOptions().lookahead_window  # run-batch's default
    timeline = Timeline(schedule, window, sched.max_num_seqs)
    summary = Summary(input=path, output=out_path, model="bench", timeline=timeline)
    cpu0 = time.process_time()
    with open(out_path, "wb") as out:
        runner = BatchRunner(
            engine,
            Sink(out),
            summary,
            model_name="bench",
            names={"bench"},
            order=OutputOrder(order, spill),
            max_in_flight=max_in_flight or 2 * sched.max_num_seqs,
            schedule=FifoOrder()
            if schedule == "fcfs"
            else make_order(schedule, window, engine.config.cache.block_size),
        )
        engine.step = with_deadline(type(engine).step.__get__(engine), limit_s)
        try:
            with open(path, "rb") as f:
                runner.run(read_lines(f))
        except CutShort:
            summary.finish("cut short")
            spill.close(remove=True)
            os.remove(out_path)
            return {**summary.as_dict(), "cpu_s": round(time.process_time() - cpu0, 1)}, {}
        finally:
            del engine.step  # the class's step again
        summary.finish()
    cpu_s = time.process_time() - cpu0
    with open(out_path, "rb") as f:
        records = [json.loads(x) for x in f]
    os.remove(out_path)
    ids = [r["custom_id"] for r in records]
    want = list(lengths)
    if order == "input" and ids != want:
        raise AssertionError(f"{schedule}/{order}: output is not in input order")
    if sorted(ids) != sorted(want):
        raise AssertionError(f"{schedule}/{order}: custom_ids missing or repeated")
    failed = [r for r in records if r["error"] is not None]
    if failed:
        raise AssertionError(f"{schedule}/{order}: {len(failed)} failed lines, first: {failed[0]['error']}")
    by_id = {r["custom_id"]: r for r in records}
    for cid, n in lengths.items():
        got = by_id[cid]["response"]["body"]["usage"]["completion_tokens"]
        if got != n:
            raise AssertionError(f"{schedule}/{order}: {cid} generated {got} tokens, not {n}")
    texts = {cid: r["response"]["body"]["choices"][0]["text"] for cid, r in by_id.items()}
    return {**summary.as_dict(), "cpu_s": round(cpu_s, 1)}, texts


def ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def row(name: str, s: dict) -> dict:
    t = s["schedule"]
    return {
        "run": name,
        "status": s["status"],
        "elapsed_s": s["elapsed_s"],
        "cpu_s": s["cpu_s"],  # this process's CPU time: on a shared machine, steadier than wall time
        "steps": t["engine_steps"],
        "out_tok_s": s["output_tokens_per_s"],
        "prefix_hit": t["prefix_cache_hit_rate"],
        "prompt_computed": t["prefix_cache_queries"] - t["prefix_cache_hits"],
        "preemptions": t["preemptions"],
        "tail_s": t["tail_s"],
        "read_s": t["time_s"]["read"],
        "tokenize_s": t["time_s"]["tokenize"],
        "engine_s": t["time_s"]["engine"],
        "write_s": t["time_s"]["write"],
        "spilled": t["spilled_lines"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu", action="store_true", help="the H200 preset (Qwen3-8B dummy weights)")
    ap.add_argument("--lines", type=int, default=None, help="lines of the prefix file (preset's default)")
    ap.add_argument("--order-lines", type=int, default=None, help="lines of the order file")
    ap.add_argument("--skip-order", action="store_true", help="only the prefix experiment")
    ap.add_argument("--run-limit-s", type=float, default=None, help="cut a run short after this long")
    ap.add_argument("--fcfs-budget-s", type=float, default=None, help="skip fcfs once this much has passed")
    args = ap.parse_args()
    p = GPU if args.gpu else CPU
    if args.run_limit_s:
        p = replace(p, run_limit_s=args.run_limit_s)
    if args.fcfs_budget_s is not None:
        p = replace(p, fcfs_budget_s=args.fcfs_budget_s)
    if args.lines:
        p = replace(p, lines=args.lines)
    if args.order_lines:
        p = replace(p, order_lines=args.order_lines)
    t_start = time.perf_counter()
    dtype_bytes = 4 if p.dtype == "float32" else 2
    pool_bytes = p.pool_tokens * kv_bytes_per_token(p.model, p.load_format, dtype_bytes)
    engine = build_engine(
        EngineOptions(
            model=p.model,
            load_format=p.load_format,
            dtype=p.dtype,
            max_model_len=p.max_model_len,
            max_num_seqs=p.max_num_seqs,
            kv_cache_memory_bytes=pool_bytes,
            mode="batch",
        )
    )
    sched = engine.config.scheduler
    pool = engine.kv.num_blocks * engine.config.cache.block_size
    vocab = engine.vocab_size
    print(
        f"device {engine.config.runner.device}, SM clock {sm_clock_now()}; model {p.model or 'SmolLM2-135M'} "
        f"({engine.config.model.dtype}); KV pool {pool} tokens; max_num_seqs {sched.max_num_seqs}, "
        f"{sched.max_num_batched_tokens} tokens a step; built in {time.perf_counter() - t_start:.0f} s",
        flush=True,
    )
    tmp = tempfile.mkdtemp(prefix="batch-schedule-")  # the input files stay there
    warm = os.path.join(tmp, "warm.jsonl")
    warm_lengths = {f"w{i}": 4 for i in range(p.warm_lines)}
    with open(warm, "wb") as f:  # kernels and allocator warm before anything is timed
        rng = random.Random(2)
        for cid in warm_lengths:
            f.write(line(cid, [rng.randrange(1000, vocab) for _ in range(32)], 4))
    run(engine, warm, warm_lengths, schedule="fifo", order="completion", max_in_flight=None)

    rows: list[dict] = []
    results: dict[str, object] = {"preset": "gpu" if args.gpu else "cpu", "pool_tokens": pool}
    prefix_path = os.path.join(tmp, "prefix.jsonl")
    lengths = write_prefix_file(prefix_path, p, vocab)
    print(
        f"prefix file: {p.lines} lines, {p.prefixes} prefixes of {p.prefix_len} tokens interleaved, "
        f"+{p.suffix_len[0]}-{p.suffix_len[1]} tokens each, {p.max_tokens} out",
        flush=True,
    )
    texts = {}
    for name, schedule, in_flight in (
        ("lookahead", "lookahead", None),
        ("fifo", "fifo", None),
        ("fcfs (all lines at once)", "fcfs", p.lines),
    ):
        if schedule == "fcfs" and time.perf_counter() - t_start > p.fcfs_budget_s:
            print("skipping the fcfs run: out of time", flush=True)
            continue
        s, texts[schedule] = run(
            engine,
            prefix_path,
            lengths,
            schedule=schedule,
            order="input",
            max_in_flight=in_flight,
            limit_s=p.run_limit_s,
        )
        rows.append(row(f"prefix: {name}", s))
        print(json.dumps(rows[-1]), flush=True)
    same = None  # dummy weights come without a tokenizer: no texts to compare
    if engine.tokenizer is not None and texts["lookahead"] and texts["fifo"]:
        same = sum(texts["lookahead"][c] == texts["fifo"][c] for c in texts["fifo"]) / len(texts["fifo"])
    by = {r["run"]: r for r in rows}
    ahead, fifo = by["prefix: lookahead"], by["prefix: fifo"]
    results["prefix"] = {
        "lookahead_over_fifo": ratio(ahead["out_tok_s"], fifo["out_tok_s"]),
        "lookahead_over_fifo_cpu_time": ratio(fifo["cpu_s"], ahead["cpu_s"]),
        "greedy_texts_identical": same,
    }
    if "prefix: fcfs (all lines at once)" in by:
        fcfs = by["prefix: fcfs (all lines at once)"]["out_tok_s"]
        results["prefix"]["lookahead_over_fcfs"] = ratio(ahead["out_tok_s"], fcfs)

    if not args.skip_order:
        order_path = os.path.join(tmp, "order.jsonl")
        lengths = write_order_file(order_path, p, vocab)
        print(
            f"order file: {p.order_lines} lines, a {p.long_tokens}-token answer at the head of every "
            f"{p.stretch}, the rest {p.short_tokens}; --max-in-flight 8",
            flush=True,
        )
        for order in ("completion", "input"):  # fifo: long lines start at the head, as in the file
            s, _ = run(
                engine,
                order_path,
                lengths,
                schedule="fifo",
                order=order,
                max_in_flight=8,
                limit_s=p.run_limit_s,
            )
            rows.append(row(f"order: {order}", s))
            print(json.dumps(rows[-1]), flush=True)
        by = {r["run"]: r for r in rows}
        inp, comp = by["order: input"], by["order: completion"]
        results["order"] = {
            "input_over_completion_wall": ratio(inp["elapsed_s"], comp["elapsed_s"]),
            "input_over_completion_cpu": ratio(inp["cpu_s"], comp["cpu_s"]),
            "input_over_completion_steps": ratio(inp["steps"], comp["steps"]),
        }

    print(f"\nSM clock at the end: {sm_clock_now()}")
    cols = ["run", "status", "elapsed_s", "cpu_s", "steps", "out_tok_s", "prefix_hit", "prompt_computed"]
    cols += ["preemptions", "tail_s", "read_s", "tokenize_s", "engine_s", "write_s", "spilled"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    print(f"look-ahead / fifo out tok/s: {results['prefix']['lookahead_over_fifo']} x")
    results["rows"] = rows
    results["total_s"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
