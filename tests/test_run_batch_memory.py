"""A 20,000-line file runs in bounded memory: the peak RSS of a run over 20,000 lines exceeds that of a
run over 200 lines of the same kind by less than 300 MB (the figure is printed; run with -s)."""

from __future__ import annotations

import json
import random

import pytest

from tests.test_run_batch import (
    chat_line,
    completion_line,
    engine_flags,
    make_batch_model,
    run_subprocess,
    words,
)


@pytest.fixture(scope="module")
def batch_model(tmp_path_factory) -> str:
    return make_batch_model(tmp_path_factory.mktemp("batch-model"))


def write_lines(path, n: int) -> None:
    rng = random.Random(n)
    with open(path, "w") as f:
        for i in range(n):
            if i % 3:
                line = completion_line(f"q{i}", words(rng, rng.randint(4, 40)), max_tokens=1, temperature=0)
            else:
                line = chat_line(f"q{i}", words(rng, rng.randint(4, 40)), max_tokens=1)
            f.write(json.dumps(line) + "\n")


def peak_rss(model: str, tmp_path, n: int) -> tuple[float, dict]:
    inp, out, summary = tmp_path / f"in{n}.jsonl", tmp_path / f"out{n}.jsonl", tmp_path / f"s{n}.json"
    write_lines(inp, n)
    proc = run_subprocess(["-i", str(inp), "-o", str(out), "--summary-json", str(summary),
                           *engine_flags(model, max_num_seqs=128)], timeout=600)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    s = json.loads(summary.read_text())
    assert s["ok"] == n and s["failed"] == 0
    with open(out, "rb") as f:
        assert sum(1 for _ in f) == n
    return s["peak_rss_mib"], s


def test_20000_lines_in_bounded_memory(batch_model, tmp_path):
    small, _ = peak_rss(batch_model, tmp_path, 200)
    big, s = peak_rss(batch_model, tmp_path, 20_000)
    growth = big - small
    print(f"\npeak RSS: {small:.0f} MiB for 200 lines, {big:.0f} MiB for 20,000 lines: growth {growth:.0f} MiB; "
          f"20,000 lines in {s['elapsed_s']:.1f} s ({s['requests_per_s']:.0f} lines/s)")
    assert growth < 300
