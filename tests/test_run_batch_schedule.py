"""run-batch's look-ahead on a file whose lines share 8 long system prompts interleaved at random, with
a KV pool too small to keep every prompt's prefix beside the running batch: the prefix cache hits far
more often with look-ahead than in file order, and the greedy outputs are the same."""

from __future__ import annotations

import json
import random

import pytest

from tests.batch_helpers import SERVED, WORDS, engine_flags, read_jsonl, run_cli, write_jsonl

pytestmark = pytest.mark.slow  # runs the real model over batch files and kills processes

NUM_SYSTEMS = 8
SYSTEM_WORDS = 62  # with "<|system|>": 4 full blocks of 16 tokens shared by a system prompt's lines
POOL_BLOCKS = 24  # 8 prefixes need 32 blocks; 4 running requests need about 24
BLOCK_BYTES = 16 * 2 * 2 * 2 * 16 * 4  # block x layers x (K, V) x kv heads x head_dim x fp32


def system_prompt_lines(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    systems = [" ".join(rng.choice(WORDS) for _ in range(SYSTEM_WORDS)) for _ in range(NUM_SYSTEMS)]
    lines = []
    for i in range(n):
        messages = [
            {"role": "system", "content": systems[rng.randrange(NUM_SYSTEMS)]},
            {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8)))},
        ]
        body = {"messages": messages, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        lines.append({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
    return lines


def test_lookahead_groups_shared_prefixes_and_changes_no_output(batch_model, tmp_path):  # noqa: F811
    lines = system_prompt_lines(96)
    write_jsonl(tmp_path / "in.jsonl", lines)
    flags = engine_flags(batch_model, max_num_seqs=4)
    flags[flags.index("--kv-cache-memory-bytes") + 1] = str(POOL_BLOCKS * BLOCK_BYTES)
    results, schedule = {}, {}
    for name in ("lookahead", "fifo"):
        out, summary = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.json"
        args = ["-i", str(tmp_path / "in.jsonl"), "-o", str(out), "--schedule", name]
        assert run_cli([*args, "--summary-json", str(summary), *flags]) == 0
        results[name] = read_jsonl(out)
        s = json.loads(summary.read_text())
        assert s["ok"] == 96 and s["failed"] == 0
        schedule[name] = s["schedule"]
    ids = [line["custom_id"] for line in lines]
    for name in results:
        assert [r["custom_id"] for r in results[name]] == ids  # input order either way
    texts = {
        name: [r["response"]["body"]["choices"][0]["message"]["content"] for r in results[name]]
        for name in results
    }
    assert texts["lookahead"] == texts["fifo"]
    assert all(r["response"]["body"]["model"] == SERVED for r in results["lookahead"])

    ahead, fifo = schedule["lookahead"], schedule["fifo"]
    print(
        f"\nprefix-cache hit rate: lookahead {ahead['prefix_cache_hit_rate']:.1%}, "
        f"fifo {fifo['prefix_cache_hit_rate']:.1%}"
    )
    assert ahead["schedule"] == "lookahead" and fifo["schedule"] == "fifo"
    assert ahead["prefix_cache_hit_rate"] >= 0.75  # at most ~84%: each system prompt's first line misses
    assert ahead["prefix_cache_hit_rate"] >= fifo["prefix_cache_hit_rate"] + 0.35
    # The same prompt tokens were looked up, give or take recomputation after preemption.
    assert ahead["prefix_cache_queries"] <= fifo["prefix_cache_queries"]
    for s in (ahead, fifo):
        assert s["tail_running_below"] == 1.0
        assert 0 < s["tail_s"] <= s["engine_span_s"]
        assert set(s["time_s"]) == {"read", "tokenize", "engine", "write"}
        assert s["time_s"]["engine"] > 0 and s["time_s"]["tokenize"] > 0
    assert ahead["spilled_lines"] > 0  # lines submitted out of order finished before earlier ones
