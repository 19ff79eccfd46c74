"""`overnight serve` as users run it, in a subprocess: SIGTERM stops accepting connections, lets a short
in-flight request finish, aborts a long one after --shutdown-timeout, and exits 0. The same when the
signal reaches the whole process group (a terminal's job control, `kill -- -PGID`, a service manager
that stops every process of the unit): the engine process leaves stopping to the HTTP process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

pytestmark = pytest.mark.slow  # starts server processes

SHUTDOWN_TIMEOUT = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_stream(url: str, body: dict, first_chunk: threading.Event, result: dict) -> None:
    lines: list[str] = []
    try:
        with httpx.stream("POST", url, json=body, timeout=120) as r:
            result["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    first_chunk.set()
    except httpx.HTTPError as e:  # the connection cut under an aborted stream
        result["error"] = e
    result["lines"] = lines
    first_chunk.set()


@pytest.mark.parametrize("target", ["server", "group"])
def test_sigterm_drains_then_exits_zero(tmp_path, target):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "overnight",
            "serve",
            "--port",
            str(port),
            "--max-model-len",
            "256",
            "--shutdown-timeout",
            str(SHUTDOWN_TIMEOUT),
            "--no-access-log",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        start_new_session=True,  # its own process group, so the "group" case signals it alone
    )
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)

        started = {name: threading.Event() for name in ("short", "long")}
        results: dict[str, dict] = {"short": {}, "long": {}}
        bodies = {
            "short": {
                "prompt": "Hello",
                "max_tokens": 4,
                "ignore_eos": True,
                "stream": True,
                "temperature": 0,
            },
            "long": {"prompt": "Hello", "max_tokens": 250, "ignore_eos": True, "stream": True},
        }
        threads = [
            threading.Thread(
                target=read_stream, args=(url + "/v1/completions", bodies[n], started[n], results[n])
            )
            for n in ("short", "long")
        ]
        for t in threads:
            t.start()
        for event in started.values():
            assert event.wait(120)

        t_signal = time.monotonic()
        if target == "group":
            os.killpg(proc.pid, signal.SIGTERM)  # the server, its engine process and any other child
        else:
            proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        refused = False
        try:
            httpx.get(url + "/health", timeout=2)
        except httpx.ConnectError:
            refused = True
        assert refused, "new connections must be refused once shutdown starts"

        rc = proc.wait(timeout=SHUTDOWN_TIMEOUT + 60)
        elapsed = time.monotonic() - t_signal
        for t in threads:
            t.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()

    text = (tmp_path / "serve.log").read_text()
    assert rc == 0, text
    assert "engine thread failed" not in text and "EngineDeadError" not in text, text
    # The short request finished within the grace period: all its tokens, then [DONE].
    short = results["short"]
    assert short["status"] == 200 and "error" not in short
    assert short["lines"][-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in short["lines"][-2]
    # The long one was cut when the grace period ran out, long before its 250 tokens.
    long = results["long"]
    assert long["status"] == 200
    assert len(long["lines"]) < 250
    assert elapsed < SHUTDOWN_TIMEOUT + 30
