"""bench/w4a16_variants_gpu.py runs end to end on the CPU (Triton interpreter, fp32, tiny shapes, a fake
timer): every variant it names builds, passes its correctness check and lands in the tables, so the
one GPU call it is written for does not fail on a typo."""

from __future__ import annotations

import pytest
import torch

from tests.bench_scripts import fake_graph_time, load_bench_script


@pytest.fixture()
def bench(monkeypatch):
    module = load_bench_script(monkeypatch, "w4a16_variants_gpu.py")
    monkeypatch.setattr(module, "DEVICE", "cpu")
    monkeypatch.setattr(module, "DTYPE", torch.float32)
    monkeypatch.setattr(module, "SHAPES", {"o": (40, 256), "down": (24, 384)})
    monkeypatch.setattr(module, "MS", (3, 70))
    monkeypatch.setattr(module, "SMALL_M", 16)
    monkeypatch.setattr(module, "ROTATE_BYTES", 1)
    monkeypatch.setattr(module, "graph_time", fake_graph_time(7))
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


@pytest.mark.slow  # ~10 s of the interpreter
def test_moe_section_runs_on_cpu(bench, monkeypatch, capsys):
    """Section 4 (--moe) on tiny experts: every MoE variant passes its check against the reference, is
    timed with and without zero points, and the summary prints a TIERS line per token count."""
    monkeypatch.setattr(bench, "MOE_SHAPE", (2, 32, 32, 2))  # 2 experts, top-2: rows per expert = tokens
    monkeypatch.setattr(bench, "MOE_TOKENS", (1, 40))  # between them, every variant runs
    monkeypatch.setattr(bench, "MOE_COPIES", 1)
    monkeypatch.setattr(bench, "MOE_CALLS", 1)
    monkeypatch.setattr(bench, "GROUP", 32)
    bench.moe_times()
    out = capsys.readouterr().out
    assert bench.RESULTS["moe_correctness"] == "ok", out
    assert "failed" not in out, out
    table = bench.RESULTS["moe_times"]
    assert {r["variant"] for r in table} == set(bench.MOE_VARIANTS) | {"bf16"}
    for tokens in (1, 40):
        ran = {r["variant"] for r in table if r["tokens"] == tokens}
        expected = {n for n, make in bench.MOE_VARIANTS.items() if make(tokens) is not None} | {"bf16"}
        assert ran == expected, (tokens, ran, expected)
    assert all("us_zero" in r and "us_sym" in r for r in table if r["variant"] != "bf16")
    assert set(bench.RESULTS["moe_best"]) == {1, 40}
    assert out.count("W4A16MoeConfig(block_m=") >= 2


def test_mid_section_runs_on_cpu(bench, monkeypatch, capsys):
    """--mid's variants (swapped tiles up to 256 rows wide) pass the check and land in the tables."""
    monkeypatch.setattr(bench, "W4A16_VARIANTS", bench.MID_VARIANTS)
    monkeypatch.setattr(bench, "MS", (70,))
    monkeypatch.setattr(bench, "CHECK_MS", (5, 70))
    bench.correctness(True)
    assert bench.RESULTS["correctness"] == "ok", bench.RESULTS["correctness"]
    bench.times(True)
    out = capsys.readouterr().out
    assert "failed" not in out, out
    assert {r["variant"] for r in bench.RESULTS["times"]} == set(bench.MID_VARIANTS) | {"bf16"}
