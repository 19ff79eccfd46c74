"""Sizing the KV pool: how many blocks fit in the memory the engine may use.

On a GPU the pool gets what is left of gpu_memory_utilization x total memory after memory used outside
torch (CUDA context, other processes), the weights, and the peak activation memory of the largest step
(measured by running one):

    total x utilization
    |-- outside torch --|-- weights --|-- activations of the largest step --|-- KV pool ..........|
                        '--------- peak allocated while measuring ---------'

kv_cache_memory_bytes sets the pool directly; on the CPU the pool is a fixed budget (default 2 GiB;
memory is touched only as blocks fill). Either way the pool never needs more blocks than max_num_seqs
sequences of max_model_len, twice over (room for cached prefixes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from overnight.config import CacheConfig, SchedulerConfig
from overnight.engine.kv_groups import KVCacheLayout
from overnight.engine.pool_plan import PoolPlan, plan_pool, split_budget

CPU_DEFAULT_POOL_BYTES = 2 << 30


def kv_budget_bytes(
    device: torch.device,
    cache: CacheConfig,
    measure_peak: Callable[[], int] | None = None,
    held_bytes: int = 0,
) -> int:
    """Bytes available for the caches (the KV pool, and a hybrid model's state pool: the caller sets
    that aside, engine/pool_plan.py reserve_state_bytes). measure_peak runs the largest step and returns
    the peak bytes allocated by torch during it (weights included). held_bytes: cache memory already
    allocated (the state pool), counted neither as weights nor in the peak."""
    if cache.kv_cache_memory_bytes is not None:
        return cache.kv_cache_memory_bytes
    if device.type != "cuda":
        return CPU_DEFAULT_POOL_BYTES
    _, total = torch.cuda.mem_get_info(device)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    weights = torch.cuda.memory_allocated(device) - held_bytes  # the model is loaded; and held_bytes
    peak = (measure_peak() - held_bytes) if measure_peak is not None else weights
    torch.cuda.empty_cache()
    free_after, _ = torch.cuda.mem_get_info(device)
    # Memory outside torch's allocator (CUDA context, NCCL, other processes) stays where it is.
    outside_torch = total - free_after - torch.cuda.memory_reserved(device)
    return split_budget(total, cache.gpu_memory_utilization, outside_torch, weights, peak)


class PoolOwner(Protocol):
    """A runner that holds a KV pool: the single-device runner, or the tensor-parallel group (whose
    ranks each hold a share of every block)."""

    def kv_pool_share(self) -> tuple[int, int]:
        """(bytes the pool may take, bytes of one block), measured on the device(s)."""
        ...

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate num_blocks blocks and capture the CUDA graphs that read them."""
        ...


def set_up_kv_pool(
    runner: PoolOwner, cache: CacheConfig, sched: SchedulerConfig, layout: KVCacheLayout | None = None
) -> PoolPlan:
    """The one KV pool set-up: measure, plan, allocate. layout: the model's KV cache groups (None: one
    group of full attention)."""
    budget, block_bytes = runner.kv_pool_share()
    plan = plan_pool(budget, block_bytes, cache.block_size, sched, layout)
    runner.allocate_kv_cache(plan.num_blocks)
    return plan
