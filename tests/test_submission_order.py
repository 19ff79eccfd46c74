"""The submission order of a job known ahead (entrypoints/submission.py): look-ahead groups requests by
shared prompt prefix, starts the longest last ones first, never lets a request fall more than 2 x window
behind; and LLM.generate submits through it while returning outputs in input order."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from overnight.entrypoints.submission import (
    MAX_HOLD_STEPS,
    FifoOrder,
    LookaheadOrder,
    make_order,
    prefix_key,
    shared_blocks,
)
from overnight.errors import ConfigError

BS = 4  # block size of these tests


def prompt(system: int, user: int, system_blocks: int = 3, user_len: int = 5) -> list[int]:
    """system_blocks full blocks of the system prompt `system`, then a user part `user`."""
    return [1000 + 10 * system + i % 7 for i in range(system_blocks * BS)] + [
        5000 + 10 * user + i for i in range(user_len)
    ]


def drain(order) -> list[int]:
    """Pop everything, with an engine step whenever the order holds back."""
    out = []
    while len(order):
        seq = order.pop()
        if seq is None:
            order.on_step(0)
        else:
            out.append(seq)
    return out


def runs(groups: list[int]) -> int:
    """Number of maximal runs of equal values."""
    return sum(1 for i, g in enumerate(groups) if i == 0 or g != groups[i - 1])


def test_prefix_key_is_the_chained_block_hashes():
    a, b = prompt(0, 1), prompt(0, 2)
    assert len(prefix_key(a, BS)) == len(a) // BS == 4
    assert shared_blocks(prefix_key(a, BS), prefix_key(b, BS)) == 3  # the system prompt's blocks
    assert shared_blocks(prefix_key(a, BS), prefix_key(prompt(1, 1), BS)) == 0
    assert prefix_key([1, 2, 3], BS) == ()  # no full block


KEYS = """
from overnight.entrypoints.submission import prefix_key
from overnight.lora import LoRARequest
from overnight.lora.request import hash_root
root = hash_root(LoRARequest("a", 3, "/nowhere"))
print(prefix_key(list(range(12)), 4), prefix_key(list(range(12)), 4, root))
"""


def test_the_order_is_the_same_in_every_process():
    # The look-ahead order sorts by these keys, so a job's schedule repeats only if they do: hash(None)
    # (the base model's root before Python 3.12) and a str's hash change from one process to the next.
    def keys(seed: str) -> str:
        env = dict(os.environ, PYTHONHASHSEED=seed)
        return subprocess.run(
            [sys.executable, "-c", KEYS], env=env, capture_output=True, text=True, check=True
        ).stdout

    assert keys("1") == keys("2") == keys("3")


def test_steady_state_groups_by_prefix_and_submits_every_request_once():
    rng = random.Random(0)
    groups = [rng.randrange(8) for _ in range(400)]
    order = LookaheadOrder(window=64, block_size=BS)
    fifo = FifoOrder()
    submitted: list[int] = []
    it = iter(range(len(groups)))
    exhausted = False
    while True:
        while not exhausted and order.has_room:
            seq = next(it, None)
            if seq is None:
                exhausted = True
                order.close()
            else:
                order.add(seq, prompt(groups[seq], seq), max_output=16)
                fifo.add(seq, [], 16)
        if not len(order):
            break
        seq = order.pop()
        if seq is None:
            order.on_step(0)
        else:
            submitted.append(seq)
    assert sorted(submitted) == list(range(400))
    got = [groups[s] for s in submitted]
    # In file order the 8 groups change almost every line; the look-ahead changes group about once per
    # group per window's worth of lines (400 / 64 windows x 8 groups, and the tail's walk).
    assert runs(groups) > 300
    assert runs(got) < 90, runs(got)
    assert drain(fifo) == list(range(400)) and fifo.has_room


def test_no_request_falls_more_than_two_windows_behind():
    """One group keeps arriving; a lone request of another prefix every 50 lines still goes before
    2 x window later requests have been read."""
    window = 8
    order = LookaheadOrder(window, BS)
    num_added = 0
    arrival: dict[int, int] = {}
    worst = 0
    for _ in range(600):
        while order.has_room:
            group = 1 + num_added if num_added % 50 == 7 else 0
            order.add(num_added, prompt(group, num_added), 4)
            arrival[num_added] = num_added
            num_added += 1
        seq = order.pop()
        order.on_step(0)
        if seq is not None:
            worst = max(worst, num_added - arrival.pop(seq))
    assert worst <= 2 * window
    assert worst > window  # the lone ones did wait: the walk stays in the big group


def test_the_end_of_the_input_starts_the_longest_first_and_keeps_groups():
    order = LookaheadOrder(window=100, block_size=BS)
    rng = random.Random(3)
    spec = {}
    for seq in range(60):
        group, max_out = rng.randrange(4), rng.choice([8, 8, 8, 200])
        spec[seq] = (group, max_out)
        order.add(seq, prompt(group, seq), max_out)
    order.close()
    assert not order.has_room
    got = drain(order)
    assert sorted(got) == list(range(60))
    lengths = [spec[s][1] for s in got]
    assert lengths == sorted(lengths, reverse=True)  # every long one before any short one
    longs = [spec[s][0] for s in got if spec[s][1] == 200]
    shorts = [spec[s][0] for s in got if spec[s][1] == 8]
    assert runs(longs) == len(set(longs)) and runs(shorts) == len(set(shorts))  # one run per group


def test_bad_schedule_options():
    with pytest.raises(ConfigError, match="schedule must be one of"):
        make_order("sjf", 10, 16)
    with pytest.raises(ConfigError, match="at least one request"):
        make_order("lookahead", 0, 16)


def test_llm_generate_reorders_submission_and_returns_input_order(tmp_path):
    """Greedy outputs are the same with look-ahead and fifo, in input order, while the submission order
    differs (requests of one system prompt go in together)."""
    from overnight import LLM, SamplingParams
    from tests.tiny_models import make_tiny_checkpoint

    folder = make_tiny_checkpoint(tmp_path, "llama")
    rng = random.Random(5)
    systems = [[rng.randrange(10, 300) for _ in range(32)] for _ in range(4)]
    owner = [rng.randrange(4) for _ in range(40)]
    prompts = [systems[g] + [rng.randrange(10, 300) for _ in range(rng.randint(1, 9))] for g in owner]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    outputs, order = {}, {}
    for schedule in ("fifo", "lookahead"):
        llm = LLM(
            str(folder),
            device="cpu",
            dtype="float32",
            attention_backend="torch",
            max_model_len=64,
            max_num_seqs=4,
            skip_tokenizer_init=True,
            schedule=schedule,
        )
        seen: list[list[int]] = []
        add = llm.engine.add_request

        def spy(rid, ids, *a, _add=add, _seen=seen, **k):
            _seen.append(list(ids))
            _add(rid, ids, *a, **k)

        llm.engine.add_request = spy
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outputs[schedule] = [list(o.outputs[0].token_ids) for o in outs]
        assert [o.prompt_token_ids for o in outs] == prompts  # input order
        order[schedule] = [systems.index(ids[:32]) for ids in seen]
    assert outputs["lookahead"] == outputs["fifo"]
    assert order["fifo"] == owner
    assert runs(order["lookahead"]) == 4  # one run per system prompt
    with pytest.raises(ConfigError, match="schedule"):
        LLM(str(folder), device="cpu", skip_tokenizer_init=True, schedule="random")


def test_the_first_request_of_a_new_prefix_goes_alone():
    """Its group follows once the engine has admitted it (its queue is empty) and taken one more step;
    prompts that share nothing are never held back."""
    order = LookaheadOrder(window=100, block_size=BS)
    for seq in range(6):
        order.add(seq, prompt(seq % 2, seq), 8)
    order.close()
    first = order.pop()
    assert first is not None
    for waiting in (3, 1, 0):  # requests submitted before it are still being admitted, then it is
        assert order.pop() is None
        order.on_step(waiting)
    assert order.pop() is None  # admitted in the last step: its blocks are cached after the next one
    order.on_step(2)
    second = order.pop()
    assert second % 2 == first % 2  # the same group, at once after the hold
    assert order.pop() % 2 == first % 2
    stuck = LookaheadOrder(window=100, block_size=BS)  # a queue that never empties holds it a while
    for seq in range(4):
        stuck.add(seq, prompt(0, seq), 8)
    stuck.pop()
    steps = 0
    while stuck.pop() is None:
        stuck.on_step(5)
        steps += 1
    assert steps == MAX_HOLD_STEPS
    lone = LookaheadOrder(window=100, block_size=BS)
    for seq in range(5):
        lone.add(seq, [100 * seq + i for i in range(12)], 8)
    assert all(lone.pop() is not None for _ in range(5))
