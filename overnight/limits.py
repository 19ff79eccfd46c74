"""Default batch limits (max_num_seqs, max_num_batched_tokens) by device memory and by how the engine runs.

The starting point is the table users know (shared docs: anchors), with deliberate changes for batch
jobs (run-batch): they get at least the offline class's large budget, not the smallest one, because a
batch job is exactly the case that wants throughput. On GPUs of 70 GiB or more a batch job gets twice
the offline class's token budget: on an H200 with Qwen3-8B, seed-512-256 ran at 10,481 output tok/s with
32,768 tokens a step against 9,848 with 16,384 (+6%, SM clock 1515 vs 1530 MHz; `overnight bench
throughput --workload seed-512-256 --max-num-batched-tokens N`).

The server keeps the 8,192 users know: in a steady state of N clients a step computes N decodes plus the
prompts of the requests that just finished (~3,000 tokens at 1,024 clients of 512 in / 256 out), so the
budget binds only while a burst of arrivals waits, where a larger one would stretch every running
stream's inter-token latency. The sweep reports tokens per step per level to check it.
"""

from __future__ import annotations

from dataclasses import dataclass

from overnight.options import MODES


@dataclass(frozen=True)
class Limits:
    max_num_seqs: int
    max_num_batched_tokens: int
    row: str  # which table row applied, for `overnight budget`


# (min device GiB, row, offline, server, batch). Values: (batched tokens, seqs).
_TABLE: list[tuple[float, str, tuple[int, int], tuple[int, int], tuple[int, int]]] = [
    (160.0, ">= 160 GiB", (16384, 1024), (16384, 1024), (32768, 1024)),
    (70.0, ">= 70 GiB (H100, H200)", (16384, 1024), (8192, 1024), (32768, 1024)),
    (0.0, "< 70 GiB (A100-40G, L40S, L4)", (8192, 256), (2048, 256), (8192, 256)),
]
_CPU = ("CPU", (4096, 256), (2048, 128), (4096, 256))


def default_limits(device_memory_gib: float | None, mode: str, max_model_len: int) -> Limits:
    """device_memory_gib None means a CPU-only run."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if device_memory_gib is None:
        row, offline, server, batch = _CPU
    else:
        row, offline, server, batch = next(
            (r, o, s, b) for gib, r, o, s, b in _TABLE if device_memory_gib >= gib
        )
    tokens, seqs = {"offline": offline, "server": server, "batch": batch}[mode]
    tokens = min(seqs * max_model_len, tokens)
    seqs = min(seqs, tokens)
    return Limits(max_num_seqs=seqs, max_num_batched_tokens=tokens, row=row)
