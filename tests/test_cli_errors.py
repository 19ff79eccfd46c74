"""What a new user types first, through `python -m overnight` in a subprocess: every ordinary
mistake is one line on stderr and exit status 2, never a traceback; `serve MODEL` and
--trust-remote-code are accepted as vLLM users type them; a model too large for the machine stops
before a weight is allocated."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from overnight.server.background import BackgroundServer
from overnight.server.cli import ServerOptions, make_app
from tests.engine_helpers import slow_engine

pytestmark = pytest.mark.slow  # a Python process (torch import) per command

REPO = Path(__file__).resolve().parents[1]
DEAD_URL = "http://127.0.0.1:9"  # the discard port: nothing listens there


def overnight(*args: str, code: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m overnight ARGS`, or `python -c CODE` (which then calls the CLI itself)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-c", code] if code else [sys.executable, "-m", "overnight", *args]
    return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(proc: subprocess.CompletedProcess, command: str, *needles: str) -> str:
    """Exit status 2, no traceback, and a last stderr line 'overnight COMMAND: ...' holding each needle."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"overnight {command}: "), last
    for needle in needles:
        assert needle in last, (needle, last)
    return last


@pytest.mark.parametrize(
    "command",
    [["serve"], ["generate", "hello"], ["budget"], ["run-batch", "-i", "README.md", "-o", "-"]],
    ids=["serve", "generate", "budget", "run-batch"],
)
def test_a_missing_model_is_one_line(command):
    proc = overnight(*command, "--model", "/no/such/model")
    assert_one_line_error(proc, command[0], "model not found", "/no/such/model")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_is_one_line():
    proc = overnight("generate", "hello", "--device", "cuda")
    assert_one_line_error(proc, "generate", "no CUDA GPU", "--device cpu")


def test_tensor_parallel_that_does_not_divide_the_heads_is_one_line():
    proc = overnight("budget", "--model", "qwen3-8b", "--load-format", "dummy", "-tp", "3")
    assert_one_line_error(proc, "budget", "tensor_parallel_size 3", "num_attention_heads 32")


def test_check_and_sweep_against_no_server_are_one_line(tmp_path):
    proc = overnight("check", "--url", DEAD_URL, "--window-s", "0.2")
    assert_one_line_error(proc, "check", "no server answers at", DEAD_URL, "overnight serve")
    proc = overnight("bench", "sweep", "--url", DEAD_URL, "--out", str(tmp_path / "sweep"))
    assert_one_line_error(proc, "bench", "no server answers at", DEAD_URL)


def test_check_and_sweep_against_a_server_that_wants_a_key_are_one_line(tmp_path):
    opts = ServerOptions(api_key="sesame", protect_metrics=True)
    with BackgroundServer(make_app(slow_engine(), opts)) as server:
        proc = overnight("check", "--url", server.url, "--window-s", "0.2")
        assert_one_line_error(proc, "check", "wants an API key", "--api-key")
        proc = overnight("check", "--url", server.url, "--window-s", "0.2", "--api-key", "wrong")
        assert_one_line_error(proc, "check", "refused the API key")
        proc = overnight("bench", "sweep", "--url", server.url, "--out", str(tmp_path / "sweep"))
        assert_one_line_error(proc, "bench", "wants an API key")
        # With the key, check reads the window (the server is idle).
        proc = overnight("check", "--url", server.url, "--window-s", "0.3", "--api-key", "sesame", "--json")
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert json.loads(proc.stdout)["findings"][0]["limit"] == "idle"


def test_serve_takes_the_model_as_a_positional_argument():
    # Before: "unrecognized arguments". Now the positional is the model, and a missing one says so.
    proc = overnight("serve", "/no/such/positional-model")
    assert_one_line_error(proc, "serve", "model not found", "/no/such/positional-model")
    proc = overnight("serve", "/no/a", "--model", "/no/b")
    assert_one_line_error(proc, "serve", "two models given")


def test_trust_remote_code_is_accepted_and_an_unknown_architecture_is_one_line(tmp_path):
    folder = tmp_path / "foo-model"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps({"architectures": ["FooForCausalLM"], "model_type": "foo", "vocab_size": 10})
    )
    (folder / "model.safetensors").write_bytes(b"")
    proc = overnight("budget", "--model", str(folder), "--trust-remote-code")
    assert_one_line_error(
        proc, "budget", "unsupported model architecture 'FooForCausalLM'", "trust_remote_code"
    )


def test_a_model_too_large_for_the_machine_stops_before_loading():
    """`overnight bench throughput --workload seed-512-256` on a CPU machine: Qwen3-8B in float32 is 30.5
    GiB. The machine's free memory is faked to 8 GiB (the one function that reads it), so the check is
    the same on any machine; the weights must never start loading."""
    code = (
        "import sys, overnight.loader.fit as fit, overnight.loader.model_loader as ml\n"
        "fit.available_memory_bytes = lambda device: 8 * 2**30\n"
        "def no_load(*a, **k): raise SystemExit('the weights started loading')\n"
        "ml.load_model = no_load\n"
        "from overnight.cli import main\n"
        "sys.exit(main(['bench', 'throughput', '--workload', 'seed-512-256', '--device', 'cpu']))\n"
    )
    proc = overnight(code=code)
    last = assert_one_line_error(
        proc, "bench", "qwen3-8b does not fit", "30.5 GiB in float32", "8.0 GiB free"
    )
    assert "--dtype bfloat16 (15.3 GiB)" not in last  # 15.3 GiB does not fit in 8 either
    assert "a smaller model" in last


def test_a_second_run_batch_on_the_same_output_is_refused(tmp_path):
    """The lock is taken before the model loads: the refusal is immediate (the model named here does
    not even exist, and it is never looked at)."""
    from overnight.batch.output import lock_output

    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(
        '{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}\n'
    )
    held = lock_output(str(out))  # the first run
    try:
        proc = overnight("run-batch", "-i", str(inp), "-o", str(out), "--model", "/no/such/model")
        assert_one_line_error(proc, "run-batch", "being written by another run-batch", str(out))
    finally:
        held.close()
    proc = overnight("run-batch", "-i", str(inp), "-o", str(out), "--model", "/no/such/model")
    assert_one_line_error(proc, "run-batch", "model not found")  # no lock left: it gets that far


def test_sweep_against_a_server_that_is_not_openai_is_one_line(tmp_path):
    """Before: KeyError: 'data' from server_info."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def models(request):
        return JSONResponse({"object": "list"})

    app = Starlette(routes=[Route("/v1/models", models)])
    with BackgroundServer(app) as server:
        proc = overnight("bench", "sweep", "--url", server.url, "--out", str(tmp_path / "sweep"))
        assert_one_line_error(proc, "bench", "lists no model", "OpenAI-compatible")
