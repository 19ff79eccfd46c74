"""The sweep's load processes: they end with their parent however it ends (SIGKILL leaves them no
clean-up, SIGTERM runs it), and the loop-lag monitor sees a client that falls behind."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from overnight.bench.load import LoadSpec, LocalControl, Workload, _watch_lag

# A parent that runs a closed-loop load of 8 clients in 2 spawned processes against a port that refuses
# (the clients retry every 50 ms, as against a server that went away), prints the load processes' ids
# and waits for a signal.
PARENT = textwrap.dedent(
    """
    import asyncio, multiprocessing as mp, sys
    from overnight.bench.load import LoadSpec, Workload, run_async, run_load
    from overnight.bench.sweep import exit_on_sigterm

    async def controller(control):
        print(" ".join(str(p.pid) for p in mp.active_children()), flush=True)
        await asyncio.sleep(120)

    spec = LoadSpec("http://127.0.0.1:9", "m", Workload(input_len=4, output_len=4), concurrency=8)
    if sys.argv[1] == "handled":
        with exit_on_sigterm():
            run_async(run_load(spec, 2, controller))
    else:
        run_async(run_load(spec, 2, controller))
    """
)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def start_parent(mode: str) -> tuple[subprocess.Popen, list[int]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", PARENT, mode], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # once both load processes are connected and the load started
    pids = [int(p) for p in line.split()]
    assert len(pids) == 2 and all(alive(p) for p in pids), line
    return proc, pids


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


@pytest.mark.slow
def test_load_processes_end_when_their_parent_is_killed():
    # On the H200 a sweep cut by a timeout left load processes that went on sending requests.
    proc, pids = start_parent("plain")
    try:
        proc.kill()  # SIGKILL: no clean-up in the parent at all
        proc.wait(timeout=10)
        assert wait_gone(pids, 10.0) == []
    finally:
        for p in pids:
            if alive(p):
                os.kill(p, signal.SIGKILL)


@pytest.mark.slow
def test_a_sigterm_ends_the_sweep_through_its_clean_up():
    proc, pids = start_parent("handled")
    try:
        proc.send_signal(signal.SIGTERM)  # to the parent alone, as `kill <pid>` sends it
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM  # SystemExit from the handler, not death
        assert wait_gone(pids, 10.0) == []
    finally:
        for p in [proc.pid, *pids]:
            if alive(p):
                os.kill(p, signal.SIGKILL)


def test_the_sigterm_handler_is_undone_on_the_way_out():
    from overnight.bench.sweep import exit_on_sigterm

    before = signal.getsignal(signal.SIGTERM)
    with exit_on_sigterm():
        assert signal.getsignal(signal.SIGTERM) is not before
    assert signal.getsignal(signal.SIGTERM) is before


def test_the_lag_monitor_sees_a_blocked_loop():
    spec = LoadSpec("http://x", "m", Workload(), concurrency=1)
    control = LocalControl(1)

    async def run() -> tuple[tuple, tuple]:
        task = asyncio.create_task(_watch_lag(spec, control))
        await asyncio.sleep(0.3)
        quiet = control.take_lag()
        time.sleep(0.4)  # a client busy parsing more streams than it can: its loop runs nothing else
        await asyncio.sleep(0.1)
        busy = control.take_lag()
        task.cancel()
        return quiet, busy

    (quiet_mean, quiet_max), (busy_mean, busy_max) = asyncio.run(run())
    assert quiet_mean is not None and busy_mean is not None and quiet_max is not None
    assert busy_max >= 0.3 > quiet_max
    assert busy_mean > quiet_mean
    assert control.take_lag() == (None, None)  # taken: the count starts again
