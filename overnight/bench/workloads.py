"""Benchmark workloads: the same token ids every engine is given (see the peers' measurements).

For each request, with Python's random.Random(seed): n_in = randint(in_lo, in_hi), then
n_out = randint(out_lo, out_hi), then n_in ids drawn with randrange(100, vocab - 1000).
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    name: str
    model: str  # dummy preset
    num_requests: int
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    seed: int = 0

    def requests(self, vocab_size: int) -> list[tuple[list[int], int]]:
        """[(prompt token ids, output length)] in submission order."""
        rng = random.Random(self.seed)
        out = []
        for _ in range(self.num_requests):
            n_in = rng.randint(*self.input_len)
            n_out = rng.randint(*self.output_len)
            out.append(([rng.randrange(100, vocab_size - 1000) for _ in range(n_in)], n_out))
        return out


WORKLOADS = {
    w.name: w
    for w in [
        Workload("seed-512-256", "qwen3-8b", 1024, (512, 512), (256, 256)),
        Workload("nano-256", "qwen3-0.6b", 256, (100, 1024), (100, 1024)),
        Workload("long-1024-1024", "qwen3-8b", 512, (1024, 1024), (1024, 1024)),
        # The CPU check: the embedded default model, mixed lengths (continuous batching's home ground).
        Workload("cpu-64", "default", 64, (16, 192), (8, 96)),
    ]
}


def custom(
    num_requests: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int = 0
) -> Workload:
    return Workload("custom", "", num_requests, input_len, output_len, seed)
