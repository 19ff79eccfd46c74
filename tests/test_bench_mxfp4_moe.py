"""bench/mxfp4_moe_gpu.py runs end to end on the CPU (Triton interpreter, fp32, tiny experts, a fake
timer; conftest.py sets TRITON_INTERPRET on a CPU machine): every decoding passes its check against the bf16-path layer and the reference, lands in the
table, and the summary names a default, so the one GPU call it is written for does not fail on a typo."""

from __future__ import annotations

import torch

from overnight.kernels.moe_gemm import MXFP4_DECODES
from tests.bench_scripts import fake_graph_time, load_bench_script


def test_mxfp4_bench_runs_on_cpu(monkeypatch, capsys):
    bench = load_bench_script(monkeypatch, "mxfp4_moe_gpu.py")
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "DTYPE", torch.float32)
    monkeypatch.setattr(bench, "MODELS", {"tiny": 2})
    monkeypatch.setattr(bench, "HIDDEN", 64)
    monkeypatch.setattr(bench, "INTER", 32)
    monkeypatch.setattr(bench, "TOP_K", 2)
    monkeypatch.setattr(bench, "TOKENS", (3, 16))
    monkeypatch.setattr(bench, "COPIES", 1)
    monkeypatch.setattr(bench, "CALLS", 1)
    monkeypatch.setattr(bench, "graph_time", fake_graph_time(3))
    bench.main()
    out = capsys.readouterr().out
    assert bench.RESULTS["correctness"] == "ok", out
    assert "failed" not in out, out
    table = bench.RESULTS["times"]
    assert {(r["tokens"], r["variant"]) for r in table} == {
        (t, v) for t in (3, 16) for v in ("bf16", *bench.VARIANTS)
    }
    assert set(MXFP4_DECODES) <= set(bench.VARIANTS)
    assert all("err_ref" in r for r in table if r["tokens"] == 16 and r["variant"] != "bf16")
    assert set(bench.RESULTS["best"]) == {3, 16}
    assert "MXFP4_DECODE = " in out
