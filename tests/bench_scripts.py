"""Loading a bench/ script as a module in a test, so its GPU run can be rehearsed on the CPU (its device,
dtype, shapes and timer patched by the test)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

BENCH_DIR = Path(__file__).resolve().parents[1] / "bench"


def load_bench_script(monkeypatch: pytest.MonkeyPatch, filename: str) -> ModuleType:
    """bench/<filename> executed as a module of its own name, registered in sys.modules for the test only
    (dataclasses and pickling look a module up there)."""
    name = Path(filename).stem
    spec = importlib.util.spec_from_file_location(name, BENCH_DIR / filename)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


def fake_graph_time(period: int) -> Callable[..., float]:
    """A stand-in for bench/gpu_timing.py's graph_time on the CPU: it runs each call once (so every
    variant a bench times is exercised) and returns times that cycle with the count of timings, so the
    bench's winners and ratios vary."""
    timed: list[int] = []

    def fake(calls, replays: int = 10) -> float:
        for call in calls:
            call()
        timed.append(len(calls))
        return 10.0 + len(timed) % period

    return fake
