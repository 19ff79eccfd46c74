"""The order in which a job's requests are handed to the engine, when the job knows them ahead.

The engine admits requests in the order they arrive, so the order of submission is the schedule. A batch
job (run-batch, LLM.generate on a list) knows its input ahead, and two facts about it pay:

- Requests that share a long prompt prefix (a system prompt) are cheap together: the first computes the
  prefix, the rest find it in the prefix cache. Spread through the input, each group's prefix is evicted
  between its members once the pool cannot hold every group's prefix beside the running batch, and it
  is computed again; and every group in the running batch pins its own copy of the prefix in the pool,
  which leaves room for fewer running requests.
- The end of a job runs with a nearly empty batch while the last long answers finish. Starting the
  longest requests first leaves short ones for the end.

`fifo` submits in input order. `lookahead` reads up to `window` requests ahead of the engine and picks
from them:

    steady state   the request sharing the most leading KV blocks with the last one submitted
                   (requests are kept sorted by their blocks' chained hashes: a walk of the prefix tree,
                   so a group goes in together and then the walk moves on to the next group)
    input read     longest expected output first (max_tokens, or what max_model_len leaves after the
    to its end     prompt, in powers of two so that equal budgets stay grouped), then the same walk

The first request of a new shared prefix goes alone: the rest of its group follows once the engine
has admitted it (its waiting queue, where the first request was last, is empty) and taken one more
step, so the prefix is computed and in the prefix cache (the engine registers a block after the step
that computed it; one that runs a step ahead schedules the next step before that). Submitted together,
the whole group would be admitted in one step and compute the prefix once each.

Bound: a request waits at most until 2 x window later requests have been read; then it goes first,
so a group that keeps growing cannot starve a request with a prefix of its own.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from overnight.engine.block_pool import hash_block
from overnight.errors import ConfigError
from overnight.options import SCHEDULES

# Holding back costs nothing while requests wait in the engine's queue (the engine has work); the bound
# only keeps a queue that never empties (stale counts of a remote engine) from holding a group for ever.
MAX_HOLD_STEPS = 256
# Blocks hashed per prompt for its key: enough to tell apart prefixes of 2,048 tokens (block size 16),
# and a bound on the hashing a very long prompt costs.
MAX_KEY_BLOCKS = 128

Key = tuple[int, ...]


class SubmissionOrder(Protocol):
    """Requests go in with add() while has_room; pop() names the next one to submit."""

    @property
    def has_room(self) -> bool: ...

    def add(self, seq: int, prompt: Sequence[int], max_output: int, root: int | None = None) -> None:
        """A request, by a number of the caller's (unique, increasing in input order); its first prompt
        and the most tokens it may generate; root: its LoRA adapter's hash root (prefix_key)."""

    def close(self) -> None:
        """No more requests will be added: the input is read to its end."""

    def pop(self) -> int | None:
        """The next request to submit, or None when none is waiting or none should go yet."""

    def on_step(self, num_waiting: int) -> None:
        """The engine took a step (or has nothing to run); num_waiting requests wait in its queue."""

    def __len__(self) -> int: ...


def check_schedule(schedule: str, window: int) -> None:
    if schedule not in SCHEDULES:
        raise ConfigError(f"schedule must be one of {', '.join(SCHEDULES)}, not {schedule!r}")
    if window < 1:
        raise ConfigError(f"the look-ahead window must hold at least one request, not {window}")


def make_order(schedule: str, window: int, block_size: int) -> SubmissionOrder:
    check_schedule(schedule, window)
    return FifoOrder() if schedule == "fifo" else LookaheadOrder(window, block_size)


