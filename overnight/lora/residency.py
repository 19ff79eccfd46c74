"""The scheduler's side of LoRA: which adapter holds each of the max_loras device slots, and whether a
waiting request may start this step. The runner follows the loads this decides (slots.py).

Rules (in the order the scheduler asks, waiting requests in arrival order):
- A running request always continues: its adapter's slot is pinned while any running request uses it,
  so a step never holds more than max_loras distinct adapters.
- A waiting request of the base model, or of an adapter already in a slot, may start.
- A waiting request of another adapter takes a free slot, or evicts the least recently used adapter
  that no running request uses (a swap, counted).
- If every slot is pinned, that request waits, and no request behind it may start a new adapter. It
  reserves one slot (the one with the fewest running requests). The reserved slot's adapter may still
  start `grace` more requests (a batch job's interleaved adapters then run in groups, not one request
  per swap); after those, its requests arriving after the waiter wait too, so the slot drains and the
  waiter is next. Requests of other resident adapters and of the base model keep filling the batch.
  Nobody starves: the reserved slot's adapter then only has running requests left, which finish, and
  the reservation holds across steps.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from overnight.lora.request import LoRARequest


class LoRAResidency:
    def __init__(self, max_loras: int, grace: int = 0) -> None:
        self.max_loras = max_loras
        self.grace = grace
        self._grace_left = 0  # starts the reserved slot's adapter may still make
        self.occupant: list[int | None] = [None] * max_loras  # adapter id per slot
        self.slot_of: dict[int, int] = {}
        self._last_used = [0] * max_loras
        self._pins: Counter[int] = Counter()
        self._step = 0
        self._reserved: int | None = None  # slot drained for the first waiting adapter that found none
        self._reserved_for: int | None = None  # that adapter
        self._blocked = False  # this step: a request waits for a slot, later new adapters wait behind it
        self._loads: list[tuple[int, LoRARequest]] = []
        self.num_loads = 0
        self.num_swaps = 0  # loads that evicted another adapter

    def begin_step(self, running_adapters: Iterable[LoRARequest | None]) -> None:
        """Pins from the requests that continue this step (the running list, before admission)."""
        self._step += 1
        self._pins = Counter(r.lora_int_id for r in running_adapters if r is not None)
        for adapter in self._pins:
            self._last_used[self.slot_of[adapter]] = self._step
        self._blocked = False

    def can_admit(self, req: LoRARequest | None) -> bool:
        """Whether a waiting request may start now (see the module's rules). Changes nothing but the
        step's blocked state: admit() commits once the request really starts (it may still find no
        KV blocks)."""
        if req is None:
            return True
        slot = self.slot_of.get(req.lora_int_id)
        if slot is not None:
            return not (self._blocked and slot == self._reserved and self._grace_left <= 0)
        if self._blocked:
            return False  # an earlier request waits for a slot: it goes first
        if self._free_slot() is not None:
            return True
        self._blocked = True
        if self._reserved is None:
            pins, last = self._pins, self._last_used
            self._reserved = min(range(self.max_loras), key=lambda s: (pins[self.occupant[s] or 0], last[s]))
            self._reserved_for = req.lora_int_id
            self._grace_left = self.grace
        return False

    def admit(self, req: LoRARequest | None) -> None:
        if req is None:
            return
        aid = req.lora_int_id
        slot = self.slot_of.get(aid)
        if slot is None:
            slot = self._free_slot()
            assert slot is not None, "admit() without can_admit()"
            old = self.occupant[slot]
            if old is not None:
                del self.slot_of[old]
                self.num_swaps += 1
            self.occupant[slot] = aid
            self.slot_of[aid] = slot
            self._loads.append((slot, req))
            self.num_loads += 1
            if slot == self._reserved or aid == self._reserved_for:
                self._reserved = self._reserved_for = None
        elif slot == self._reserved and self._blocked:
            self._grace_left -= 1
        self._pins[aid] += 1
        self._last_used[slot] = self._step

    def _free_slot(self) -> int | None:
        """An empty slot, else the least recently used one no running request pins."""
        best = None
        for s in range(self.max_loras):
            occupant = self.occupant[s]
            if occupant is None:
                return s
            if self._pins[occupant] == 0 and (best is None or self._last_used[s] < self._last_used[best]):
                best = s
        return best

    def take_loads(self) -> list[tuple[int, LoRARequest]]:
        """The (slot, adapter) copies the runner makes before this step."""
        loads, self._loads = self._loads, []
        return loads
