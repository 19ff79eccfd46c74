"""bench/w4a16_mma_gpu.py's plan on the CPU: MMA order only where it is at least as fast on every fused
tier, then the tiers from the fused tiles' wins, as the spec bench/pairs_gpu.sh takes."""

from __future__ import annotations

import json

import pytest

from overnight.kernels import w4a16_gemm
from overnight.kernels.w4a16_gemm import W4A16Config
from tests.bench_scripts import fake_graph_time, load_bench_script


@pytest.fixture()
def bench(monkeypatch):
    monkeypatch.setattr(w4a16_gemm, "DEQUANT_GEMM_MIN_M", 193)
    monkeypatch.setattr(w4a16_gemm, "MMA_DEQUANT_GEMM_MIN_M", 193)  # the module before session Y
    monkeypatch.setattr(w4a16_gemm, "MMA_ORDER", False)
    monkeypatch.setattr(w4a16_gemm, "TIERS", w4a16_gemm.TIERS)
    return load_bench_script(monkeypatch, "w4a16_mma_gpu.py")


def table(bench, speedups: dict[str, dict[int, float]]) -> list[dict]:
    """Rows of x bf16 per variant and M, the same at both shapes; variants not named did not run."""
    return [
        {"M": m, "variant": name, "x_bf16": x, "shape": shape}
        for name, by_m in speedups.items()
        for m, x in by_m.items()
        for shape in ("o", "down")
    ]


def test_mma_order_and_the_tiles_that_win(bench):
    t = table(
        bench,
        {
            "current": {m: 0.5 for m in bench.MS},
            # at least as fast on every fused tier (16-128 rows), dequantize from 193 rows
            "default": {16: 0.6, 64: 0.5, 128: 0.7, 192: 0.5, 256: 0.5, 384: 0.6, 512: 0.6, 1024: 0.6},
            "mma-128x128-w8": {128: 0.65, 192: 0.7, 256: 0.55, 384: 0.5, 512: 0.5, 1024: 0.5},
            "mma-256x128-w8": {128: 0.6, 192: 0.6, 256: 0.65, 384: 0.55, 512: 0.7, 1024: 0.5},
        },
    )
    tiers, min_m, mma = bench.plan(t, shapes=2)
    assert mma is True and min_m == 257  # dequantize wins at 384 rows: the fused tiers end there
    w4a16_gemm.TIERS = tuple((b, W4A16Config(**c)) for b, c in tiers)
    w4a16_gemm.DEQUANT_GEMM_MIN_M = min_m
    assert w4a16_gemm.default_config(192) == bench.TILES["mma-128x128-w8"](192)
    assert w4a16_gemm.default_config(256) == bench.TILES["mma-256x128-w8"](256)
    assert w4a16_gemm.default_config(384).path == "dequant"
    assert w4a16_gemm.default_config(512).path == "dequant"  # a tile's win past the first loss: no tier
    json.dumps([tiers, min_m, mma])  # the spec is JSON


def test_session_y_table_plans_the_module_tiers(bench):
    """The geometric means session Y measured on an H100 (docs/performance.md) plan exactly the tiers
    and threshold the module now holds: MMA order, the default's 64-row tile kept at 129-192 rows where
    it beat every fused tile, 256 x 128 tiles to 256 rows, 128 x 128 to 384, dequantize from 385."""
    t = table(
        bench,
        {
            "current": {
                16: 1.38,
                64: 0.85,
                128: 0.67,
                192: 0.46,
                256: 0.45,
                384: 0.50,
                512: 0.57,
                1024: 0.72,
            },
            "default": {
                16: 1.76,
                64: 1.18,
                128: 0.80,
                192: 0.68,
                256: 0.45,
                384: 0.50,
                512: 0.56,
                1024: 0.70,
            },
            "mma-128x128-w8": {128: 0.803, 192: 0.51, 256: 0.52, 384: 0.51, 512: 0.42, 1024: 0.45},
            "mma-128x128-w8-s2": {128: 0.63, 192: 0.40, 256: 0.40, 384: 0.40, 512: 0.32, 1024: 0.37},
            "mma-256x128-w8": {128: 0.57, 192: 0.60, 256: 0.58, 384: 0.43, 512: 0.52, 1024: 0.52},
            "mma-128x256-w8": {128: 0.68, 192: 0.47, 256: 0.46, 384: 0.42, 512: 0.40, 1024: 0.38},
        },
    )
    tiers, min_m, mma = bench.plan(t, shapes=2)
    assert mma is True and min_m == 385
    module = dict(bench.w4a16_gemm.TIERS)  # the fixture's copy of the module's tiers
    assert [b for b, _ in tiers] == [16, 32, 64, 128, 192, 256, 384, 511, 1 << 62] == list(module)
    assert [W4A16Config(**c) for _, c in tiers] == list(module.values())


