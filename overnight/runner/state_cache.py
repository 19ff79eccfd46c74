"""The state cache of hybrid models: per-request states of the linear-attention layers, beside the paged
KV cache of their attention layers.

A Gated DeltaNet or Mamba2 layer needs, per request, a fixed-size state (attention/linear_state.py has
the layout) instead of KV blocks. The pool holds one slot per request the runner may hold at once, indexed
by the request's runner row (RequestStates' `slot`), plus a scratch slot for padding rows:

    slots 0 .. max_num_seqs-1 : owned by the running request whose row it is, from the step that
                                brings it to the runner until the step that reports it finished or
                                preempted (the row, and so the slot, is then free for the next one)
    slot  max_num_seqs         : scratch (CUDA-graph padding rows; profiling)

Why max_num_seqs rows suffice: the scheduler runs at most max_num_seqs requests, and every request it
finishes, aborts or preempts is reported (finished_req_ids) in the same SchedulerOutput that admits
the requests taking its place; RequestStates frees rows before it assigns new ones. A step launched
ahead of the host's view changes nothing: the runner's rows follow the SchedulerOutputs in order.

Snapshots (prefix caching): a second, smaller pool of the same states, keyed on the engine's side by
block hashes (engine/state_snapshots.py). A request admitted past a prefix-cache hit gets the
snapshot of that boundary copied into its slot before its first step (so it starts with has_state = 1);
a step whose chunk ends at a checkpoint copies the slot into a snapshot after its forward pass.

A slot is never cleared. A request whose step starts at position 0 (new, resumed after preemption,
recomputed without a hit) is marked has_state = 0 and the layers start from zeros; a request
continuing (a later prefill chunk, a decode, a restored snapshot) is marked 1.
"""

from __future__ import annotations

import torch

from overnight.arch import ModelArch
from overnight.attention.linear_state import LinearStateBatch
from overnight.engine.pool_plan import StatePlan
from overnight.engine.step_io import SchedulerOutput
from overnight.runner.request_state import RequestStates, ScheduledRequest


class StateCache:
    def __init__(self, arch: ModelArch, plan: StatePlan, device: torch.device) -> None:
        """plan (engine/pool_plan.py plan_states): the slots and snapshots the KV pool's sizing set aside;
        nbytes equals its total_bytes."""
        (k1, conv_dim), ssm = arch.linear_state_shapes()
        max_num_seqs, num_snapshots = plan.slots - 1, plan.snapshots
        self.num_slots = max_num_seqs
        self.scratch = max_num_seqs
        self.device = device
        n = plan.slots
        # The delta-rule state in plan.ssm_dtype (the mamba_ssm_cache_dtype option): float32 by default,
        # as transformers keeps it (its torch and fla paths compute and return it in float32): it sums a
        # decayed outer product every token, and a 16-bit state is rounded once per step (bfloat16: 8 bits
        # of mantissa), which drifts over thousands of tokens; users trade that for half the bytes. Every
        # reader computes in float32 and rounds only as it stores (kernels/gated_delta_decode.py, the
        # torch path, fla's prefill). The conv state stays float32 whatever the option: it holds the last
        # K-1 inputs exactly, and is 4% of the bytes (3 x 8,192 of 32 x 128 x 128 values a layer for
        # Qwen3.5), not worth a second dtype.
        f32, sdt = torch.float32, plan.ssm_dtype
        self.conv = [
            torch.zeros(n, k1, conv_dim, dtype=f32, device=device) for _ in range(arch.num_linear_layers)
        ]
        self.ssm = [torch.zeros(n, *ssm, dtype=sdt, device=device) for _ in range(arch.num_linear_layers)]
        # Prefix caching: states at block boundaries (engine/state_snapshots.py decides which), copied
        # slot -> snapshot after the step that reaches one and snapshot -> slot for a hit (same dtypes:
        # a snapshot is a bit-exact copy, never rounded again).
        self.conv_snapshots = [
            torch.zeros(num_snapshots, k1, conv_dim, dtype=f32, device=device) for _ in self.conv
        ]
        self.ssm_snapshots = [torch.zeros(num_snapshots, *ssm, dtype=sdt, device=device) for _ in self.ssm]
        # Static per-row buffers (CUDA graphs read them in place); unused rows point at the scratch slot.
        self.slot_ids = torch.full((max_num_seqs,), self.scratch, dtype=torch.int64, device=device)
        self.has_state = torch.zeros(max_num_seqs, dtype=f32, device=device)
        self._slots_cpu: list[int] = []
        self._has_cpu: list[bool] = []

    @property
    def nbytes(self) -> int:
        tensors = self.conv + self.ssm + self.conv_snapshots + self.ssm_snapshots
        return sum(t.numel() * t.element_size() for t in tensors)

    def restore(self, out: SchedulerOutput, states: RequestStates) -> None:
        """Copy the snapshot of each new request's prefix-cache hit into its slot (before its step)."""
        for new in out.new_reqs:
            if new.restore_snapshot is None:
                continue
            slot, snap = states.reqs[new.req_id].slot, new.restore_snapshot
            for pool, snaps in zip(self.conv + self.ssm, self.conv_snapshots + self.ssm_snapshots):
                pool[slot].copy_(snaps[snap])

    def save(self, saves: list[tuple[str, int]], states: RequestStates) -> None:
        """Copy each request's state into its snapshot (after the step that reached the boundary)."""
        for req_id, snap in saves:
            slot = states.reqs[req_id].slot
            for pool, snaps in zip(self.conv + self.ssm, self.conv_snapshots + self.ssm_snapshots):
                snaps[snap].copy_(pool[slot])

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
