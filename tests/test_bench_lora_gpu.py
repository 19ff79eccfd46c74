"""bench/lora_gpu.py runs end to end on the CPU (Triton interpreter, fp32, tiny projections, a fake
timer): both shrink modes and every expand width pass their checks against the references and land
in the table, so the GPU call it is written for does not fail on a typo."""

from __future__ import annotations

import json

import torch

from overnight.kernels import lora
from tests.bench_scripts import load_bench_script


def test_lora_bench_runs_on_cpu(monkeypatch, capsys):
    bench = load_bench_script(monkeypatch, "lora_gpu.py")
    monkeypatch.setattr(bench, "DEV", torch.device("cpu"))
    monkeypatch.setattr(bench, "DT", torch.float32)
    # K 576 cuts into two parts (320 + 256) on a 16-row decode grid (a fused q/k/v of unequal slices, a one-slice down)
    monkeypatch.setattr(bench, "PROJECTIONS", [("qkv", 64, (32, 16, 16)), ("down", 576, (64,))])
    monkeypatch.setattr(bench, "SLOTS", 3)
    monkeypatch.setattr(bench, "RANK", 8)
    cases = (("decode", 16, True, 16), ("decode", 40, True, 32), ("prefill", 40, False, 64))
    monkeypatch.setattr(bench, "CASES", cases)
    monkeypatch.setattr(bench, "EXPAND_COLUMNS", (64, 128))
    monkeypatch.setattr(bench, "sm_clock_now", lambda: "n/a")

    def fake_time(calls, replays=10):
        for call in calls:
            call()
        return 2.0

    monkeypatch.setattr(bench, "graph_time", fake_time)
    bench.main()
    out = capsys.readouterr().out
    cases = json.loads(out.strip().splitlines()[-1])["cases"]
    assert len(cases) == 3 * 3 and all(c["ok"] for c in cases), out
    assert [c["block_m"] for c in cases[::3]] == [16, 32, 64]
    assert [c["expand_block_n"] for c in cases[:3]] == [lora.EXPAND_BLOCK_N, 64, 128]  # the default first
    # one pass against the split: the decode grid of 16 rows splits the 576-wide down projection
    assert cases[0]["splits"] == [1, 1] and cases[1]["splits"][1] > 1
    assert cases[0]["shrink_us"] == 2 * 2.0 and "| FAIL |" not in out
