"""bench/vllm_dummy.py: vLLM's dummy weights drawn as ours (norms 1, a seed a tensor), and the plugin
entry point vLLM's processes find (checked with importlib.metadata, as vLLM's loader looks it up)."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import entry_points

import torch
from torch import nn

from bench import vllm_dummy


class RMSNorm(nn.Module):  # named as vLLM's: the plugin tells norms by class name
    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = RMSNorm(8)
        self.a = nn.Linear(8, 8, bias=False)
        self.b = nn.Linear(8, 8, bias=False)  # same shape as a: vLLM's shared seed gives a's values
        self.ids = nn.Parameter(torch.zeros(4, dtype=torch.int32), requires_grad=False)


def test_norms_are_one_and_same_shaped_tensors_differ():
    block = Block()
    for module in block.modules():  # as vLLM's DummyModelLoader visits them: parents first
        vllm_dummy.draw_module(module, None)
    assert torch.equal(block.norm.weight, torch.ones(8))
    assert not torch.equal(block.a.weight, block.b.weight)
    for w in (block.a.weight, block.b.weight):
        assert w.abs().max() <= vllm_dummy.DUMMY_RANGE and w.std() > vllm_dummy.DUMMY_RANGE / 4
    assert torch.equal(block.ids, torch.zeros(4, dtype=torch.int32))  # integers untouched, as vLLM


def test_fp8_tensors_are_drawn_through_fp16():
    t = torch.zeros(64, dtype=torch.float8_e4m3fn)
    vllm_dummy.draw_tensor(t, -1.0, 1.0)
    assert t.float().abs().max() <= 1.0 and t.float().abs().sum() > 0


def test_install_puts_the_plugin_where_vllm_looks(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    folder = vllm_dummy.install()
    found = [e for e in entry_points(group="vllm.general_plugins") if e.name == "overnight_dummy"]
    assert [e.value for e in found] == ["bench.vllm_dummy:register"]
    assert os.environ["PYTHONPATH"].split(os.pathsep)[0] == folder
    # a process vLLM starts sees it too (its PYTHONPATH), and the module it names imports there
    code = (
        "from importlib.metadata import entry_points; "
        "e = [e for e in entry_points(group='vllm.general_plugins') if e.name == 'overnight_dummy']; "
        "import importlib; importlib.import_module(e[0].value.split(':')[0]); print(len(e))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=True)
    assert out.stdout.strip() == "1"


def test_routing_spread_counts_the_experts_a_decode_step_hits(monkeypatch, tmp_path, capsys):
    """bench/routing_spread_gpu.py's own side on a tiny random Qwen3-MoE (CPU): hooks see every decode
    step of the batch, and the counts lie between top-k and the number of experts."""
    import json

    from tests.bench_scripts import load_bench_script
    from tests.tiny_models import tiny_config

    tiny_config("qwen3_moe", max_position_embeddings=2048, vocab_size=2048).save_pretrained(tmp_path)
    bench = load_bench_script(monkeypatch, "routing_spread_gpu.py")
    argv = ["x", "--engine", "ours", "--model", str(tmp_path), "--requests", "3", "--max-tokens", "6"]
    monkeypatch.setattr(sys, "argv", argv)
    assert bench.main() == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    hits = record["experts_hit_per_decode_step"]
    assert len(hits) == 3 and record["experts"] == 8
    assert all(2 <= h <= 6 for h in hits.values())  # top-2 of 8 for 3 tokens: at least 2, at most 6
    late = record["experts_hit_last_quarter"]
    assert late.keys() == hits.keys() and all(2 <= h <= 6 for h in late.values())
    assert record["distinct_tokens_at"]["0"] <= 3
