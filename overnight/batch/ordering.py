"""When finished lines may be written: at once (--order completion), or in input order (--order input).

Every line read gets a sequence number in input order when it is read (look-ahead may submit it much
later). In input order a finished line is written once every earlier line is; until then it waits in
the spill on disk (overnight/batch/spill.py), so however long the line at the head runs, new lines keep
starting and memory holds one (offset, length) per waiting line.
"""

from __future__ import annotations

from typing import Any

from overnight.batch.spill import Spill, SpillRef

ORDERS = ("input", "completion")


class OutputOrder:
    def __init__(self, order: str, spill: Spill | None = None) -> None:
        if order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
        self.in_input_order = order == "input"
        self.spill = spill if spill is not None else Spill(None)
        self._next_seq = 0  # the sequence number the next line read gets
        self._next_write = 0  # input order: the oldest line not yet written
        self._held: dict[int, SpillRef] = {}  # finished, in the spill, waiting for earlier lines
        self.peak_held = 0

    def start(self) -> int:
        """Sequence number of a newly read line."""
        seq = self._next_seq
        self._next_seq += 1
        return seq

    @property
    def num_held(self) -> int:
        return len(self._held)

    def finish(self, seq: int, record: dict[str, Any]) -> list[dict[str, Any]]:
        """The records that can be written now, in the order to write them."""
        if not self.in_input_order:
            return [record]
        if seq != self._next_write:
            self._hold(seq, self.spill.append(record))
            return []
        return [record] + self._advance()

    def recover(self, seq: int, custom_id: str) -> list[dict[str, Any]] | None:
        """Place the line `seq` from what an earlier run left in the spill (--resume): the records
        that can be written now, or None if the spill holds no answer for custom_id."""
        ref = self.spill.recovered.pop(custom_id, None)
        if ref is None:
            return None
        if self.in_input_order and seq != self._next_write:
            self._hold(seq, ref)  # already on disk: not appended again
            return []
        record = self.spill.read(ref)
        return [record] + (self._advance() if self.in_input_order else [])

    def _hold(self, seq: int, ref: SpillRef) -> None:
        self._held[seq] = ref
        self.peak_held = max(self.peak_held, len(self._held))

    def _advance(self) -> list[dict[str, Any]]:
        """Past the line just written: the held lines that follow it without a gap."""
        self._next_write += 1
        ready = []
        while self._next_write in self._held:
            ready.append(self.spill.read(self._held.pop(self._next_write)))
            self._next_write += 1
        return ready

    def close(self, *, completed: bool) -> list[dict[str, Any]]:
        """End the run. A durable spill keeps what still waits there for --resume; an anonymous one
        (output to stdout) gives its records back to be written out of order, since a finished line
        written out of order is better than one lost."""
        ready: list[dict[str, Any]] = []
        if not self.spill.durable:
            ready = [self.spill.read(self._held.pop(seq)) for seq in sorted(self._held)]
        live = bool(self._held or self.spill.recovered)
        self.spill.close(remove=completed or not live)
        return ready
