"""bench/w4a16_moe_mma_gpu.py on the CPU: its verdict from a timing table, and the whole bench on tiny
experts (Triton interpreter, fp32 and fp16, a fake timer), so the one GPU call it is written for does not
fail on a typo."""

from __future__ import annotations

import pytest
import torch

from tests.bench_scripts import fake_graph_time, load_bench_script


@pytest.fixture()
def bench(monkeypatch):
    import bench.w4a16_variants_gpu as vb

    module = load_bench_script(monkeypatch, "w4a16_moe_mma_gpu.py")
    monkeypatch.setattr(vb, "DEVICE", "cpu")
    monkeypatch.setattr(vb, "DTYPE", torch.float32)
    monkeypatch.setattr(vb, "MOE_SHAPE", (4, 256, 128, 2))  # rows per expert = tokens / 2
    monkeypatch.setattr(vb, "MOE_TOKENS", (2, 40))  # 40: the 64-row tier, so every variant runs
    monkeypatch.setattr(vb, "MOE_COPIES", 1)
    monkeypatch.setattr(vb, "MOE_CALLS", 1)
    monkeypatch.setattr(module, "CHECK_TOKENS", (1, 40))
    monkeypatch.setattr(module, "CHECK_DTYPES", (torch.float32, torch.float16))
    return module


def _table(speedups: dict[str, dict[int, float]]) -> list[dict]:
    return [
        {"tokens": t, "variant": name, "x_zero": x, "x_sym": x} for name, by_t in speedups.items() for t, x in by_t.items()
    ]  # fmt: skip


def test_verdict_turns_mma_order_on_only_where_it_never_loses(bench):
    tokens = bench.vb.MOE_TOKENS
    on = _table(
        {"column": dict.fromkeys(tokens, 1.0), "mma": {2: 1.3, 40: 1.0}, "mma-m64-swap-half": {40: 1.2}}
    )
    assert bench.verdict(on) == (True, {40: "mma-m64-swap-half"})
    off = _table(
        {"column": dict.fromkeys(tokens, 1.0), "mma": {2: 1.3, 40: 0.9}, "mma-m64-swap-half": {40: 0.95}}
    )
    assert bench.verdict(off) == (False, {})


def test_session_z_table_keeps_mma_order_on(bench, monkeypatch):
    """The H100 figures that turned MMA_ORDER on (geometric means x bf16; "column" is what ran before,
    "mma" the swapped 64-row tier that MMA_TIERS now holds): the verdict says on, and no other tile
    wins."""
    monkeypatch.setattr(bench.vb, "MOE_TOKENS", (1, 16, 128, 512, 1024, 4096))
    table = _table(
        {
            "column": {1: 1.20, 16: 1.70, 128: 1.79, 512: 1.43, 1024: 1.11, 4096: 0.71},
            "mma": {1: 1.50, 16: 2.23, 128: 2.32, 512: 1.57, 1024: 1.16, 4096: 0.85},
            "mma-m64-swap-half": {512: 1.51, 1024: 1.13},
        }
    )
    assert bench.verdict(table) == (True, {})


@pytest.mark.slow  # ~20 s of the interpreter
def test_bench_runs_on_cpu(bench, monkeypatch, capsys):
    monkeypatch.setattr(bench, "graph_time", fake_graph_time(3))
    assert bench.correctness() == []
    table = bench.times()
    names = {r["variant"] for r in table}
    assert names == {"bf16", *bench.VARIANTS}
    assert {r["variant"] for r in table if r["tokens"] == 2} == {"bf16", "column", "mma", "mma-column-tiers"}
    assert all("us_zero" in r and "us_sym" in r for r in table if r["variant"] != "bf16")
    mma, tiles = bench.verdict(table)
    assert isinstance(mma, bool) and set(tiles) <= {40}
