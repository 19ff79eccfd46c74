"""Sizing the KV pool: how many blocks fit in the memory the engine may use.

On a GPU the pool gets what is left of gpu_memory_utilization x total memory after the weights and the
peak activation memory of the largest step (measured by running one). On the CPU the pool is a fixed
budget (default 2 GiB; memory is touched only as blocks fill). Either way the pool never needs more
blocks than max_num_seqs sequences of max_model_len, plus room for cached prefixes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from overnight.config import CacheConfig, SchedulerConfig

CPU_DEFAULT_POOL_BYTES = 2 << 30


@dataclass(frozen=True)
class PoolPlan:
    num_blocks: int
    block_bytes: int
    budget_bytes: int  # memory set aside for the pool before capping
    capped: bool  # True when the cap (max_num_seqs x max_model_len) bounded the pool

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.block_bytes


def plan_pool(
    budget_bytes: int, block_bytes: int, block_size: int, sched: SchedulerConfig
) -> PoolPlan:
    if budget_bytes < block_bytes:
        raise MemoryError(
            f"no memory is left for the KV cache ({budget_bytes / 2**30:.2f} GiB after the weights and "
            "activations): raise gpu_memory_utilization, lower max_num_batched_tokens, or use a GPU "
            "with more memory"
        )
    blocks = budget_bytes // block_bytes
    cap = 2 * (-(-sched.max_num_seqs * sched.max_model_len // block_size))
    return PoolPlan(min(blocks, cap), block_bytes, budget_bytes, capped=blocks > cap)


def kv_budget_bytes(
    device: torch.device, cache: CacheConfig, measure_peak: "callable[[], int] | None" = None
) -> int:
    """Bytes available for the pool. measure_peak runs the largest step and returns the peak bytes
    allocated by torch during it (weights included)."""
    if cache.kv_cache_memory_bytes is not None:
        return cache.kv_cache_memory_bytes
    if device.type != "cuda":
        return CPU_DEFAULT_POOL_BYTES
    free, total = torch.cuda.mem_get_info(device)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    peak = measure_peak() if measure_peak is not None else torch.cuda.memory_allocated(device)
    torch.cuda.empty_cache()
    free_after, _ = torch.cuda.mem_get_info(device)
    # Memory outside torch's allocator (CUDA context, NCCL, other processes) stays where it is.
    non_torch = total - free_after - torch.cuda.memory_reserved(device)
    return int(total * cache.gpu_memory_utilization) - peak - max(non_torch, 0)
