"""`overnight bench throughput` on the CPU with the embedded model, beside transformers in the same
run. Checks the command's output, not speed (the measured ratio lives in docs/performance.md)."""

from __future__ import annotations

import json

import pytest

from overnight.cli import main

pytestmark = pytest.mark.slow  # runs the real model


def test_bench_throughput_compares_with_transformers(capsys, tmp_path):
    out_file = tmp_path / "bench.jsonl"
    argv = [
        "bench",
        "throughput",
        "--num-prompts",
        "64",
        "--input-len",
        "8",
        "24",
        "--output-len",
        "2",
        "6",
        "--compare",
        "transformers",
        "--hf-batch-size",
        "64",
        "--max-model-len",
        "256",
        "--json-out",
        str(out_file),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "overnight" in printed and "transformers generate (static batch 64)" in printed
    assert "ratio output tok/s" in printed
    record = json.loads(out_file.read_text().splitlines()[-1])
    ours, theirs = record["results"]
    assert ours["requests"] == theirs["requests"] == 64
    # Same prompts, same requested lengths: both count the same tokens.
    assert ours["input_tokens"] == theirs["input_tokens"] and ours["output_tokens"] == theirs["output_tokens"]
    assert ours["output_tok_s"] > 0 and theirs["output_tok_s"] > 0
    assert ours["startup_s"] is not None and ours["clocks"]["gpu"] == "n/a"
