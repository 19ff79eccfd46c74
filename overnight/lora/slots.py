"""The runner's side of LoRA: adapters loaded once into a host cache (LRU of max_cpu_loras), copied into
the device slots the scheduler assigns (residency.py decides; this only follows), and each step's rows
mapped to their slots.

    SchedulerOutput.lora_loads [(slot, LoRARequest)] ──► DeviceLoRA.load ──► every LoRALinear.set_slot
    scheduled requests (their adapter ids)           ──► DeviceLoRA.map_rows ──► LoRABatch (static buffers)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from overnight.arch import ModelArch
from overnight.config import LoRAConfig
from overnight.lora.adapter import LoadedAdapter, check_adapter, load_adapter
from overnight.lora.layers import LoRABatch, LoRALinear, apply_lora
from overnight.lora.request import LoRARequest
from overnight.lora.targets import MODULE_SLICES

# Row-parallel layers under tensor parallelism: each rank holds some input columns, so A is split by
# its columns and the partial x @ A^T summed over ranks; the others are column-parallel: B split by rows.
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj", "mlp.shared_expert.down_proj")


@dataclass(frozen=True)
class LoRASharding:
    """A tensor-parallel rank's view: the whole model's arch (adapters are checked against it), the
    rank's share of a tensor by its projection name (parallel/tp_shards.py TPShards.shard, which slices
    checkpoint weights the same way), and the sum over ranks (in place)."""

    whole_arch: ModelArch
    shard: Callable[[str, torch.Tensor], torch.Tensor]
    all_reduce: Callable[[torch.Tensor], object]

    def split(self, module: str, parts: list[tuple[int, torch.Tensor, torch.Tensor]]) -> list:
        """This rank's (slice, A, B) of a module's whole parts."""
        row_parallel = module in ROW_PARALLEL
        out = []
        for s, a, b in parts:
            name = f"{MODULE_SLICES[module][s]}.weight"
            out.append((s, self.shard(name, a), b) if row_parallel else (s, a, self.shard(name, b)))
        return out


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
        sharding: LoRASharding | None = None,
    ) -> None:
        """arch: the model as this device holds it (a tensor-parallel rank's share, with `sharding`)."""
        self.config = config
        self.sharding = sharding
        self.batch = LoRABatch(max_tokens, config.max_loras, device)
        self.modules: dict[tuple[int, str], LoRALinear] = apply_lora(
            model, arch, self.batch, config.max_loras, config.max_lora_rank, dtype
        )
        if sharding is not None:
            for (_, path), module in self.modules.items():
                if path in ROW_PARALLEL:
                    module.reduce = sharding.all_reduce
        whole = sharding.whole_arch if sharding is not None else arch
        self.host = HostAdapterCache(whole, config.max_lora_rank, dtype, config.max_cpu_loras)
        self.slot_of: dict[int, int] = {}  # adapter id -> slot
        self.occupant: list[int | None] = [None] * config.max_loras
        if device.type == "cuda":
            self._compile_prefill_kernels()
        self.batch.for_capture()  # the memory profile's step runs the LoRA kernels too

    @torch.inference_mode()
    def _compile_prefill_kernels(self) -> None:
        """One row through each shape of wrapped layer with a prefill step's map and a decode step's
        (slot 0, all zeros yet): the kernels compile now, not in the middle of a job (the two maps'
        tiles differ in rows, kernels/lora.py PREFILL_BLOCK_M: two variants; decode graphs capture
        the second again, an eager decode step runs it)."""
        seen: set[tuple[int, int, tuple[int, ...]]] = set()
        for module in self.modules.values():
            # one per shape: a module's size may differ between layers (Gemma 4's full / sliding layers)
            shape = (module.in_features, module.out_features, module.offsets)
            if shape in seen:
                continue
            seen.add(shape)
            for decode_only in (False, True):
                self.batch.map_rows([0], [1], 1, decode_only)
                x = torch.zeros(1, module.in_features, dtype=module.lora_a.dtype, device=self.batch.device)
                module(x)

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
                    module.set_slot(slot, self.sharding.split(key[1], parts) if self.sharding else parts)
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
