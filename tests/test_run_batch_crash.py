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

from tests.batch_helpers import (
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
    spill = tmp_path / "out.jsonl.spill"
    write_jsonl(inp, lines)

    def progress() -> int:  # lines finished: in the output, or waiting in the spill for an earlier one
        return count_lines(out) + count_lines(spill)

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
        before = progress()
        target = before + rng.randint(2, 18)
        proc = subprocess.Popen(args, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        while progress() < target and proc.poll() is None and time.monotonic() < deadline:
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
    assert 0 < progress() and count_lines(out) < len(lines)

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


def spill_records(path) -> list[dict]:
    """The whole lines of a spill (a kill may leave a torn last one)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    return [json.loads(x) for x in data.splitlines(keepends=True) if x.endswith(b"\n")]


def test_sigkill_while_lines_are_spilled_then_resume(batch_model, tmp_path):
    """--order input with look-ahead: lines that finish before an earlier one wait in out.jsonl.spill. Two
    runs are killed while lines wait there (the second after resuming from the first's spill), the
    third resumes to the end: every custom_id once, in input order, and the spilled answers were
    placed from the spill, not computed again."""
    rng = random.Random(11)
    lines = []
    for i in range(300):
        if i % 25 == 1:  # a long answer near the head of every stretch of the file
            lines.append(completion_line(f"r{i}", words(rng, 2), max_tokens=80, ignore_eos=True))
        else:
            lines.append(
                completion_line(f"r{i}", words(rng, 3), max_tokens=rng.randint(1, 6), ignore_eos=True)
            )
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    spill = tmp_path / "out.jsonl.spill"
    write_jsonl(inp, lines)
    flags = [*engine_flags(batch_model, max_num_seqs=2), "--lookahead-window", "16"]
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
        *flags,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    placed: dict[str, str] = {}  # custom_id -> record id, of answers waiting in the spill at a kill
    for _ in range(2):
        start = len(spill_records(spill))
        proc = subprocess.Popen(args, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        while len(spill_records(spill)) < start + 12 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proc.poll() is None, "the run ended before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        answered = {json.loads(x)["custom_id"] for x in out.read_bytes().splitlines() if x.endswith(b"}")}
        waiting = {r["custom_id"]: r["id"] for r in spill_records(spill) if r["custom_id"] not in answered}
        assert waiting, "no line waited in the spill at the kill"
        placed.update(waiting)
    with open(spill, "ab") as f:  # a kill inside write() leaves a torn last line
        f.write(b'{"id":"batch_req_torn","custom_id":"r3","response":{"status_')

    summary = tmp_path / "s.json"
    proc = run_subprocess(
        ["-i", str(inp), "-o", str(out), "--resume", "--summary-json", str(summary), *flags], timeout=300
    )
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    data = out.read_bytes()
    results = [json.loads(x) for x in data.splitlines()]  # raises on a torn line
    assert [r["custom_id"] for r in results] == [x["custom_id"] for x in lines]  # once each, in order
    assert all(r["error"] is None for r in results)
    by_id = {r["custom_id"]: r["id"] for r in results}
    assert all(by_id[cid] == rid for cid, rid in placed.items())  # placed from the spill, not recomputed
    assert json.loads(summary.read_text())["recovered_from_spill"] == len(waiting)
    assert not spill.exists()
