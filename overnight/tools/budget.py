"""`overnight budget`: the batch limits and the KV pool this device gives a model, without loading it.

    overnight budget                                         # the default model on this machine
    overnight budget --model qwen3-8b --load-format dummy --max-model-len 8192 --kv-cache-dtype fp8 \\
        --mode batch --seq-len 768

Prints max_num_seqs and max_num_batched_tokens for each mode on this device (the row of the defaults
table that applies), the KV pool in tokens and GiB, and how many sequences of --seq-len fit in it.
Sliding-window layers count as the engine holds them: only their window and the chunk being computed
(engine/kv_groups.py), so a Gemma-3-shaped model fits several times the sequences at long contexts;
chunked-attention layers (Llama 4) likewise, only their current attention chunk and the chunk computed.
The pool is sized as the engine sizes it: on the CPU a fixed budget; on a GPU gpu_memory_utilization
of the total, less the memory others hold, the weights (from the architecture) and an estimate of the
largest step's activations (the engine measures those at start-up).
With --tensor-parallel-size N every number is one GPU's: its share of the weights (parallel/tp_shards.py:
sharded layers / N, vocab-parallel embeddings / N, replicated parts whole), its KV heads (at least one:
with fewer KV heads than GPUs each is replicated) and its linear-attention state heads, and the pool
of the tightest of the N GPUs; a sequence's blocks are held on every GPU at once.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, replace

import torch

from overnight.arch import ModelArch
from overnight.attention.kv_quant import kv_cache_torch_dtype
from overnight.config import decode_row_cap
from overnight.engine.kv_groups import KVCacheLayout
from overnight.engine.pool_plan import (
    PoolMemoryError,
    plan_pool,
    plan_states,
    reserve_state_bytes,
    split_budget,
)
from overnight.errors import ConfigError
from overnight.limits import default_limits
from overnight.loader.fit import (
    activation_estimate,
    kv_bytes_per_sequence,
    layer_kv_shape,
    linear_formats,
    weight_bytes,
)
from overnight.loader.model_loader import resolve_dtype
from overnight.loader.source import ModelSource
from overnight.options import MODES, EngineOptions, add_engine_args, options_from_args
from overnight.runner.kv_pool import CPU_DEFAULT_POOL_BYTES

GIB = 2**30


@dataclass(frozen=True)
class DeviceMemory:
    name: str
    total_bytes: int
    free_bytes: int


@dataclass(frozen=True)
class Budget:
    device: str  # with tensor parallelism: each of the GPUs
    row: str  # the defaults table's row
    mode: str
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    modes: dict[str, tuple[int, int]]  # mode -> (max_num_seqs, max_num_batched_tokens)
    kv_dtype: str
    kv_bytes_per_token: int  # of every layer holding a cache (before windows)
    block_size: int
    block_bytes: int  # one block of the pool (with windows: of one layer per cache tensor)
    pool_source: str  # how the budget was found
    budget_bytes: int
    weights_bytes: int | None
    activation_bytes: int | None
    num_blocks: int
    capped: bool
    seq_len: int
    seq_blocks: int  # blocks a sequence of seq_len holds between chunks (windowed layers: their window)
    seq_kv_bytes: int  # KV bytes it holds: full layers x seq_len + windowed x min(seq_len, W + chunk)
    seqs_fit: int  # sequences of seq_len the pool holds
    seqs_at_once: int  # the same, bounded by max_num_seqs
    kv_layers: int  # layers holding a cache of their own (KV-shared layers hold none)
    windowed_layers: int  # of them, those with a sliding window (0: every one keeps the whole context)
    windows: tuple[int, ...]  # their windows, each once
    # Of them, those with chunked attention (Llama 4), which keep only their current chunk; their chunks.
    chunked_layers: int = 0
    chunks: tuple[int, ...] = ()
    # Share of a full-attention block no layer uses: its layers' K/V smaller than the tensors' slots,
    # which the windowed layers' larger shape sets (Gemma 4; engine/kv_groups.py). 0: none.
    full_block_padding: float = 0.0
    # Block scale of the full-attention groups: their blocks hold this many times block_size tokens,
    # their layers needing that fraction of a slot per token (Gemma 4: 2; engine/kv_groups.py). 1: none.
    full_block_scale: int = 1
    # KV cache groups and their layers (G), and the tensor slots of a block of every group no layer fills
    # (each kind's last group holding fewer than G layers; engine/kv_groups.group_size): (empty, all).
    num_groups: int = 1
    group_layers: int = 0
    empty_slots: tuple[int, int] = (0, 0)
    # Hybrid models: bytes of one request's linear-attention states, and of the whole state pool
    # (max_num_seqs + 1 slots and the prefix-cache snapshots), set aside before the KV pool
    state_bytes_per_seq: int = 0
    state_pool_bytes: int = 0
    state_dtype: str = "float32"  # the delta-rule states' storage (mamba_ssm_cache_dtype resolved)
    state_snapshots: int = 0
    caches_bytes: int = 0  # the memory for caches before the state pool is set aside (budget_bytes after)
    seqs_lowered_for_states: bool = False  # a mode's default max_num_seqs lowered below the table's
    # Every byte above is one GPU's share when the model is split over tensor_parallel_size GPUs.
    tensor_parallel_size: int = 1
    # (cap, upto): a decode step of cap < D <= upto requests computes cap of them while requests wait
    # (SchedulerConfig.decode_row_caps: packed int4 GEMMs' row tiles)
    decode_row_caps: tuple[tuple[int, int], ...] = ()

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def pool_tokens(self) -> int:
        """The pool in tokens of every layer (what it holds for full attention)."""
        return self.pool_bytes // self.kv_bytes_per_token if self.kv_bytes_per_token else 0


def _weights_label(fp8: bool, int_linear: tuple[int, int, bool] | None) -> str:
    if int_linear is not None:
        return f"int{int_linear[0]} "
    return "FP8 " if fp8 else ""


def plan_budget(
    opts: EngineOptions, source: ModelSource, device: DeviceMemory | None, seq_len: int | None = None
) -> Budget:
    """The engine's limits and KV pool for these options on `device` (None: the CPU), resolved by the
    engine's own build_config (so its checks apply), with the weights and activations estimated from the
    architecture instead of loaded and measured."""
    from overnight.build import build_config, check_int_parallel, fit_hybrid_seqs

    gib = device.total_bytes / GIB if device else None
    config = build_config(opts, source, torch.device("cuda" if device else "cpu"), gib)  # TP's checks too
    fp8, int_linear = linear_formats(source.quantization, "cuda" if device else "cpu")
    tp = config.parallel.tensor_parallel_size
    check_int_parallel(source, tp, int_linear)
    sched, cache = config.scheduler, config.cache
    # One rank's shapes: its KV heads and linear-attention heads (the pool and the states it holds)
    # and its weights; the whole model's when unsplit.
    arch, weights_arch = source.arch, source.arch
    if tp > 1:
        from overnight.parallel.tp_shards import TPShards

        shards = TPShards(source.arch, 0, tp)
        arch, weights_arch = shards.local_arch, shards.rank_weights_arch
    modes, lowered = {}, False
    for m in MODES:
        lim = default_limits(gib, m, sched.max_model_len)
        seqs = lim.max_num_seqs
        if arch.num_linear_layers:  # each mode's default as build_config lowers it for the states
            table = replace(opts, mode=m, max_num_seqs=None, max_num_batched_tokens=None)
            cuda = torch.device("cuda" if device else "cpu")
            seqs = fit_hybrid_seqs(
                table,
                source,
                cuda,
                gib,
                config.model.dtype,
                seqs,
                lim.max_num_batched_tokens,
                sched.max_model_len,
                cache.enable_prefix_caching,
            )
        modes[m] = (seqs, lim.max_num_batched_tokens)
        lowered = lowered or seqs < lim.max_num_seqs
    dtype_bytes = config.model.dtype.itemsize
    kv_elem = kv_cache_torch_dtype(cache.kv_cache_dtype, config.model.dtype).itemsize
    layout = KVCacheLayout.from_arch(arch, sched.max_model_len)
    cached = [
        i
        for i in range(arch.num_hidden_layers)
        if arch.kv_source_layer(i) == i and not arch.is_linear_layer(i)
    ]
    cached_layers = len(cached)
    per_token = sum(arch.kv_planes * h * d for h, d in (layer_kv_shape(arch, i) for i in cached)) * kv_elem
    block_bytes = cache.block_size * layout.token_elems * kv_elem
    weights = activations = None
    states = plan_states(arch, sched, cache)  # what runner/state_cache.py allocates
    caches = 0
    try:
        if cache.kv_cache_memory_bytes is not None:
            budget, pool_source = cache.kv_cache_memory_bytes, "set by --kv-cache-memory-bytes"
        elif device is None:
            budget, pool_source = CPU_DEFAULT_POOL_BYTES, "the CPU default"
        else:
            weights = weight_bytes(
                weights_arch,
                config.model.dtype,
                fp8_linear=fp8,
                loaded=True,
                int_linear=int_linear,
                scheme=source.quantization,
            )
            activations = activation_estimate(
                arch, sched.max_num_batched_tokens, sched.max_num_seqs, dtype_bytes
            )
            elsewhere = device.total_bytes - device.free_bytes  # other processes, this one's CUDA context
            util = cache.gpu_memory_utilization
            pool_source = (
                f"{util:.2f} x {device.total_bytes / GIB:.1f} GiB - "
                f"{elsewhere / GIB:.1f} GiB in use - {weights / GIB:.1f} GiB {_weights_label(fp8, int_linear)}weights - "
                f"{activations / GIB:.1f} GiB activations (estimate)"
            )
            budget = split_budget(device.total_bytes, util, elsewhere, weights, weights + activations)
        caches = budget
        # The runner's own set-aside (ModelRunner.kv_pool_share): the whole state pool, slots and snapshots.
        budget = reserve_state_bytes(budget, arch, sched, cache)
        plan = plan_pool(budget, block_bytes, cache.block_size, sched, layout)
        num_blocks, capped = plan.num_blocks, plan.capped
    except PoolMemoryError as e:
        budget, pool_source, num_blocks, capped = 0, str(e), 0, False
    seq_len = seq_len or sched.max_model_len
    chunk = sched.max_num_batched_tokens
    # One sequence alone may hold a whole chunk in its windowed layers; many at once share one
    # step's chunk: the pool holds n sequences when blocks_for_sequences(n) fits.
    seq_blocks = layout.blocks_per_sequence(seq_len, 1, cache.block_size)
    chunk_blocks = layout.blocks_per_sequence(seq_len, chunk, cache.block_size) - seq_blocks
    fit = max(num_blocks - chunk_blocks, 0) // seq_blocks
    return Budget(
        device=device.name if device else "CPU",
        row=default_limits(gib, opts.mode, sched.max_model_len).row,
        mode=opts.mode,
        max_model_len=sched.max_model_len,
        max_num_seqs=sched.max_num_seqs,
        max_num_batched_tokens=sched.max_num_batched_tokens,
        modes=modes,
        kv_dtype=cache.kv_cache_dtype,
        kv_bytes_per_token=per_token,
        block_size=cache.block_size,
        block_bytes=block_bytes,
        pool_source=pool_source,
        budget_bytes=budget,
        weights_bytes=weights,
        activation_bytes=activations,
        num_blocks=num_blocks,
        capped=capped,
        seq_len=seq_len,
        seq_blocks=seq_blocks,
        seq_kv_bytes=kv_bytes_per_sequence(arch, seq_len, chunk, kv_elem),
        seqs_fit=fit,
        seqs_at_once=min(fit, sched.max_num_seqs),
        kv_layers=cached_layers,
        windowed_layers=sum(len(g.layers) for g in layout.groups if g.window is not None),
        windows=tuple(sorted({g.window for g in layout.groups if g.window is not None})),
        chunked_layers=sum(len(g.layers) for g in layout.groups if g.chunk is not None),
        chunks=tuple(sorted({g.chunk for g in layout.groups if g.chunk is not None})),
        full_block_padding=max(
            (layout.unused_share(i) for i, g in enumerate(layout.groups) if g.is_full), default=0.0
        ),
        full_block_scale=max(
            (layout.block_scales[i] for i, g in enumerate(layout.groups) if g.is_full), default=1
        ),
        num_groups=layout.num_groups,
        group_layers=layout.num_tensors,
        empty_slots=layout.empty_slots,
        state_bytes_per_seq=states.bytes_per_seq,
        state_pool_bytes=states.total_bytes,
        state_dtype=str(states.ssm_dtype).removeprefix("torch."),
        state_snapshots=states.snapshots,
        caches_bytes=caches,
        seqs_lowered_for_states=lowered,
        tensor_parallel_size=tp,
        decode_row_caps=sched.decode_row_caps,
    )


# -- the command --------------------------------------------------------------------------------------


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "budget",
        help="batch limits and KV pool for a model on this device",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--mode", default="offline", choices=list(MODES), help="how the engine will run")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: max_model_len)")
    p.add_argument("--json", action="store_true", help="print the budget as one JSON line")
    add_engine_args(p)


def device_memory(device: torch.device, tensor_parallel_size: int = 1) -> DeviceMemory | None:
    """The GPU's memory (None: the CPU); split over tensor_parallel_size GPUs from `device` on, the
    tightest of them (the group's pool is the smallest rank's: parallel/workers.py)."""
    if device.type != "cuda":
        return None
    first, count = device.index or 0, torch.cuda.device_count()
    if first + tensor_parallel_size > count:
        raise ConfigError(
            f"tensor_parallel_size {tensor_parallel_size} needs GPUs {first}..{first + tensor_parallel_size - 1}, "
            f"but this machine has {count}"
        )
    infos = [torch.cuda.mem_get_info(torch.device("cuda", first + r)) for r in range(tensor_parallel_size)]
    free, total = min(infos)
    return DeviceMemory(torch.cuda.get_device_name(device), total, free)


def run(args: argparse.Namespace) -> int:
    from overnight.build import resolve_model
    from overnight.runner.device import pick_device

    # The architecture only: no weights are read (and no tokenizer: the budget needs none).
    opts = options_from_args(args, mode=args.mode, skip_tokenizer_init=True)
    source = resolve_model(opts).source
    device = device_memory(pick_device(opts.device), opts.tensor_parallel_size)
    b = plan_budget(opts, source, device, seq_len=args.seq_len)
    dtype = str(resolve_dtype(opts.dtype, source, pick_device(opts.device))).removeprefix("torch.")
    if args.json:
        extra = {"pool_tokens": b.pool_tokens, "pool_gib": round(b.pool_bytes / GIB, 3)}
        print(json.dumps({"model": source.served_name, "dtype": dtype, **asdict(b), **extra}))
        return 0
    print(render(b, source.served_name, source.arch, dtype))
    return 0


def render(b: Budget, model: str, arch: ModelArch, dtype: str) -> str:
    """`arch`: the whole model's (with tensor parallelism, the KV line shows one GPU's heads)."""
    kv_name = dtype if b.kv_dtype == "auto" else b.kv_dtype
    whole, tp = arch, b.tensor_parallel_size
    if tp > 1:
        from overnight.parallel.tp_shards import TPShards

        arch = TPShards(whole, 0, tp).local_arch
    elem = b.kv_bytes_per_token // arch.kv_bytes_per_token(1)
    # Layers that own a cache, by shape (Gemma 4's full layers have their own; KV-shared layers none).
    shapes: dict[tuple[int, int], int] = {}
    for i in range(arch.num_hidden_layers):
        if arch.kv_source_layer(i) == i and not arch.is_linear_layer(i):
            shape = (arch.layer_num_kv_heads(i), arch.layer_head_dim(i))
            shapes[shape] = shapes.get(shape, 0) + 1
    layers = " + ".join(f"{n} layers x 2 x {h} heads x {d}" for (h, d), n in shapes.items())
    attention = f"{whole.num_key_value_heads} KV heads x {whole.head_dim}"
    if arch.is_mla:  # one row per token and layer (attention/mla.py), the same on every TP rank
        rank, rope = arch.kv_lora_rank, arch.qk_rope_head_dim
        layers = f"{arch.num_hidden_layers} layers x one row of {rank} latent + {rope} rope values"
        attention = f"latent attention, {whole.num_attention_heads} heads over a {rank} + {rope} cache row"
    on = f"each of {tp} GPUs ({b.device}); every size below is one GPU's share" if tp > 1 else b.device
    lines = [
        f"{model} ({whole.architecture}, {whole.num_hidden_layers} layers, {attention}"
        f"{', text-only: no vision tower' if whole.text_only else ''}), {dtype}, on {on}",
        f'limits: row "{b.row}" of the defaults table, max_model_len {b.max_model_len}',
        f"  {'mode':<8} {'max_num_seqs':>12} {'max_num_batched_tokens':>23}",
    ]
    for mode, (seqs, tokens) in b.modes.items():
        mark = "  <- --mode" if mode == b.mode else ""
        lines.append(f"  {mode:<8} {seqs:>12} {tokens:>23}{mark}")
    if b.seqs_lowered_for_states:
        lines.append(
            "  (max_num_seqs lowered from the table so the linear-attention states take at most half of "
            "the memory for caches)"
        )
    if (b.max_num_seqs, b.max_num_batched_tokens) != b.modes[b.mode]:
        lines.append(
            f"  as given: max_num_seqs {b.max_num_seqs}, max_num_batched_tokens {b.max_num_batched_tokens}"
        )
    lines.append(
        f"KV cache: {kv_name}, {b.kv_bytes_per_token} bytes per token (({layers}) x {elem} B), "
        f"blocks of {b.block_size} tokens"
    )
    if b.windowed_layers:
        windows = ", ".join(str(w) for w in b.windows)
        lines.append(
            f"  sliding windows: {b.windowed_layers} of {b.kv_layers} layers keep only their last {windows} "
            f"tokens (+ the chunk being computed): a sequence of {b.seq_len} tokens holds "
            f"{b.seq_kv_bytes / 2**20:.1f} MiB, not {b.seq_len * b.kv_bytes_per_token / 2**20:.1f}"
        )
    if b.chunked_layers:
        chunks = ", ".join(str(c) for c in b.chunks)
        lines.append(
            f"  chunked attention: {b.chunked_layers} of {b.kv_layers} layers keep only the current "
            f"attention chunk of {chunks} tokens (+ the chunk being computed): a sequence of {b.seq_len} "
            f"tokens holds {b.seq_kv_bytes / 2**20:.1f} MiB, not {b.seq_len * b.kv_bytes_per_token / 2**20:.1f}"
        )
    if b.full_block_scale > 1:
        lines.append(
            f"  cache shapes differ: a full-attention layer needs 1/{b.full_block_scale} of a windowed "
            f"layer's bytes per token, so its blocks hold {b.full_block_scale * b.block_size} tokens "
            "(counted in the sequences that fit)"
        )
    if b.empty_slots[0]:
        empty, slots = b.empty_slots
        lines.append(
            f"  {b.num_groups} KV cache groups of {b.group_layers} layers, one block table each: "
            f"{empty} of {slots} cache slots stay empty ({empty / slots:.1%}; the last group of a kind "
            "holds fewer layers), counted in the sequences that fit"
        )
    if b.full_block_padding:
        lines.append(
            f"  cache shapes differ: a full-attention block is padded to the windowed layers' shape, "
            f"{b.full_block_padding:.0%} of it unused (counted in the sequences that fit)"
        )
    if b.state_bytes_per_seq:
        # LFM2's short convs keep no recurrent state
        kinds = "" if arch.is_short_conv else f"delta-rule states in {b.state_dtype}, "
        lines.append(
            f"linear-attention states: {b.state_bytes_per_seq / 2**20:.1f} MiB per request "
            f"({arch.num_linear_layers} layers, {kinds}conv states in "
            f"float32); state pool {b.state_pool_bytes / GIB:.2f} GiB "
            f"({b.max_num_seqs} + 1 slots and {b.state_snapshots} prefix-cache snapshots), set aside "
            f"before the KV pool: {b.caches_bytes / GIB:.2f} GiB for caches - {b.state_pool_bytes / GIB:.2f} "
            f"GiB states = {b.budget_bytes / GIB:.2f} GiB for the KV pool"
        )
    if b.num_blocks == 0:
        lines.append(f"KV pool: no room: {b.pool_source}")
        return "\n".join(lines)
    cap = (
        f", capped at 2 x max_num_seqs x max_model_len (budget {b.budget_bytes / GIB:.2f} GiB)"
        if b.capped
        else ""
    )
    lines.append(
        f"KV pool: {b.pool_bytes / GIB:.2f} GiB = {b.num_blocks} blocks = {b.pool_tokens} tokens "
        f"({b.pool_source}){cap}"
    )
    lines.append(
        f"sequences of {b.seq_len} tokens that fit: {b.seqs_fit} ({b.seq_blocks} blocks each); "
        f"at once with max_num_seqs {b.max_num_seqs}: {b.seqs_at_once}"
    )
    if b.decode_row_caps:
        ranges = ", ".join(f"{cap + 1}-{upto} -> {cap}" for cap, upto in b.decode_row_caps)
        held = decode_row_cap(b.decode_row_caps, b.seqs_at_once)
        at_once = f"; at {b.seqs_at_once} at once, {held} decode a step" if held is not None else ""
        lines.append(
            f"decode row caps (the int4 GEMM's whole row tiles, while requests wait): {ranges}{at_once}"
        )
    return "\n".join(lines)
