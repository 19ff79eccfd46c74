"""The state cache of hybrid models: per-request states of the linear-attention layers, beside the paged
KV cache of their attention layers.

A Gated DeltaNet layer needs, per request, a fixed-size state (attention/linear_state.py has the
layout) instead of KV blocks. The pool holds one slot per request the runner may hold at once, indexed
by the request's runner row (RequestStates' `slot`), plus a scratch slot for padding rows:

    slots 0 .. max_num_seqs-1 : owned by the running request whose row it is, from the step that
                                brings it to the runner until the step that reports it finished or
                                preempted (the row, and so the slot, is then free for the next one)
    slot  max_num_seqs         : scratch (CUDA-graph padding rows; profiling)

Why max_num_seqs rows suffice: the scheduler runs at most max_num_seqs requests, and every request it
finishes, aborts or preempts is reported (finished_req_ids) in the same SchedulerOutput that admits
the requests taking its place; RequestStates frees rows before it assigns new ones. A step launched
ahead of the host's view changes nothing: the runner's rows follow the SchedulerOutputs in order.

A slot is never cleared. A request whose step starts at position 0 (new, resumed after preemption,
recomputed) is marked has_state = 0 and the layers start from zeros; a request continuing (a later
prefill chunk, a decode) is marked 1. Prefix caching is off for these models (build.py), so a request
never starts past position 0 without having computed those tokens itself in this slot.
"""

from __future__ import annotations

import torch

from overnight.attention.linear_state import LinearStateBatch
from overnight.config import ModelArch
from overnight.runner.request_state import ScheduledRequest


class StateCache:
    def __init__(self, arch: ModelArch, max_num_seqs: int, device: torch.device) -> None:
        (k1, conv_dim), ssm = arch.linear_state_shapes()
        self.num_slots = max_num_seqs
        self.scratch = max_num_seqs
        self.device = device
        n = max_num_seqs + 1
        f32 = torch.float32
        self.conv = [
            torch.zeros(n, k1, conv_dim, dtype=f32, device=device) for _ in range(arch.num_linear_layers)
        ]
        self.ssm = [torch.zeros(n, *ssm, dtype=f32, device=device) for _ in range(arch.num_linear_layers)]
        # Static per-row buffers (CUDA graphs read them in place); unused rows point at the scratch slot.
        self.slot_ids = torch.full((max_num_seqs,), self.scratch, dtype=torch.int64, device=device)
        self.has_state = torch.zeros(max_num_seqs, dtype=f32, device=device)
        self._slots_cpu: list[int] = []
        self._has_cpu: list[bool] = []

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.conv + self.ssm)

    def fill(self, scheduled: list[ScheduledRequest], num_rows: int) -> None:
        """This step's rows (RequestStates.begin applied: s.start is the position it starts at); rows
        len(scheduled) .. num_rows are padding and use the scratch slot."""
        slots = [s.state.slot for s in scheduled]
        if slots and max(slots) >= self.num_slots:
            raise RuntimeError(f"runner row {max(slots)} has no state slot (max_num_seqs {self.num_slots})")
        has = [s.start > 0 for s in scheduled]
        self._slots_cpu, self._has_cpu = slots, has
        pad = num_rows - len(slots)
        self._copy(self.slot_ids, slots + [self.scratch] * pad, torch.int64)
        self._copy(self.has_state, [1.0 if h else 0.0 for h in has] + [0.0] * pad, torch.float32)

    def fill_scratch(self, num_reqs: int) -> None:
        """Every row on the scratch slot, from zeros (a profiling step)."""
        self._slots_cpu, self._has_cpu = [self.scratch] * num_reqs, [False] * num_reqs
        self.slot_ids[:num_reqs].fill_(self.scratch)
        self.has_state[:num_reqs].zero_()

    def _copy(self, dst: torch.Tensor, values: list, dtype: torch.dtype) -> None:
        if not values:
            return
        # A fresh pinned tensor per step: the host allocator keeps it until the copy has run.
        src = torch.tensor(values, dtype=dtype, pin_memory=self.device.type == "cuda")
        dst[: len(values)].copy_(src, non_blocking=True)

    def batch(self, num_reqs: int) -> LinearStateBatch:
        return LinearStateBatch(
            self.conv,
            self.ssm,
            self.slot_ids[:num_reqs],
            self.has_state[:num_reqs],
            self._slots_cpu,
            self._has_cpu,
        )