def max_output_tokens(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> int:
    room = max_model_len - num_prompt_tokens
    return max(min(room, max_tokens) if max_tokens is not None else room, 1)


class FifoOrder:
    """Input order, one request read ahead."""

    def __init__(self) -> None:
        self._queue: deque[int] = deque()

    @property
    def has_room(self) -> bool:
        return not self._queue

    def add(self, seq: int, prompt: Sequence[int], max_output: int, root: int | None = None) -> None:
        self._queue.append(seq)

    def close(self) -> None:
        pass

    def pop(self) -> int | None:
        return self._queue.popleft() if self._queue else None

    def on_step(self, num_waiting: int) -> None:
        pass

    def __len__(self) -> int:
        return len(self._queue)


def prefix_key(prompt: Sequence[int], block_size: int, root: int | None = None) -> Key:
    """The chained hashes of the prompt's leading full blocks: the prefix cache's own keys, so two
    prompts share a key's first k entries exactly when they share their first k blocks (root: where
    the chain starts, a LoRA adapter's, lora.request.hash_root)."""
    hashes: list[int] = []
    parent = root
    for i in range(min(len(prompt) // block_size, MAX_KEY_BLOCKS)):
        parent = hash_block(parent, tuple(prompt[i * block_size : (i + 1) * block_size]))
        hashes.append(parent)
    return tuple(hashes)


def shared_blocks(a: Key, b: Key) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass(slots=True)
class _Waiting:
    key: Key
    bucket: int  # expected length class: bit length of the output budget
    arrival: int  # how many requests had been added before this one


class LookaheadOrder:
    def __init__(self, window: int, block_size: int) -> None:
        check_schedule("lookahead", window)
        self.window = window
        self.block_size = block_size
        self.max_lag = 2 * window
        self._waiting: OrderedDict[int, _Waiting] = OrderedDict()  # input order: the oldest first
        self._sorted: list[tuple[Key, int]] = []  # (key, seq) of every waiting request
        self._cursor: tuple[Key, int] | None = None  # the last request submitted
        self._num_added = 0
        self._tail: list[int] | None = None  # once closed: the rest, last to submit first
        # Holding back a group behind its first request: steps left at most, and whether the engine
        # has admitted that request yet.
        self._hold = 0
        self._admitted = False

    @property
    def has_room(self) -> bool:
        return self._tail is None and len(self._waiting) < self.window

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, seq: int, prompt: Sequence[int], max_output: int, root: int | None = None) -> None:
        if self._tail is not None:
            raise RuntimeError("add() after close()")
        key = prefix_key(prompt, self.block_size, root)
        self._waiting[seq] = _Waiting(key, max(max_output, 1).bit_length(), self._num_added)
        self._num_added += 1
        bisect.insort(self._sorted, (key, seq))

    def close(self) -> None:
        if self._tail is not None:
            return
        cursor = self._cursor[0] if self._cursor is not None else ()

        def rank(seq: int) -> tuple[int, bool, Key, int]:
            w = self._waiting[seq]
            # Longest first; within a length class the walk goes on from where it was.
            return (-w.bucket, w.key < cursor, w.key, seq)

        self._tail = sorted(self._waiting, key=rank, reverse=True)
        self._sorted = []

    def pop(self) -> int | None:
        if not self._waiting or self._hold:
            return None
        if self._tail is not None:
            seq = self._tail.pop()
            entry = (self._waiting.pop(seq).key, seq)
            follower = self._waiting[self._tail[-1]].key if self._tail else None
        else:
            oldest, w = next(iter(self._waiting.items()))
            if self._num_added - w.arrival >= self.max_lag:  # overdue: goes now, the walk stays put
                del self._sorted[bisect.bisect_left(self._sorted, (w.key, oldest))]
                del self._waiting[oldest]
                return oldest
            i = self._nearest()
            entry = self._sorted.pop(i)
            del self._waiting[entry[1]]
            follower = None
            if self._sorted:
                previous, self._cursor = self._cursor, entry
                follower = self._sorted[self._nearest()][0]
                self._cursor = previous
        # A new shared prefix starts: its first request goes alone.
        before = shared_blocks(self._cursor[0], entry[0]) if self._cursor is not None else 0
        if follower is not None and shared_blocks(entry[0], follower) > before:
            self._hold, self._admitted = MAX_HOLD_STEPS, False
        self._cursor = entry
        return entry[1]

    def on_step(self, num_waiting: int) -> None:
        if not self._hold:
            return
        if self._admitted:  # the step after the one that admitted it: the prefix is cached
            self._hold = 0
        else:
            self._admitted = num_waiting == 0
            self._hold -= 1

    def _nearest(self) -> int:
        """Index in _sorted of the request sharing the most blocks with the cursor: one of the two
        beside the cursor's place in the order (the one after it on a tie, so the walk moves on)."""
        if self._cursor is None:
            return 0
        n = len(self._sorted)
        i = bisect.bisect_left(self._sorted, self._cursor)
        after = i if i < n else 0  # past the end the walk starts over
        before = i - 1 if i > 0 else n - 1
        key = self._cursor[0]
        if shared_blocks(self._sorted[before][0], key) > shared_blocks(self._sorted[after][0], key):
            return before
        return after
