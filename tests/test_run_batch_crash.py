"""A real `python -m overnight run-batch` process killed with SIGKILL at 5 random points, each followed by
--resume: the final output answers every custom_id exactly once and holds no torn line."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from tests.test_run_batch import (
    REPO,
    chat_line,
    completion_line,
    engine_flags,
    make_batch_model,
    run_subprocess,
    words,
    write_jsonl,
)

pytestmark = pytest.mark.slow  # kills and resumes real run-batch processes


@pytest.fixture(scope="module")
def batch_model(tmp_path_factory) -> str:
    return make_batch_model(tmp_path_factory.mktemp("batch-model"))


def count_lines(path) -> int:
    try:
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except FileNotFoundError:
        return 0


def test_sigkill_at_random_points_then_resume(batch_model, tmp_path):
    rng = random.Random(7)
    lines = []
    for i in range(150):
        body = dict(max_tokens=rng.randint(6, 24), ignore_eos=True, temperature=0, seed=i)
        if i % 2:
            lines.append(chat_line(f"r{i}", words(rng, 4), logprobs=True, top_logprobs=5, **body))
        else:
            lines.append(completion_line(f"r{i}", [words(rng, 3), words(rng, 2)], **body))
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(inp, lines)
    args = [
        sys.executable,
        "-m",
        "overnight",
        "run-batch",
        "-i",
        str(inp),
        "-o",
        str(out),
        "--resume",
        *engine_flags(batch_model, max_num_seqs=2),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    kills_mid_run = 0
    for k in range(5):
        before = count_lines(out)
        target = before + rng.randint(2, 18)
        proc = subprocess.Popen(args, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        while count_lines(out) < target and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(rng.uniform(0, 0.2))
        if proc.poll() is None:
            kills_mid_run += 1
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        if k == 2:  # a kill inside write() leaves a partial last line: make sure one is seen
            with open(out, "ab") as f:
                f.write(b'{"id":"batch_req_x","custom_id":"r1","response":{"status_code":2')
    assert kills_mid_run == 5
    partial = count_lines(out)
    assert 0 < partial < len(lines)

    proc = run_subprocess(
        ["-i", str(inp), "-o", str(out), "--resume", *engine_flags(batch_model, max_num_seqs=8)], timeout=300
    )
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    data = out.read_bytes()
    assert data.endswith(b"\n")
    results = [json.loads(x) for x in data.splitlines()]  # raises on any torn line
    ids = [r["custom_id"] for r in results]
    assert sorted(ids) == sorted(x["custom_id"] for x in lines)  # each exactly once
    assert all(r["error"] is None and r["response"]["status_code"] == 200 for r in results)
    for r in results:
        body = r["response"]["body"]
        n = len(body["choices"])
        assert n == (1 if body["object"] == "chat.completion" else 2)


def test_sigterm_stops_cleanly(batch_model, tmp_path):
    lines = [completion_line(f"t{i}", "w10 w11", max_tokens=20, ignore_eos=True) for i in range(60)]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(inp, lines)
    args = [
        sys.executable,
        "-m",
        "overnight",
        "run-batch",
        "-i",
        str(inp),
        "-o",
        str(out),
        *engine_flags(batch_model, max_num_seqs=2),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(args, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while count_lines(out) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err.decode()[-2000:]
    assert b"run-batch interrupted" in err
    done = [json.loads(x) for x in out.read_bytes().splitlines()]
    assert 3 <= len(done) < 60 and out.read_bytes().endswith(b"\n")
