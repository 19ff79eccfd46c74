"""`overnight budget`: the batch limits and the KV pool this device gives a model, without loading it.

    overnight budget                                         # the default model on this machine
    overnight budget --model qwen3-8b --load-format dummy --max-model-len 8192 --kv-cache-dtype fp8 \\
        --mode batch --seq-len 768

Prints max_num_seqs and max_num_batched_tokens for each mode on this device (the row of the defaults
table that applies), the KV pool in tokens and GiB, and how many sequences of --seq-len fit in it.
The pool is sized as the engine sizes it: on the CPU a fixed budget; on a GPU gpu_memory_utilization
of the total, less the memory others hold, the weights (from the architecture) and an estimate of the
largest step's activations (the engine measures those at start-up).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

import torch

from overnight.attention.kv_quant import FP8_DTYPES, kv_cache_torch_dtype
from overnight.config import ModelArch, SchedulerConfig
from overnight.limits import MODES, default_limits
from overnight.runner.kv_pool import CPU_DEFAULT_POOL_BYTES, PoolMemoryError, plan_pool, split_budget

GIB = 2**30


@dataclass(frozen=True)
class DeviceMemory:
    name: str
    total_bytes: int
    free_bytes: int


@dataclass(frozen=True)
class Budget:
    device: str
    row: str  # the defaults table's row
    mode: str
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    modes: dict[str, tuple[int, int]]  # mode -> (max_num_seqs, max_num_batched_tokens)
    kv_dtype: str
    kv_bytes_per_token: int
    block_size: int
    pool_source: str  # how the budget was found
    budget_bytes: int
    weights_bytes: int | None
    activation_bytes: int | None
    num_blocks: int
    capped: bool
    seq_len: int
    seqs_fit: int  # sequences of seq_len the pool holds
    seqs_at_once: int  # the same, bounded by max_num_seqs

    @property
    def pool_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.block_size * self.kv_bytes_per_token


def kv_bytes_per_token(arch: ModelArch, elem_bytes: int) -> int:
    return 2 * arch.num_hidden_layers * arch.num_key_value_heads * arch.head_dim * elem_bytes


def num_parameters(arch: ModelArch) -> int:
    h, q, kv, inter = arch.hidden_size, arch.q_size, arch.kv_size, arch.intermediate_size
    layer = h * q + 2 * h * kv + q * h + 3 * h * inter + 2 * h
    if arch.attention_bias:
        layer += q + 2 * kv
    if arch.qk_norm:
        layer += 2 * arch.head_dim
    head = 0 if arch.tie_word_embeddings else arch.vocab_size * h
    return arch.vocab_size * h + head + arch.num_hidden_layers * layer + h


def linear_weight_parameters(arch: ModelArch) -> int:
    """The projections' weights (q, k, v, o, gate, up, down): what FP8 quantization stores in one byte,
    with a float32 scale per output row."""
    h, q, kv, inter = arch.hidden_size, arch.q_size, arch.kv_size, arch.intermediate_size
    return arch.num_hidden_layers * (h * q + 2 * h * kv + q * h + 3 * h * inter)


def weight_bytes(arch: ModelArch, dtype_bytes: int, fp8: bool = False) -> int:
    total = num_parameters(arch) * dtype_bytes
    if not fp8:
        return total
    rows = arch.num_hidden_layers * (
        arch.q_size + 2 * arch.kv_size + arch.hidden_size + 3 * arch.intermediate_size
    )
    return total - linear_weight_parameters(arch) * (dtype_bytes - 1) + 4 * rows


def activation_estimate(arch: ModelArch, tokens: int, seqs: int, elem_bytes: int) -> int:
    """The largest step's live tensors, roughly: a few hidden-sized rows, q/k/v and the MLP's two
    intermediate rows per token, and float32 logits (plus the sampler's copies) per sequence."""
    per_token = 4 * arch.hidden_size + arch.q_size + 2 * arch.kv_size + 2 * arch.intermediate_size
    return tokens * per_token * elem_bytes + 3 * seqs * arch.vocab_size * 4


def plan_budget(
    arch: ModelArch,
    dtype: torch.dtype,  # the compute dtype (weights, activations; the KV cache's unless fp8)
    device: DeviceMemory | None,  # None: the CPU
    mode: str = "offline",
    max_model_len: int | None = None,
    kv_cache_dtype: str = "auto",
    block_size: int = 16,
    gpu_memory_utilization: float = 0.9,
    kv_cache_memory_bytes: int | None = None,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    seq_len: int | None = None,
    fp8_weights: bool = False,
) -> Budget:
    max_model_len = max_model_len or arch.max_position_embeddings
    gib = device.total_bytes / GIB if device else None
    modes = {}
    for m in MODES:
        lim = default_limits(gib, m, max_model_len)
        modes[m] = (lim.max_num_seqs, lim.max_num_batched_tokens)
    limits = default_limits(gib, mode, max_model_len)
    seqs = max_num_seqs or limits.max_num_seqs
    tokens = max_num_batched_tokens or limits.max_num_batched_tokens
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    kv_elem = torch.empty((), dtype=kv_cache_torch_dtype(kv_cache_dtype, dtype)).element_size()
    per_token = kv_bytes_per_token(arch, kv_elem)
    sched = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=tokens, max_model_len=max_model_len)
    weights = activations = None
    try:
        if kv_cache_memory_bytes is not None:
            budget, source = kv_cache_memory_bytes, "set by --kv-cache-memory-bytes"
        elif device is None:
            budget, source = CPU_DEFAULT_POOL_BYTES, "the CPU default"
        else:
            weights = weight_bytes(arch, dtype_bytes, fp8_weights)
            activations = activation_estimate(arch, tokens, seqs, dtype_bytes)
            elsewhere = device.total_bytes - device.free_bytes  # other processes, this one's CUDA context
            source = (
                f"{gpu_memory_utilization:.2f} x {device.total_bytes / GIB:.1f} GiB - "
                f"{elsewhere / GIB:.1f} GiB in use - {weights / GIB:.1f} GiB {'FP8 ' if fp8_weights else ''}weights - "
                f"{activations / GIB:.1f} GiB activations (estimate)"
            )
            budget = split_budget(
                device.total_bytes, gpu_memory_utilization, elsewhere, weights, weights + activations
            )
        plan = plan_pool(budget, per_token * block_size, block_size, sched)
        num_blocks, capped = plan.num_blocks, plan.capped
    except PoolMemoryError as e:
        budget, source, num_blocks, capped = 0, str(e), 0, False
    seq_len = seq_len or max_model_len
    fit = num_blocks // -(-seq_len // block_size)
    return Budget(
        device=device.name if device else "CPU",
        row=limits.row,
        mode=mode,
        max_model_len=max_model_len,
        max_num_seqs=seqs,
        max_num_batched_tokens=tokens,
        modes=modes,
        kv_dtype=kv_cache_dtype,
        kv_bytes_per_token=per_token,
        block_size=block_size,
        pool_source=source,
        budget_bytes=budget,
        weights_bytes=weights,
        activation_bytes=activations,
        num_blocks=num_blocks,
        capped=capped,
        seq_len=seq_len,
        seqs_fit=fit,
        seqs_at_once=min(fit, seqs),
    )


