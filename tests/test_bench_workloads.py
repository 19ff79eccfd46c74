"""The benchmark workloads' token ids: what every engine is given (overnight/bench/workloads.py)."""

from __future__ import annotations

import random

from overnight.bench.workloads import WORKLOADS, Workload, output_spread


def test_text_workload_draws_lengths_then_ids_per_request() -> None:
    """The documented draw order, which vLLM's side reproduces from the same module."""
    w = Workload("t", "", 5, (3, 9), (2, 4), seed=7)
    rng = random.Random(7)
    expected = []
    for _ in range(5):
        n_in, n_out = rng.randint(3, 9), rng.randint(2, 4)
        expected.append(([rng.randrange(100, 2000 - 1000) for _ in range(n_in)], n_out))
    assert w.requests(2000) == expected


def test_shared_prefix_workload_starts_every_prompt_with_one_system_prompt() -> None:
    w = WORKLOADS["prefix-2000-512-256"]
    reqs = w.requests(151_936)
    assert len(reqs) == 1024 and {n for _, n in reqs} == {256}
    prefix = reqs[0][0][:2000]
    assert all(len(ids) == 2512 and ids[:2000] == prefix for ids, _ in reqs)
    # The own parts differ: the prefix cache can share the 2,000 tokens and nothing after them.
    assert len({tuple(ids[2000:2016]) for ids, _ in reqs}) == 1024
    assert "2000 shared" in w.describe()


def test_output_spread_counts_distinct_tokens_where_outputs_reach():
    tokens = [[5, 6, 7], [5, 8], [9], []]
    assert output_spread(tokens, (0, 1, 2, 3)) == {"0": 2, "1": 2, "2": 1}
    assert output_spread([], (0,)) == {}
    # the default positions: early, middle and late in long-1024-1024's outputs
    long = [[i % 3] * 1024 for i in range(10)]
    assert output_spread(long) == {"0": 3, "255": 3, "511": 3, "1023": 3}
