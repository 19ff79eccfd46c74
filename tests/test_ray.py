"""Ray on a local 2-CPU cluster (object store capped), with the tiny batch model of tests/batch_helpers.py:

- generate_dataset: 200 rows over 2 engine actors give one engine's outputs;
- run-batch --ray: a 200-line file over 2 replicas, one of them killed mid-run, gives the file one
  engine gives: every line once, in input order, the same texts.

Skipped (but the install message is checked) when ray[data] is not installed.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest

from overnight.entrypoints.llm import LLM
from overnight.ray import generate_dataset, require_ray
from overnight.sampling_params import SamplingParams
from tests.batch_helpers import (
    MAX_MODEL_LEN,
    WORDS,
    engine_flags,
    expected_texts,
    make_batch_model,
    mixed_lines,
    read_jsonl,
    run_cli,
    write_jsonl,
)

pytestmark = pytest.mark.slow  # starts a Ray cluster

try:
    import psutil
    import ray
    import ray.data
except ImportError:
    ray = None

needs_ray = pytest.mark.skipif(ray is None, reason="ray[data] and psutil are not installed")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_ROWS = 200
ENGINE = dict(
    max_model_len=MAX_MODEL_LEN,
    max_num_seqs=16,
    kv_cache_memory_bytes=8 << 20,
    device="cpu",
    dtype="float32",
    attention_backend="torch",
)


def test_without_ray_the_message_says_how_to_install(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'overnight\[ray\]'"):
        require_ray()
    write_jsonl(tmp_path / "in.jsonl", mixed_lines(1))
    assert run_cli(["-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--ray"]) == 2
    assert "pip install 'overnight[ray]'" in capsys.readouterr().err


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return make_batch_model(tmp_path_factory.mktemp("ray-model"))


@pytest.fixture(scope="module")
def cluster():
    env = {
        "PYTHONPATH": ROOT,  # the actors import overnight from this checkout
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    ray.init(
        num_cpus=2,
        object_store_memory=96 * 2**20,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": env},
    )
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()


def prompt(i: int) -> str:
    return " ".join(WORDS[(i * 7 + k * 13) % len(WORDS)] for k in range(1 + i % 9))


@needs_ray
def test_generate_dataset_over_two_actors_matches_one_engine(cluster, model):
    params = {"temperature": 0, "max_tokens": 6}
    want = LLM(model, **ENGINE).generate(
        [prompt(i) for i in range(NUM_ROWS)], SamplingParams(**params), use_tqdm=False
    )
    ds = ray.data.from_items(
        [{"index": i, "prompt": prompt(i)} for i in range(NUM_ROWS)], override_num_blocks=10
    )
    rows = generate_dataset(
        ds, model=model, num_replicas=2, batch_size=20, sampling_params=params, **ENGINE
    ).take_all()
    assert sorted(int(r["index"]) for r in rows) == list(range(NUM_ROWS))
    for r in rows:
        out = want[int(r["index"])]
        assert r["error"] is None
        assert r["generated_text"] == out.outputs[0].text
        assert r["num_prompt_tokens"] == len(out.prompt_token_ids)
        assert r["num_generated_tokens"] == len(out.outputs[0].token_ids)
        assert r["finish_reason"] == out.outputs[0].finish_reason


def _replica_pids() -> list[int]:
    return [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if any("EngineServer" in part for part in (p.info["cmdline"] or []))
    ]


def _count_lines(path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:  # not yet written, or the spill removed at the end
        return 0


def _kill_a_replica_when(output, num_lines: int, killed: list[int], stop: threading.Event) -> None:
    """Once num_lines lines have finished, SIGKILL one replica's process. Finished lines are in the
    output or, while an earlier line still runs, in its spill (--order input keeps input order)."""
    spill = output.with_name(output.name + ".spill")
    while not stop.is_set():
        lines = sum(_count_lines(f) for f in (output, spill))
        pids = _replica_pids()
        if lines >= num_lines and pids:
            os.kill(pids[0], signal.SIGKILL)
            killed.append(pids[0])
            return
        time.sleep(0.05)


@needs_ray
def test_run_batch_ray_survives_a_killed_replica(cluster, model, tmp_path):
    lines = mixed_lines(NUM_ROWS, seed=3)
    write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    killed: list[int] = []
    stop = threading.Event()
    killer = threading.Thread(target=_kill_a_replica_when, args=(out, 40, killed, stop), daemon=True)
    killer.start()
    try:
        code = run_cli(
            [
                "-i",
                str(tmp_path / "in.jsonl"),
                "-o",
                str(out),
                *engine_flags(model),
                "--ray",
                "--num-replicas",
                "2",
            ]
        )
    finally:
        stop.set()
        killer.join()
    assert code == 0
    assert killed, "no replica was killed: the run ended before 40 lines were written?"
    results = read_jsonl(out)
    assert [r["custom_id"] for r in results] == [line["custom_id"] for line in lines]  # once each, in order
    expected = expected_texts(model, lines)
    for r in results:
        assert r["error"] is None, r
        choices = r["response"]["body"]["choices"]
        texts = [c["message"]["content"] if "message" in c else c["text"] for c in choices]
        assert texts == expected[r["custom_id"]], r["custom_id"]
