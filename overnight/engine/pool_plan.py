"""How many KV blocks a memory budget buys, and what does not fit (pure arithmetic, no device).

    total x utilization
    |-- outside torch --|-- weights --|-- activations of the largest step --|-- KV pool ..........|
                        '--------- peak allocated while measuring ---------'

The pool never needs more blocks than max_num_seqs sequences of max_model_len, twice over (room for
cached prefixes); a sequence of windowed layers holds only their windows (kv_groups.py). The device side (measuring the budget) is runner/kv_pool.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from overnight.arch import ModelArch
from overnight.config import CacheConfig, SchedulerConfig
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
    if layout is None or not layout.gives_back:
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


def _snapshots(max_num_seqs: int, prefix_caching: bool) -> int:
    # A count proportional to max_num_seqs, so the snapshots are a fixed share (1/5) of the state pool
    # and shrink with it when max_num_seqs is lowered to fit (fit_state_seqs): a share of memory
    # without a second knob. At least 4: a batch job's shared system prompt needs one.
    return max(4, max_num_seqs // 4) if prefix_caching else 0


def state_snapshots(sched: SchedulerConfig, cache: CacheConfig) -> int:
    """Snapshots of linear-attention states kept for prefix-cache hits (engine/state_snapshots.py):
    none without prefix caching. A batch job's shared system prompt needs one; the rest serve
    repeated prompts and multi-turn prefixes, least recently used first out."""
    return _snapshots(sched.max_num_seqs, cache.enable_prefix_caching)


@dataclass(frozen=True)
class StatePlan:
    """The linear-attention state pool of a hybrid model (runner/state_cache.py allocates exactly this):
    `slots` per-request states (max_num_seqs + a scratch slot) and `snapshots` prefix-cache copies,
    bytes_per_seq each (every linear layer: conv states in float32, delta-rule states in ssm_dtype, the
    mamba_ssm_cache_dtype option's). All zero for a model without linear layers."""

    bytes_per_seq: int
    slots: int
    snapshots: int
    ssm_dtype: torch.dtype = torch.float32

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_seq * (self.slots + self.snapshots)


def plan_states(arch: ModelArch, sched: SchedulerConfig, cache: CacheConfig) -> StatePlan:
    if not arch.num_linear_layers:
        return StatePlan(0, 0, 0)
    ssm = cache.ssm_state_dtype
    return StatePlan(arch.linear_state_bytes(ssm), state_slots(sched), state_snapshots(sched, cache), ssm)


def _state_pool_bytes(
    arch: ModelArch, max_num_seqs: int, prefix_caching: bool, ssm_dtype: torch.dtype = torch.float32
) -> int:
    per = arch.linear_state_bytes(ssm_dtype)
    return per * (max_num_seqs + 1 + _snapshots(max_num_seqs, prefix_caching))


# The most of the memory for caches (what is left after the weights and the largest step) that a default
# max_num_seqs lets the state pool take: the rest is the KV pool of the full-attention layers. Half keeps
# both useful: Qwen3.5-9B on an H100 (about 48 GiB for caches) gets 384 requests' states and a 24 GiB KV
# pool of 786k tokens, 2 x 384 sequences of 1,024 tokens (vLLM takes states from the KV pool itself, so
# there the pool's size bounds the running requests the same way). A bfloat16 delta-rule state
# (mamba_ssm_cache_dtype) about halves a request's bytes, so about twice the requests fit the same share.
STATE_SHARE = 0.5


def fit_state_seqs(
    arch: ModelArch,
    max_num_seqs: int,
    cache_bytes: int,
    prefix_caching: bool,
    given: bool,
    min_kv_bytes: int = 0,
    ssm_dtype: torch.dtype = torch.float32,
) -> int:
    """max_num_seqs for a hybrid model whose state pool must fit beside a KV pool in cache_bytes (the
    memory left for caches, before anything is allocated). A default (given False) is lowered until the
    states take at most STATE_SHARE of it (a multiple of 16 from 16 on); a given value is refused when its
    states leave less than min_kv_bytes (the least useful KV pool: build.py passes one step's chunk of
    one sequence) for the KV pool. ssm_dtype: the delta-rule states' storage (CacheConfig.ssm_state_dtype).
    Unchanged for a model without linear layers."""
    if not arch.num_linear_layers:
        return max_num_seqs
    need = _state_pool_bytes(arch, max_num_seqs, prefix_caching, ssm_dtype)
    if given:
        if need + min_kv_bytes > cache_bytes:
            raise PoolMemoryError(
                f"max_num_seqs {max_num_seqs} is too many for this model's linear-attention states: "
                f"{arch.linear_state_bytes(ssm_dtype) / 2**20:.2f} MiB a request ({_ssm_text(ssm_dtype)}), "
                f"{need / GIB:.2f} GiB for "
                f"{max_num_seqs} requests and their prefix-cache snapshots ({need} bytes), but the caches "
                f"have {cache_bytes / GIB:.2f} GiB ({cache_bytes} bytes) and the KV pool needs "
                f"{min_kv_bytes / GIB:.2f} GiB of it for one step of one sequence: lower max_num_seqs "
                f"to at most {_largest_fit(arch, cache_bytes - min_kv_bytes, prefix_caching, ssm_dtype)}"
            )
        return max_num_seqs
    room = min(int(cache_bytes * STATE_SHARE), cache_bytes - min_kv_bytes)
    if need <= room:
        return max_num_seqs
    n = min(_largest_fit(arch, room, prefix_caching, ssm_dtype), max_num_seqs)
    if n < 1:
        raise PoolMemoryError(
            f"no room for the linear-attention states of even one request "
            f"({_state_pool_bytes(arch, 1, prefix_caching, ssm_dtype) / GIB:.2f} GiB with its scratch slot and "
            f"snapshots) beside a KV pool in the {cache_bytes / GIB:.2f} GiB left for caches: raise "
            "gpu_memory_utilization, lower max_num_batched_tokens, or use a GPU with more memory"
        )
    return n if n < 16 else n - n % 16


def _largest_fit(
    arch: ModelArch, room: int, prefix_caching: bool, ssm_dtype: torch.dtype = torch.float32
) -> int:
    """The largest max_num_seqs whose state pool fits in room bytes (0: none)."""
    per = arch.linear_state_bytes(ssm_dtype)
    n = max(room // per, 0)  # an upper bound: every request needs at least its own slot
    while n > 0 and _state_pool_bytes(arch, n, prefix_caching, ssm_dtype) > room:
        n -= 1 + n // 64  # a few dozen steps at most: the bound is about n / 5 + 5 past the answer
    while _state_pool_bytes(arch, n + 1, prefix_caching, ssm_dtype) <= room:
        n += 1
    return n


def _ssm_text(ssm_dtype: torch.dtype) -> str:
    """How a message names the state's storage: "float32 delta-rule states", as the option spells it."""
    return f"{str(ssm_dtype).removeprefix('torch.')} delta-rule states"


def reserve_state_bytes(
    budget_bytes: int, arch: ModelArch, sched: SchedulerConfig, cache: CacheConfig
) -> int:
    """The KV pool's budget once the linear layers' state pool (plan_states: fixed slots and snapshots)
    is set aside; the budget itself for a model without linear layers. The runner and `overnight budget`
    both size the pool through this."""
    state = plan_states(arch, sched, cache).total_bytes
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
