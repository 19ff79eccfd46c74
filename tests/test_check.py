"""`overnight check` on three engineered runs of the default model behind the real server (a tiny KV
pool, max_num_seqs=2 with a large pool, a light load), the rules on synthetic windows, and the
periodic line a batch job logs."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import threading
import time
from contextlib import contextmanager

import pytest

from overnight import LLM
from overnight.bench.load import LoadSpec, Workload, run_load
from overnight.bench.metrics_reader import WindowMetrics, parse_metrics, scrape_sync
from overnight.cli import main
from overnight.engine.scheduler import SchedulerStats
from overnight.sampling_params import SamplingParams
from overnight.server.background import BackgroundServer
from overnight.server.cli import ServerOptions, make_app
from overnight.tools.check import CheckLog, diagnose, start_check_log
from tests.engine_helpers import make_engine, run_all

# SmolLM2-135M keeps 46080 bytes of fp32 KV per token (30 layers x 2 x 3 heads x 64 x 4 B).
KV_PER_TOKEN = 46080
MAX_MODEL_LEN = 256


@contextmanager
def serving(**engine_kwargs):
    engine_kwargs.setdefault("max_model_len", MAX_MODEL_LEN)
    llm = LLM(mode="server", **engine_kwargs)
    with BackgroundServer(make_app(llm.engine, ServerOptions(access_log=False, log_level="warning"))) as s:
        yield s


@contextmanager
def load(url: str, concurrency: int, input_len: int, output_len: int):
    """`concurrency` clients sending back to back (in a thread) until the block ends."""
    done = threading.Event()

    async def controller(control) -> None:
        while not done.is_set():
            await asyncio.sleep(0.05)
        control.set_stop(0.0)

    spec = LoadSpec(
        url,
        "SmolLM2-135M-Instruct",
        Workload(input_len, output_len, vocab_high=40000),
        concurrency=concurrency,
    )
    result: dict = {}
    thread = threading.Thread(
        target=lambda: result.setdefault("r", asyncio.run(run_load(spec, 1, controller)))
    )
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while scrape_sync(url).running < min(concurrency, 2):  # judge the load, not its start
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.05)
        time.sleep(0.5)
        yield result
    finally:
        done.set()
        thread.join(60)
    records, _ = result["r"]
    assert records and not [r.error for r in records if r.error], "the load itself failed"


def check(url: str, capsys, window_s: float = 3.0) -> dict:
    capsys.readouterr()
    assert main(["check", "--url", url, "--window-s", str(window_s), "--interval-s", "0.1", "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def limits(findings: list[dict]) -> list[str]:
    return [f["limit"] for f in findings]


@pytest.mark.slow  # serves the real model
def test_tiny_kv_pool_is_the_limit(capsys):
    # 24 blocks of 16 = 384 tokens; each request needs 15 blocks (120 + 120 tokens): the pool holds one
    # and a half. Planned admission starts the second only when the first's end leaves room for it, so
    # usage stays low (~50%) while the rest wait: the deferral counter says the pool is the limit.
    with serving(max_num_seqs=16, kv_cache_memory_bytes=24 * 16 * KV_PER_TOKEN) as s:
        with load(s.url, concurrency=6, input_len=120, output_len=120):
            out = check(s.url, capsys, window_s=4.0)
    w = out["window"]
    assert w["max_num_seqs"] == 16 and w["num_kv_blocks"] == 24
    assert limits(out["findings"])[0] == "kv_pool", out
    assert "fp8" in out["findings"][0]["advice"]


@pytest.mark.slow  # serves the real model
def test_max_num_seqs_with_a_large_pool_is_the_limit(capsys):
    # The pool holds 2 x max_num_seqs x max_model_len tokens at most: 8192 here, 1% per request.
    with serving(max_num_seqs=2, max_model_len=2048) as s:
        with load(s.url, concurrency=8, input_len=24, output_len=24):
            out = check(s.url, capsys)
    w = out["window"]
    assert w["max_num_seqs"] == 2 and w["mean_running"] >= 1.5 and w["mean_waiting"] >= 3, w
    assert w["mean_kv_usage"] < 0.05
    assert limits(out["findings"]) == ["max_num_seqs"], out
    assert "--max-num-seqs" in out["findings"][0]["advice"]


@pytest.mark.slow  # serves the real model
def test_light_load(capsys):
    with serving(max_num_seqs=16) as s:
        with load(s.url, concurrency=1, input_len=24, output_len=24):
            out = check(s.url, capsys)
        # and the text form, on the same server now idle
        capsys.readouterr()
        assert main(["check", "--url", s.url, "--window-s", "0.5"]) == 0
        text = capsys.readouterr().out
    assert limits(out["findings"]) == ["light_load"], out
    assert out["window"]["mean_waiting"] < 0.5 and out["window"]["mean_running"] > 0.3
    assert "holds the batch: idle" in text


# -- the rules on synthetic windows ----------------------------------------------------------------


def window(**kw) -> WindowMetrics:
    base = dict(
        duration_s=10.0,
        num_samples=40,
        mean_running=8.0,
        mean_waiting=0.0,
        mean_kv_usage=0.3,
        max_kv_usage=0.4,
        waiting_fraction=0.0,
        preemptions=0,
        generation_tokens=1000,
        max_num_seqs=256,
    )
    base.update(kw)
    return WindowMetrics(**base)


def test_rules_on_synthetic_windows():
    assert limits_of(window(mean_running=0.0)) == ["idle"]
    assert limits_of(window(mean_kv_usage=0.97, mean_waiting=12, preemptions=5)) == ["kv_pool", "preemptions"]
    assert limits_of(window(mean_running=256, mean_waiting=40, mean_kv_usage=0.2)) == ["max_num_seqs"]
    assert limits_of(window(mean_running=200, mean_kv_usage=0.6, preemptions=3)) == ["preemptions"]
    assert limits_of(window(mean_running=40, mean_waiting=0.1)) == ["light_load"]
    assert limits_of(window(mean_running=40, mean_waiting=30, mean_kv_usage=0.3)) == ["token_budget"]
    # planned admission holding requests back in a quarter of the steps or more: the pool, not the budget
    held = dict(mean_running=40, mean_waiting=30, mean_kv_usage=0.5, steps=100)
    assert limits_of(window(**held, kv_deferrals=60)) == ["kv_pool"]
    assert "in 60 of 100 steps" in diagnose(window(**held, kv_deferrals=60))[0].summary
    assert limits_of(window(**held, kv_deferrals=10)) == ["token_budget"]
    # a server that does not expose max_num_seqs: waiting with free cache still points at it
    assert limits_of(window(mean_running=64, mean_waiting=30, max_num_seqs=None)) == ["max_num_seqs"]


def test_max_num_seqs_suggestion_fits_the_pool_and_the_queue():
    big_queue = diagnose(window(mean_running=256, mean_waiting=5000, mean_kv_usage=0.25))[0]
    assert "--max-num-seqs 921" in big_queue.advice  # 0.9 x 256 / 0.25: what the pool holds
    small_queue = diagnose(window(mean_running=2, mean_waiting=6, mean_kv_usage=0.01, max_num_seqs=2))[0]
    assert "--max-num-seqs 8" in small_queue.advice  # the running two plus the six waiting


def limits_of(m: WindowMetrics) -> list[str]:
    return [f.limit for f in diagnose(m)]


def test_metrics_reader_takes_either_prefix_and_the_limits_info():
    page = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 3.0
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{model_name="m"} 7.0
# TYPE vllm:engine_limits_info gauge
vllm:engine_limits_info{max_num_seqs="64",model_name="m",num_kv_blocks="1000"} 1.0
# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_bucket{le="1.0",model_name="m"} 2.0
vllm:iteration_tokens_total_count{model_name="m"} 2.0
# TYPE other_metric gauge
other_metric 5.0
"""
    snap = parse_metrics(page)
    assert (
        snap.running == 3 and snap.preemptions_total == 7 and snap.values["iteration_tokens_total_count"] == 2
    )
    assert snap.limits == {"max_num_seqs": 64, "num_kv_blocks": 1000}
    assert "other_metric" not in snap.values and "iteration_tokens_total_bucket" not in snap.values


