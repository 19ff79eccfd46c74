"""How many KV blocks a memory budget buys, and what does not fit (pure arithmetic, no device).

    total x utilization
    |-- outside torch --|-- weights --|-- activations of the largest step --|-- KV pool ..........|
                        '--------- peak allocated while measuring ---------'

The pool never needs more blocks than max_num_seqs sequences of max_model_len, twice over (room for
cached prefixes); a sequence of windowed layers holds only their windows (kv_groups.py). The device side (measuring the budget) is runner/kv_pool.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from overnight.config import CacheConfig, ModelArch, SchedulerConfig
from overnight.engine.kv_groups import KVCacheLayout
from overnight.errors import ConfigError

GIB = float(1 << 30)


class PoolMemoryError(ConfigError, MemoryError):
    """The memory the engine may use cannot hold the weights, the largest step and a KV pool (a
    ConfigError like the engine's other impossible options; a MemoryError for callers that catch that)."""


@dataclass(frozen=True)
class PoolPlan:
    num_blocks: int
    block_bytes: int
    budget_bytes: int  # memory set aside for the pool before capping
    capped: bool  # True when the cap (max_num_seqs x max_model_len) bounded the pool
    # Per KV cache group, the block scale of the layout the pool was planned and allocated for
    # (kv_groups.py; one rank's shapes under tensor parallelism, where a replicated KV head can make
    # it differ from the whole model's). (): the engine takes the model's own layout.
    block_scales: tuple[int, ...] = ()

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.block_bytes


def plan_pool(
    budget_bytes: int,
    block_bytes: int,
    block_size: int,
    sched: SchedulerConfig,
    layout: KVCacheLayout | None = None,
) -> PoolPlan:
    """layout: the model's KV cache groups (kv_groups.py; None: one group of full attention), which
    set how many blocks one sequence of max_model_len holds."""
    if budget_bytes < block_bytes:
        raise PoolMemoryError(
            f"no memory is left for the KV cache ({budget_bytes / GIB:.2f} GiB after the weights and "
            "activations): raise gpu_memory_utilization, lower max_num_batched_tokens, or use a GPU "
            "with more memory"
        )
    blocks = budget_bytes // block_bytes
    if layout is None or layout.windows == (None,):
        cap = 2 * (-(-sched.max_num_seqs * sched.max_model_len // block_size))
    else:
        seqs, tokens, chunk = sched.max_num_seqs, sched.max_model_len, sched.max_num_batched_tokens
        cap = 2 * layout.blocks_for_sequences(seqs, tokens, chunk, block_size)
    scales = layout.block_scales if layout is not None else ()
    return PoolPlan(min(blocks, cap), block_bytes, budget_bytes, capped=blocks > cap, block_scales=scales)


def state_slots(sched: SchedulerConfig) -> int:
    """Slots of the linear-attention state pool: one per request the scheduler may run at once (the
    runner holds no more: finished and preempted requests leave it in the step that admits their
    successors), plus one scratch slot for padding rows (runner/state_cache.py)."""
    return sched.max_num_seqs + 1


def state_snapshots(sched: SchedulerConfig, cache: CacheConfig) -> int:
    """Snapshots of linear-attention states kept for prefix-cache hits (engine/state_snapshots.py):
    none without prefix caching. A batch job's shared system prompt needs one; the rest serve
    repeated prompts and multi-turn prefixes, least recently used first out."""
    return max(4, sched.max_num_seqs // 4) if cache.enable_prefix_caching else 0


def reserve_state_bytes(
    budget_bytes: int, arch: ModelArch, sched: SchedulerConfig, cache: CacheConfig
) -> int:
    """The KV pool's budget once the linear layers' state pool (fixed: state_slots slots and
    state_snapshots snapshots) is set aside; the budget itself for a model without linear layers."""
    state = arch.linear_state_bytes() * (state_slots(sched) + state_snapshots(sched, cache))
    if state and state > budget_bytes:
        raise PoolMemoryError(
            f"the linear-attention states of {sched.max_num_seqs} requests (and their prefix-cache "
            f"snapshots) take {state / GIB:.2f} GiB, more than the {budget_bytes / GIB:.2f} GiB left for "
            "caches: lower max_num_seqs"
        )
    return budget_bytes - state


def split_budget(total: int, utilization: float, outside_torch: int, weights: int, peak: int) -> int:
    """Bytes left for the pool; raises PoolMemoryError naming what does not fit. peak includes weights."""
    usable = int(total * utilization) - max(outside_torch, 0)
    share = f"gpu_memory_utilization {utilization:g} x {total / GIB:.1f} GiB"
    if outside_torch > 0:
        share += f" - {outside_torch / GIB:.2f} GiB used outside torch"
    if weights > usable:
        raise PoolMemoryError(
            f"the model's weights take {weights / GIB:.2f} GiB, more than the {usable / GIB:.2f} GiB the "
            f"engine may use ({share}): raise gpu_memory_utilization, load a smaller dtype, or split the "
            "model with tensor_parallel_size"
        )
    if peak > usable:
        raise PoolMemoryError(
            f"the weights ({weights / GIB:.2f} GiB) and the activations of the largest step "
            f"({(peak - weights) / GIB:.2f} GiB) need more than the {usable / GIB:.2f} GiB the engine may "
            f"use ({share}): lower max_num_batched_tokens or max_num_seqs, or raise gpu_memory_utilization"
        )
    return usable - peak
