"""bench/moe_gpu.py runs end to end on the CPU (Triton interpreter, fp32, tiny experts, a fake timer;
conftest.py sets TRITON_INTERPRET on a CPU machine; its e4m3 casts rounded as the GPU's,
tests/triton_fp8.py), with and without --fp8: every correctness check
passes, the sweep tunes every bucket it is given and prints the JSON to merge, the layer table has a
row per size with the W8A8 and weight-only FP8 columns. The next GPU session's first call runs this
script; a typo found there costs device minutes."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from overnight.kernels import moe_configs
from overnight.kernels.moe_align import ALIGN_VARIANTS
from tests.bench_scripts import load_bench_script
from tests.triton_fp8 import exact_fp8_casts

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the script itself")


def load_bench(monkeypatch):
    bench = load_bench_script(monkeypatch, "moe_gpu.py")
    monkeypatch.setattr(bench, "DEV", torch.device("cpu"))
    monkeypatch.setattr(bench, "DT", torch.float32)
    monkeypatch.setattr(bench, "H", 64)
    monkeypatch.setattr(bench, "I", 32)
    monkeypatch.setattr(bench, "E", 8)
    monkeypatch.setattr(bench, "TOP_K", 2)
    monkeypatch.setattr(bench, "LAYER_SIZES", [3, 16])
    tiles = [(32, 32, 4, 2), (64, 32, 4, 2)]
    monkeypatch.setattr(bench, "TILES", {16: tiles, 32: tiles, 64: tiles, 128: tiles})
    extra = [(32, 32, 4, 3)]  # the W8A8 sweep's deeper pipelines, one small stand-in
    monkeypatch.setattr(bench, "FP8_EXTRA_TILES", {16: extra, 32: extra, 64: extra, 128: extra})
    monkeypatch.setattr(bench, "checks", [])
    # main() points moe_configs at the configs it just tuned: undone after the test.
    monkeypatch.setattr(moe_configs, "_table", moe_configs._table)
    timed = []

    def fake_bench(fn, warmup=5, rep=20):
        fn()
        timed.append(1)
        return 0.01 * (1 + len(timed) % 5)  # milliseconds, varied so the sweep has a winner to pick

    monkeypatch.setattr(bench, "bench", fake_bench)
    monkeypatch.setattr(bench, "ROUTING_SIZES", [3, 16])
    # The CUDA-graph captures need a GPU; everything else runs here, the graph-timed calls once each.
    monkeypatch.setattr(bench, "check_graph", lambda gen, w: bench.check("graph (GPU only)", True))

    def fake_graph_time(calls, replays=10):
        for call in calls:
            call()
        timed.append(1)
        return 1.0 + len(timed) % 3

    monkeypatch.setattr(bench, "graph_time", fake_graph_time)
    return bench, timed


@pytest.mark.slow
def test_moe_bench_fp8_runs_on_cpu(monkeypatch, capsys, tmp_path):
    """--fp8, as the plan's call runs it (the bf16 sweep is the same code with unquantized operands;
    the correctness pass covers both forms either way)."""
    bench, timed = load_bench(monkeypatch)
    # Small buckets: 2 pairs an expert (BLOCK_M 16 and 64) and 8 (16, 32 and 64).
    argv = ["moe_gpu.py", "--fp8", "--skip-engine", "--buckets", "8,32", "--deadline", "600"]
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setenv("OUT", str(tmp_path))
    with exact_fp8_casts():
        bench.main()
    out = capsys.readouterr().out
    failed = [name for name, ok, _ in bench.checks if not ok]
    assert not failed, out
    assert any(name.startswith("fp8 w8a8") for name, _, _ in bench.checks), out
    assert timed, "nothing was timed"

    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["checks_failed"] == []
    key = bench.shape_key(8, 32, 64, 2, torch.float32, torch.float8_e4m3fn)
    tuned = summary["configs"]["cpu"][key]
    assert set(tuned) == {"8", "32"}
    written = json.loads((tmp_path / "moe_configs.json").read_text())
    assert written == summary["configs"]
    assert [r["tokens"] for r in summary["layer"]] == [3, 16]
    assert all(r["fp8_us"] > 0 and r["fp8_wonly_us"] > 0 for r in summary["layer"])
    # the routing table: the router and every alignment variant at each size
    assert [r["tokens"] for r in summary["routing"]] == [3, 16]
    for row in summary["routing"]:
        assert row["router_us"] > 0 and all(row[f"align_{v}_us"] > 0 for v in ALIGN_VARIANTS)
    assert {f"align {v} T=1024 BLOCK_M=64" for v in ALIGN_VARIANTS} <= {
        name.split(":")[0] for name, _, _ in bench.checks
    }


def test_installing_a_few_buckets_keeps_the_shapes_other_buckets(monkeypatch):
    """--install --buckets 4096,16384 must not drop the 64 and 256 entries tuned before (it did:
    the shape's entry was replaced whole)."""
    bench = load_bench_script(monkeypatch, "moe_gpu.py")
    old = {"gpu": {"k": {"64": {"block_m": 16}, "4096": {"block_m": 64}}, "other": {"x": {}}}, "gpu2": {}}
    merged = bench.merge_tuned(old, "gpu", "k", {"4096": {"block_m": 128}, "16384": {"block_m": 128}})
    assert merged["gpu"]["k"] == {"64": {"block_m": 16}, "4096": {"block_m": 128}, "16384": {"block_m": 128}}
    assert merged["gpu"]["other"] == {"x": {}} and merged["gpu2"] == {}
    assert old["gpu"]["k"] == {"64": {"block_m": 16}, "4096": {"block_m": 64}}  # the input is left alone
    assert bench.merge_tuned({}, "new", "k", {"8": {}}) == {"new": {"k": {"8": {}}}}


def test_vllms_fp8_experts_are_held_per_expert_and_called_w8a8(monkeypatch):
    """The "vllm fp8" column's operands: e4m3 with one scale an expert and projection, each expert's
    largest weight at e4m3's largest value, and vLLM's fused_experts called with a W8A8 quant config
    of those scales (a stand-in for vLLM records the call)."""
    bench = load_bench_script(monkeypatch, "moe_gpu.py")
    gen = torch.Generator().manual_seed(0)
    w = {"w13": torch.randn(4, 6, 8, generator=gen), "w2": 3 * torch.randn(4, 8, 3, generator=gen)}
    v = bench.per_expert_fp8(w)
    for name in ("w13", "w2"):
        assert v[name].dtype == torch.float8_e4m3fn and v[name + "_scale"].shape == (4,)
        back = v[name].float() * v[name + "_scale"][:, None, None]
        assert torch.allclose(back, w[name], rtol=0.07, atol=1e-3 * float(w[name].abs().max()))
        assert torch.all(v[name].float().abs().amax(dim=(1, 2)) == 448.0)
    seen = {}

    def fused(x, w1, w2, weights, ids, quant_config):
        seen.update(w1=w1, w2=w2, config=quant_config)
        return x

    def make_config(w1_scale, w2_scale):
        return ("w8a8", w1_scale, w2_scale)

    x = torch.ones(2, 8)
    assert bench.vllm_fp8_experts(fused, make_config, x, v, None, None) is x
    assert seen["w1"] is v["w13"] and seen["w2"] is v["w2"]
    assert seen["config"] == ("w8a8", v["w13_scale"], v["w2_scale"])


def test_e4m3_operands_fit_twice_the_pipeline(monkeypatch):
    """The W8A8 sweep counts its stages at a byte an element: a 64 x 256 K tile four stages deep fits
    shared memory for e4m3 (196 KB) and not for bf16 (393 KB)."""
    bench = load_bench_script(monkeypatch, "moe_gpu.py")
    assert bench.fits(64, 64, 256, 4, 4, gated=True, elem_bytes=1)
    assert not bench.fits(64, 64, 256, 4, 4, gated=True)
    assert all(
        bench.fits(bm, bn, bk, w, st, gated=True, elem_bytes=1)
        for bm, t in bench.FP8_EXTRA_TILES.items()
        for bn, bk, w, st in t
    )
