"""When finished lines may be written: at once (--order completion), or in input order (--order input).

In input order a finished line waits until every line started before it is written. The lines started
but not yet written are bounded by `window`: when a slow line at the head holds the window full, no new
line is started until it finishes, so memory stays bounded whatever the file holds.
"""

from __future__ import annotations

from typing import Any

ORDERS = ("input", "completion")


class OutputOrder:
    def __init__(self, order: str, window: int) -> None:
        if order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
        if window < 1:
            raise ValueError("the reorder window must hold at least one line")
        self.in_input_order = order == "input"
        self.window = window
        self._next_seq = 0  # the sequence number the next started line gets
        self._next_write = 0  # input order: the oldest line not yet written
        self._done: dict[int, dict[str, Any]] = {}  # finished, waiting for earlier lines
        self._open = 0  # started, not yet written

    def start(self) -> int:
        """Sequence number of a newly started line."""
        seq = self._next_seq
        self._next_seq += 1
        self._open += 1
        return seq

    @property
    def has_room(self) -> bool:
        return self._open < self.window

    @property
    def num_open(self) -> int:
        return self._open

    def finish(self, seq: int, record: dict[str, Any]) -> list[dict[str, Any]]:
        """The records that can be written now, in the order to write them."""
        if not self.in_input_order:
            self._open -= 1
            return [record]
        self._done[seq] = record
        ready = []
        while self._next_write in self._done:
            ready.append(self._done.pop(self._next_write))
            self._next_write += 1
        self._open -= len(ready)
        return ready

    def drain(self) -> list[dict[str, Any]]:
        """Everything finished but still held back, in input order (for an interrupted run: a finished
        line written out of order is better than one computed again on resume)."""
        ready = [self._done.pop(seq) for seq in sorted(self._done)]
        self._open -= len(ready)
        return ready
