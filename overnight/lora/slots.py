"""The runner's side of LoRA: adapters loaded once into a host cache (LRU of max_cpu_loras), copied into
the device slots the scheduler assigns (residency.py decides; this only follows), and each step's rows
mapped to their slots.

    SchedulerOutput.lora_loads [(slot, LoRARequest)] ──► DeviceLoRA.load ──► every LoRALinear.set_slot
    scheduled requests (their adapter ids)           ──► DeviceLoRA.map_rows ──► LoRABatch (static buffers)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import nn

from overnight.config import LoRAConfig, ModelArch
from overnight.lora.adapter import LoadedAdapter, check_adapter, load_adapter
from overnight.lora.layers import LoRABatch, LoRALinear, apply_lora
from overnight.lora.request import LoRARequest


class HostAdapterCache:
    """Loaded adapters by id, least recently used evicted past `capacity`."""

    def __init__(self, arch: ModelArch, max_rank: int, dtype: torch.dtype, capacity: int) -> None:
        self.arch = arch
        self.max_rank = max_rank
        self.dtype = dtype
        self.capacity = capacity
        self.adapters: OrderedDict[int, LoadedAdapter] = OrderedDict()
        self.num_loads = 0  # reads from disk

    def get(self, req: LoRARequest) -> LoadedAdapter:
        adapter = self.adapters.get(req.lora_int_id)
        if adapter is not None and adapter.spec.request.lora_path == req.lora_path:
            self.adapters.move_to_end(req.lora_int_id)
            return adapter
        adapter = load_adapter(check_adapter(req, self.arch, self.max_rank), self.dtype)
        self.num_loads += 1
        self.adapters[req.lora_int_id] = adapter
        self.adapters.move_to_end(req.lora_int_id)
        while len(self.adapters) > self.capacity:
            self.adapters.popitem(last=False)
        return adapter


class DeviceLoRA:
    """The wrapped layers of one model, their slots' occupants, and the step's row -> slot map."""

    def __init__(
        self,
        model: nn.Module,
        arch: ModelArch,
        config: LoRAConfig,
        dtype: torch.dtype,
        device: torch.device,
        max_tokens: int,
        max_reqs: int,
    ) -> None:
        self.config = config
        self.batch = LoRABatch(max_tokens, max_reqs, device)
        self.modules: dict[tuple[int, str], LoRALinear] = apply_lora(
            model, arch, self.batch, config.max_loras, config.max_lora_rank, dtype
        )
        self.host = HostAdapterCache(arch, config.max_lora_rank, dtype, config.max_cpu_loras)
        self.slot_of: dict[int, int] = {}  # adapter id -> slot
        self.occupant: list[int | None] = [None] * config.max_loras
        if device.type == "cuda":
            self._compile_prefill_kernels()
        self.batch.for_capture()  # the memory profile's step runs the LoRA kernels too

    @torch.inference_mode()
    def _compile_prefill_kernels(self) -> None:
        """One row through each kind of wrapped layer with a prefill step's map (slot 0, all zeros
        yet): the SGMV kernels compile now, not in the middle of a job (the memory profile and graph
        capture compile the BGMV ones)."""
        seen: set[str] = set()
        for (_, path), module in self.modules.items():
            if path in seen:
                continue
            seen.add(path)
            self.batch.map_rows([0], [1], 1, decode_only=False)
            module(torch.zeros(1, module.in_features, dtype=module.lora_a.dtype, device=self.batch.device))

    def load(self, loads: Sequence[tuple[int, LoRARequest]]) -> None:
        """Put each adapter into its slot (the scheduler evicted the slot's occupant, if any, when no
        running request used it; a launched step that did has its kernels queued before these copies)."""
        for slot, req in loads:
            adapter = self.host.get(req)
            old = self.occupant[slot]
            if old is not None:
                self.slot_of.pop(old, None)
            for key, module in self.modules.items():
                parts = adapter.weights.get(key)
                if parts:
                    module.set_slot(slot, parts)
                else:
                    module.clear_slot(slot)
            self.occupant[slot] = req.lora_int_id
            self.slot_of[req.lora_int_id] = slot

    def map_rows(
        self, adapter_ids: Sequence[int], lens: Sequence[int], num_rows: int, decode_only: bool
    ) -> None:
        """adapter_ids[i]: the i-th scheduled request's adapter (0: the base model), in row order."""
        slot_of = self.slot_of
        slots = [slot_of[a] if a else -1 for a in adapter_ids]
        self.batch.map_rows(slots, lens, num_rows, decode_only)
