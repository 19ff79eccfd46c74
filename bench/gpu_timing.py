"""Timing as the engine runs kernels: captured in a CUDA graph (no Python launch cost between them),
median of the graph's replays. Shared by the kernel-variant benches (bench/w4a16_variants_gpu.py,
bench/mxfp4_moe_gpu.py, bench/moe_gpu.py's layer and routing tables); their CPU tests replace
graph_time with a fake timer."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def graph_time(calls: list[Callable[[], object]], replays: int = 10) -> float:
    """Microseconds per call: all of `calls` captured back to back in one CUDA graph, median replay.
    Each call runs once first on a side stream, so Triton compiles and autotunes outside the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm outside the capture
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    torch.cuda.synchronize()
    return statistics.median(times) * 1e3 / len(calls)
