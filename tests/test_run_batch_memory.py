"""A 20,000-line file runs in bounded memory: a real run-batch process's RSS grows by less than 300 MB
from its first written result to its end (the figure is printed; run with -s)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

import pytest

from tests.batch_helpers import REPO, chat_line, completion_line, engine_flags, make_batch_model, words

pytestmark = pytest.mark.slow  # runs the real model over many lines


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


def test_20000_lines_in_bounded_memory(batch_model, tmp_path):
    """RSS is sampled from the moment the first result is written (model loaded, batch full) to the end."""
    import psutil

    n = 20_000
    inp, out, summary = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "s.json"
    write_lines(inp, n)
    args = [
        sys.executable,
        "-m",
        "overnight",
        "run-batch",
        "-i",
        str(inp),
        "-o",
        str(out),
        "--summary-json",
        str(summary),
        *engine_flags(batch_model, max_num_seqs=128),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(args, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    ps = psutil.Process(proc.pid)
    baseline = peak = None
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            rss = ps.memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            break
        if baseline is None and out.exists() and out.stat().st_size > 0:
            baseline = peak = rss
        elif baseline is not None:
            peak = max(peak, rss)
        time.sleep(0.02)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()[-2000:]
    s = json.loads(summary.read_text())
    assert s["ok"] == n and s["failed"] == 0
    with open(out, "rb") as f:
        assert sum(1 for _ in f) == n
    assert baseline is not None
    growth = peak - baseline
    print(
        f"\nRSS {baseline:.0f} MiB at the first result, peak {peak:.0f} MiB after it: growth {growth:.0f} MiB "
        f"over {n} lines ({s['elapsed_s']:.1f} s, {s['requests_per_s']:.0f} lines/s; "
        f"lifetime peak {s['peak_rss_mib']:.0f} MiB)"
    )
    assert growth < 300
