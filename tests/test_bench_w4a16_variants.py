"""bench/w4a16_variants_gpu.py runs end to end on the CPU (Triton interpreter, fp32, tiny shapes, a fake
timer): every variant it names builds, passes its correctness check and lands in the tables, so the
one GPU call it is written for does not fail on a typo."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench" / "w4a16_variants_gpu.py"


@pytest.fixture()
def bench(monkeypatch):
    spec = importlib.util.spec_from_file_location("w4a16_variants_gpu", BENCH)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "w4a16_variants_gpu", module)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "DEVICE", "cpu")
    monkeypatch.setattr(module, "DTYPE", torch.float32)
    monkeypatch.setattr(module, "SHAPES", {"o": (40, 256), "down": (24, 384)})
    monkeypatch.setattr(module, "MS", (3, 70))
    monkeypatch.setattr(module, "SMALL_M", 16)
    monkeypatch.setattr(module, "ROTATE_BYTES", 1)
    calls_seen = []

    def fake_time(calls, replays=10):
        for call in calls:
            call()
        calls_seen.append(len(calls))
        return 10.0 + len(calls_seen) % 7

    monkeypatch.setattr(module, "graph_time", fake_time)
    return module


def test_variants_bench_runs_on_cpu(bench, capsys):
    bench.correctness(False)
    assert bench.RESULTS["correctness"] == "ok", bench.RESULTS["correctness"]
    bench.times(False)
    table = bench.RESULTS["times"]
    out = capsys.readouterr().out
    assert "failed" not in out, out
    variants = {r["variant"] for r in table}
    small = {n for n, make in bench.W4A16_VARIANTS.items() if make(3) is not None} | {"default"}
    large = {n for n, make in bench.W4A16_VARIANTS.items() if make(70) is not None} | {"default"}
    assert small | large | {"bf16", "w8a8:int_mm", "w8a8:triton", "w8a8:w8a16"} == variants
    assert len(table) == 2 * (len(small) + 1 + 3) + 2 * (len(large) + 1 + 2)
    assert "best per (shape, M)" in out and bench.RESULTS["best"]