def test_the_64_row_tile_gets_the_rows_past_256_where_it_wins(bench, monkeypatch):
    """Rows between session Y's points (--ms): where the module's 64-row tile beats the 128 x 128 one
    at 257-320 rows (Qwen3-32B-AWQ's ~265-row decode steps), the plan gives it those rows and keeps
    the 256 x 128 tile below and the 128 x 128 one above."""
    ms = (16, 64, 128, 192, 256, 288, 320, 384, 512, 1024)
    monkeypatch.setattr(bench, "MS", ms)
    t = table(
        bench,
        {
            "current": dict(zip(ms, (1.38, 0.85, 0.67, 0.46, 0.45, 0.47, 0.48, 0.50, 0.57, 0.72))),
            "default": dict(zip(ms, (1.76, 1.18, 0.80, 0.68, 0.45, 0.46, 0.47, 0.50, 0.56, 0.70))),
            "mma-128x128-w8": {128: 0.79, 192: 0.51, 256: 0.52, 288: 0.45, 320: 0.47, 384: 0.51, 512: 0.42},
            "mma-256x128-w8": {128: 0.57, 192: 0.60, 256: 0.58, 288: 0.50, 320: 0.50, 384: 0.43, 512: 0.52},
            "mma-64x64-w4": {128: 0.7, 192: 0.68, 256: 0.55, 288: 0.60, 320: 0.56, 384: 0.48, 512: 0.45},
        },
    )
    tiers, min_m, mma = bench.plan(t, shapes=2)
    assert mma is True and min_m == 385
    monkeypatch.setattr(w4a16_gemm, "TIERS", tuple((b, W4A16Config(**c)) for b, c in tiers))
    monkeypatch.setattr(w4a16_gemm, "MMA_DEQUANT_GEMM_MIN_M", min_m)
    at = {m: w4a16_gemm.default_config(m, mma_order=True) for m in (192, 256, 265, 320, 384)}
    assert at[192] == at[265] == at[320] == bench.TILES["mma-64x64-w4"](265)
    assert at[256] == bench.TILES["mma-256x128-w8"](256)
    assert at[384] == bench.TILES["mma-128x128-w8"](384)


def test_no_mma_order_when_it_loses_on_a_fused_tier(bench):
    t = table(
        bench,
        {
            "current": {m: 0.5 for m in bench.MS},
            "default": {16: 0.6, 64: 0.45, 128: 0.7, 192: 0.5},  # 64 rows: slower than today
            "mma-128x128-w8": {128: 0.9, 192: 0.9},
        },
    )
    tiers, min_m, mma = bench.plan(t, shapes=2)
    assert mma is False and min_m == 193
    assert [b for b, _ in tiers] == [b for b, _ in w4a16_gemm.TIERS]


def test_bench_runs_on_cpu(bench, monkeypatch, capsys):
    """Steps 1-3 end to end on the CPU (Triton interpreter, fp32, tiny shapes, a fake timer): every
    variant passes its check on MMA-ordered words and lands in the table, so the one GPU call the
    bench is written for does not fail on a typo."""
    import torch

    import bench.w4a16_variants_gpu as vb

    monkeypatch.setattr(vb, "DEVICE", "cpu")
    monkeypatch.setattr(vb, "DTYPE", torch.float32)
    monkeypatch.setattr(vb, "MID_SHAPES", {"o": (40, 256), "down": (24, 384)})
    monkeypatch.setattr(vb, "ROTATE_BYTES", 1)
    monkeypatch.setattr(bench, "MS", (3, 100))
    monkeypatch.setattr(bench, "CHECK_MS", (1, 100))
    monkeypatch.setattr(bench, "CHECK_DTYPES", (torch.float32, torch.float16))
    monkeypatch.setattr(bench, "graph_time", fake_graph_time(5))
    assert bench.correctness() == []
    table = bench.times()
    bench.summary(table)
    names = {r["variant"] for r in table}
    assert names == {"bf16", "current", "default", *bench.TILES}
    assert len(table) == 2 * (3 + 3 + len(bench.TILES))  # 3 rows: bf16, current, default; tiles at 100
    tiers, min_m, mma = bench.plan(table, shapes=2)
    assert isinstance(mma, bool) and min_m >= 1 and tiers


def test_a_sweep_without_fused_rows_keeps_the_module_settings(bench, monkeypatch):
    """Session AA's short sweep (256-384 rows, all past the column order's fused tiers) planned column
    order: with no rows where both orders run fused tiles there is nothing to judge it by."""
    monkeypatch.setattr(w4a16_gemm, "MMA_ORDER", True)
    monkeypatch.setattr(w4a16_gemm, "MMA_DEQUANT_GEMM_MIN_M", 385)
    monkeypatch.setattr(bench, "MS", (256, 288, 320, 352, 384))
    t = table(
        bench,
        {
            "current": {256: 0.44, 288: 0.47, 320: 0.54, 352: 0.50, 384: 0.51},
            "default": {256: 0.57, 288: 0.46, 320: 0.59, 352: 0.52, 384: 0.52},
        },
    )
    tiers, min_m, mma = bench.plan(t, shapes=2)
    assert mma is True and min_m == 385
    assert [b for b, _ in tiers] == [b for b, _ in w4a16_gemm.TIERS]