# -- the periodic line of a batch job --------------------------------------------------------------


def test_check_log_names_max_num_seqs_for_a_queue_behind_two_seats(caplog):
    engine, _ = make_engine(max_num_seqs=2)
    observer = CheckLog(engine.config.scheduler.max_num_seqs, interval_s=0.0)
    engine.observers.append(observer)
    for i in range(12):
        engine.add_request(str(i), [5 + i, 6, 7, 8], SamplingParams(max_tokens=8, ignore_eos=True))
    with caplog.at_level(logging.INFO, logger="overnight"):
        run_all(engine)
    assert observer.lines and all(line.startswith("check: running") for line in observer.lines)
    assert "max_num_seqs" in observer.lines[0] and "--max-num-seqs" in observer.lines[0]
    assert any("check: running" in r.message for r in caplog.records)


@pytest.mark.parametrize("interval", [3600.0])
def test_check_log_stays_quiet_within_its_interval(interval):
    engine, _ = make_engine()
    observer = CheckLog(None, interval_s=interval)
    engine.observers.append(observer)
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    run_all(engine)
    assert observer.lines == []


def test_start_check_log_samples_a_live_engine_and_ends_with_it():
    engine, _ = make_engine(max_num_seqs=2)
    check = start_check_log(engine, interval_s=0.2, sample_s=0.01)
    thread = next(t for t in threading.enumerate() if t.name == "overnight-check")
    for i in range(12):
        engine.add_request(str(i), [5 + i, 6, 7, 8], SamplingParams(max_tokens=40, ignore_eos=True))
    deadline = time.monotonic() + 1.0
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        engine.step()
        time.sleep(0.005)
    assert check.lines and "max_num_seqs" in check.lines[0], check.lines
    assert "generation" not in check.lines[0]  # samples do not count tokens
    del engine, _
    gc.collect()
    thread.join(2.0)
    assert not thread.is_alive()


def test_a_batch_tail_gets_no_light_load_advice():
    idle_seats = SchedulerStats(
        num_running=2,
        num_waiting=0,
        kv_cache_usage=0.1,
        num_preemptions_total=0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
    )
    loud = CheckLog(max_num_seqs=256, interval_s=0.0, logger=logging.getLogger("t"))
    loud.add(idle_seats)
    assert len(loud.lines) == 1 and "light_load" in loud.lines[0] and "send more requests" in loud.lines[0]
    quiet = CheckLog(256, 0.0, logging.getLogger("t"), quiet=("idle", "light_load"))
    quiet.add(idle_seats)
    assert quiet.lines == []
    busy = SchedulerStats(256, 40, 0.5, 0, 0, 0)
    quiet.add(busy)  # other verdicts still speak
    assert len(quiet.lines) == 1 and "max_num_seqs" in quiet.lines[0]