# -- the command --------------------------------------------------------------------------------------


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "budget",
        help="batch limits and KV pool for a model on this device",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default=None, help="as for serve/run-batch (default: the embedded SmolLM2)")
    p.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "safetensors", "gguf", "dummy"],
        help="dummy: --model may name a preset (qwen3-8b, llama-3.1-8b, ...)",
    )
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", *FP8_DTYPES])
    p.add_argument("--quantization", default=None, choices=["fp8"], help="fp8: FP8 linear weights")
    p.add_argument("--mode", default="offline", choices=list(MODES))
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: max_model_len)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda when available)")
    p.add_argument("--json", action="store_true", help="print the budget as one JSON line")


def device_memory(device: torch.device) -> DeviceMemory | None:
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(torch.cuda.get_device_name(device), total, free)


def run(args: argparse.Namespace) -> int:
    from overnight.engine.builder import pick_device
    from overnight.loader.model_loader import resolve_dtype
    from overnight.loader.resolve import resolve_source

    # The architecture (and an FP8 checkpoint's quantization) only; no weights are read.
    source = resolve_source(args.model, args.load_format, args.quantization)
    device = pick_device(args.device)
    dtype = resolve_dtype(args.dtype, source, device)
    b = plan_budget(
        source.arch,
        dtype,
        device_memory(device),
        mode=args.mode,
        max_model_len=args.max_model_len,
        kv_cache_dtype=args.kv_cache_dtype,
        block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        seq_len=args.seq_len,
        fp8_weights=source.quantization is not None,
    )
    if args.json:
        print(
            json.dumps(
                {
                    "model": source.served_name,
                    "dtype": str(dtype).removeprefix("torch."),
                    **asdict(b),
                    "pool_tokens": b.pool_tokens,
                    "pool_gib": round(b.pool_bytes / GIB, 3),
                }
            )
        )
        return 0
    print(render(b, source.served_name, source.arch, str(dtype).removeprefix("torch.")))
    return 0


def render(b: Budget, model: str, arch: ModelArch, dtype: str) -> str:
    kv_name = dtype if b.kv_dtype == "auto" else b.kv_dtype
    elem = b.kv_bytes_per_token // (2 * arch.num_hidden_layers * arch.num_key_value_heads * arch.head_dim)
    lines = [
        f"{model} ({arch.architecture}, {arch.num_hidden_layers} layers, {arch.num_key_value_heads} KV heads "
        f"x {arch.head_dim}), {dtype}, on {b.device}",
        f'limits: row "{b.row}" of the defaults table, max_model_len {b.max_model_len}',
        f"  {'mode':<8} {'max_num_seqs':>12} {'max_num_batched_tokens':>23}",
    ]
    for mode, (seqs, tokens) in b.modes.items():
        mark = "  <- --mode" if mode == b.mode else ""
        lines.append(f"  {mode:<8} {seqs:>12} {tokens:>23}{mark}")
    if (b.max_num_seqs, b.max_num_batched_tokens) != b.modes[b.mode]:
        lines.append(
            f"  as given: max_num_seqs {b.max_num_seqs}, max_num_batched_tokens {b.max_num_batched_tokens}"
        )
    lines.append(
        f"KV cache: {kv_name}, {b.kv_bytes_per_token} bytes per token ({arch.num_hidden_layers} layers x 2 x "
        f"{arch.num_key_value_heads} heads x {arch.head_dim} x {elem} B), blocks of {b.block_size} tokens"
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
    blocks = -(-b.seq_len // b.block_size)
    lines.append(
        f"sequences of {b.seq_len} tokens that fit: {b.seqs_fit} ({blocks} blocks each); "
        f"at once with max_num_seqs {b.max_num_seqs}: {b.seqs_at_once}"
    )
    return "\n".join(lines)
