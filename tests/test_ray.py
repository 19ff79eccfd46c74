"""Ray on a local 2-CPU cluster: 200 rows over 2 engine actors give one engine's outputs, and an actor
killed mid-run has its rows run again, none lost, none twice. Skipped when ray[data] is not installed."""

from __future__ import annotations

import os
import signal
import time

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

from overnight.entrypoints.llm import LLM  # noqa: E402
from overnight.parallel.ray import generate_dataset  # noqa: E402
from overnight.sampling_params import SamplingParams  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_ROWS = 200
MAX_TOKENS = 4
WORDS = ["river", "mountain", "engine", "garden", "winter", "library", "signal", "harbor"]


def prompt(i: int) -> str:
    return f"Item {i}: a short note about the {WORDS[i % len(WORDS)]}"


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


@pytest.fixture(scope="module")
def reference() -> dict[int, list]:
    outs = LLM(device="cpu").generate(
        [prompt(i) for i in range(NUM_ROWS)],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
        use_tqdm=False,
    )
    return {i: o.outputs[0].text for i, o in enumerate(outs)}


def _dataset():
    return ray.data.from_items(
        [{"index": i, "prompt": prompt(i)} for i in range(NUM_ROWS)], override_num_blocks=10
    )


def _run(on_first_row=None) -> list[dict]:
    ds = generate_dataset(
        _dataset(),
        num_replicas=2,
        batch_size=20,
        sampling_params={"temperature": 0, "max_tokens": MAX_TOKENS},
        device="cpu",
    )
    rows = []
    for row in ds.iter_rows():
        if not rows and on_first_row is not None:
            on_first_row()
        rows.append(row)
    return rows


def _check(rows: list[dict], reference: dict[int, str]) -> None:
    indices = sorted(int(r["index"]) for r in rows)
    assert indices == list(range(NUM_ROWS)), "a row was lost or came out twice"
    for r in rows:
        assert r["error"] is None
        assert r["generated_text"] == reference[int(r["index"])]
        assert r["num_generated_tokens"] == MAX_TOKENS or r["finish_reason"] == "stop"


def test_two_actors_match_one_engine(cluster, reference):
    _check(_run(), reference)


def _engine_actor_pids() -> list[int]:
    import psutil

    return [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if any("MapBatches(EngineActor)" in part for part in (p.info["cmdline"] or []))
    ]


def test_killed_actor_rows_run_again(cluster, reference):
    killed: list[int] = []

    def kill_one() -> None:
        deadline = time.monotonic() + 30
        while not (pids := _engine_actor_pids()) and time.monotonic() < deadline:
            time.sleep(0.2)
        os.kill(pids[0], signal.SIGKILL)
        killed.append(pids[0])

    rows = _run(on_first_row=kill_one)
    assert killed
    _check(rows, reference)
