"""Default batch limits (max_num_seqs, max_num_batched_tokens) by device memory and by how the engine runs.

The starting point is the table users know (shared docs: anchors), with one deliberate change: batch
jobs (run-batch) get the offline class's large budget, not the smallest one, because a batch job is
exactly the case that wants throughput.
"""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("offline", "server", "batch")


@dataclass(frozen=True)
class Limits:
    max_num_seqs: int
    max_num_batched_tokens: int
    row: str  # which table row applied, for `overnight budget`


# (min device GiB, offline, server); a batch job uses the offline column. Values: (batched tokens, seqs).
_TABLE: list[tuple[float, str, tuple[int, int], tuple[int, int]]] = [
    (160.0, ">= 160 GiB", (16384, 1024), (16384, 1024)),
    (70.0, ">= 70 GiB (H100, H200)", (16384, 1024), (8192, 1024)),
    (0.0, "< 70 GiB (A100-40G, L40S, L4)", (8192, 256), (2048, 256)),
]
_CPU = ("CPU", (4096, 256), (2048, 128))


def default_limits(device_memory_gib: float | None, mode: str, max_model_len: int) -> Limits:
    """device_memory_gib None means a CPU-only run."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if device_memory_gib is None:
        row, offline, server = _CPU
    else:
        row, offline, server = next(
            (r, o, s) for gib, r, o, s in _TABLE if device_memory_gib >= gib
        )
    tokens, seqs = server if mode == "server" else offline
    tokens = min(seqs * max_model_len, tokens)
    seqs = min(seqs, tokens)
    return Limits(max_num_seqs=seqs, max_num_batched_tokens=tokens, row=row)
