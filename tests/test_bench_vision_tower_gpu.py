"""bench/vision_tower_gpu.py runs end to end on the CPU (Triton interpreter, fp32, a tiny tower of the
7B's kind and an MLP width that loading pads): both towers run, their outputs agree and land in the
table, so the GPU call it is written for does not fail on a typo."""

from __future__ import annotations

import json

import torch

from tests.bench_scripts import load_bench_script


def test_vision_tower_bench_runs_on_cpu(monkeypatch, capsys):
    bench = load_bench_script(monkeypatch, "vision_tower_gpu.py")
    monkeypatch.setattr(bench, "DEV", torch.device("cpu"))
    monkeypatch.setattr(bench, "DT", torch.float32)
    monkeypatch.setattr(bench, "IMAGES", 2)
    monkeypatch.setattr(bench, "SIDE", 8)
    monkeypatch.setattr(bench, "REPEATS", 1)
    monkeypatch.setattr(bench, "sm_clock_now", lambda: "n/a")
    monkeypatch.setattr(bench, "GEMM_ROWS", 16)
    monkeypatch.setattr(bench, "WIDTHS", (58, 64))
    tiny = dict(depth=2, hidden_size=32, intermediate_size=58, num_heads=2, out_hidden_size=64,
                patch_size=14, spatial_merge_size=2, window_size=56, fullatt_block_indexes=[1],
                hidden_act="silu", temporal_patch_size=2)  # fmt: skip
    bench.main(tiny)
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["ok"] and result["rel_err"] < 1e-5 and len(result["ms"]) == 2, out
    assert list(result["gemm_us"]) == ["58", "64"] and "| 58 |" in out
