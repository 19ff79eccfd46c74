"""Do the weights fit? Checked from the architecture before any weight is allocated, so a model too large
for the machine stops with a sentence saying what would fit instead of being killed by the kernel's
out-of-memory handler halfway through loading (a CPU machine has no allocator that fails politely).

    weight_bytes(arch, dtype, fp8)   what the weights take while loading (FP8 / int projections: quant/)
    dense_kept(arch, scheme)         the projections a quantized checkpoint keeps in the compute dtype
    kv_bytes_per_sequence(...)       the KV one sequence holds (windowed, chunked layers: their window, chunk)
    layer_kv_shape(arch, i)          (KV heads, head size) of one layer's cache
    available_memory_bytes(device)   free GPU memory, or the RAM the OS can hand out on the CPU
    check_weights_fit(...)           ConfigError naming the gap and the dtypes / GPU counts that fit
    dense_fit(model_bytes, ...)      whether a model held in the compute dtype leaves a GPU room for its
                                     KV cache: the rule of the dense-at-load options' auto (mxfp4_experts,
                                     int_weights)

Quantized checkpoints keep some projections float: compressed-tensors' `ignore`, fbgemm_fp8's, AWQ's and
GPTQ's `modules_to_not_convert`, GPTQ's `dynamic` "-:" skips and `modules_in_block_to_quantize`
(Meta's Llama-3.1-405B-Instruct-FP8 keeps every layer's attention and its first and last layers in
bf16). The estimate counts each projection in the form the loaded model holds it: dense_kept builds
the model on the meta device (shapes only, no weights read, a second for a 405B) and asks
quant/apply.linear_forms, the rule quantize_model itself follows with the checkpoint's own matcher
(every naming layout of the model's checkpoints), which layers stay nn.Linear; ModelArch.weight_bytes
counts those in the compute dtype. Tested against loaded tiny checkpoints of each scheme
(tests/test_memory_fit_quantized.py): the estimate equals the bytes of the parameters, the quantized
layers' buffers and FP8 experts' row scales.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from overnight.arch import ModelArch
from overnight.errors import ConfigError
from overnight.quant.apply import experts_fp8_at_load, int_experts_forms, keeps_int_packed, linear_forms
from overnight.quant.int_scheme import IntScheme
from overnight.quant.scheme import QuantScheme

GIB = 2**30
_SMALLER_DTYPES = (torch.bfloat16, torch.float16)

# The share of one GPU's memory the whole model in the compute dtype (one tensor-parallel rank's share
# of it) may take for a packed format's "auto" to dequantize it at load: below it the 16-bit GEMMs'
# speed is worth the bytes, and the rest still holds a KV cache for large batches (gpt-oss-20b in bf16 is
# 49% of an 80-GB H100, where its dense experts ran 2.5x its MXFP4 ones; Qwen3-8B is 20%).
DENSE_FRACTION = 0.55


@dataclass(frozen=True)
class DenseFit:
    dense: bool  # the model's compute-dtype share is at most DENSE_FRACTION of the GPU
    words: str  # for the load's log line: "the model in bfloat16 is 15.3 GiB, 19% of 79.2 GiB"


def dense_fit(
    model_bytes: int, device_bytes: int, tensor_parallel_size: int = 1, dtype_name: str = "bf16"
) -> DenseFit:
    """Whether a model whose weights take model_bytes in the compute dtype (all of them, unsplit) is held
    dense on GPUs of device_bytes each, tensor_parallel_size of them sharing it."""
    share = model_bytes / tensor_parallel_size
    ratio = share / device_bytes
    on = "each GPU's share" if tensor_parallel_size > 1 else "the model"
    words = f"{on} in {dtype_name} is {share / GIB:.1f} GiB, {ratio:.0%} of {device_bytes / GIB:.1f} GiB"
    if ratio <= DENSE_FRACTION:
        return DenseFit(True, words)
    return DenseFit(False, f"{words}, over {DENSE_FRACTION:.0%}")


def weight_bytes(
    arch: ModelArch,
    dtype: torch.dtype,
    fp8_linear: bool = False,
    loaded: bool = False,
    int_linear: tuple[int, int, bool] | None = None,
    scheme: QuantScheme | IntScheme | None = None,
) -> int:
    """Bytes the weights of `arch` take while loading in `dtype`; fp8_linear: with FP8 projections (an
    FP8 checkpoint or quantization="fp8"; GGUF is dequantized to dtype); loaded: once loaded, when FP8
    MoE experts have been quantized (they load in dtype: layers/moe.py, unless the family holds them as
    e4m3 while loading: its experts_fp8_at_load); int_linear: (bits, group size or 0, experts packed)
    of packed integer projections (an AWQ / GPTQ / compressed-tensors int checkpoint on a GPU);
    scheme: the checkpoint's quantization, whose ignore list keeps some of those layers in dtype (and a
    symmetric integer one holds no zero points); without it every projection counts as quantized, with
    zero points."""
    fp8_experts = fp8_linear and (loaded or _experts_fp8_at_load(arch))
    kept = (0, 0)
    if scheme is not None and (fp8_linear or int_linear is not None):
        kept = dense_kept(arch, scheme, int_linear is not None and int_linear[2])
    return arch.weight_bytes(
        dtype.itemsize,
        fp8_linear=fp8_linear,
        fp8_experts=fp8_experts,
        int_linear=int_linear,
        dense_kept=kept,
        int_zeros=not (isinstance(scheme, IntScheme) and scheme.symmetric),
    )


@functools.lru_cache(maxsize=16)
def dense_kept(
    arch: ModelArch, scheme: QuantScheme | IntScheme, packed_experts: bool = False
) -> tuple[int, int]:
    """(weights, output rows) of the layers a quantized format would cover that the checkpoint keeps in
    the compute dtype: the nn.Linear layers its ignore list names (and, packed_experts, the stacks of
    integer experts it names). Decided by quant/apply.py's own rule on the model built on the meta
    device (no storage, no weights read), so the estimate and the loaded model cannot disagree on which
    layers stay float, whatever the checkpoint's naming layout."""
    if not scheme.ignore and not getattr(scheme, "quantized_only", ()):
        return 0, 0
    from overnight.errors import ModelLoadError
    from overnight.models.registry import model_class_for

    try:
        cls = model_class_for(arch)
    except ModelLoadError:  # an architecture no class implements (shape-only tests)
        return 0, 0
    with torch.device("meta"):
        model = cls(arch)
    params = rows = 0
    for _, linear, quantized in linear_forms(model, scheme):
        if not quantized:
            params += linear.in_features * linear.out_features
            rows += linear.out_features
    if isinstance(scheme, IntScheme) and packed_experts:
        for _, stack, packed in int_experts_forms(model, scheme):
            if not packed:
                experts, two_i, hidden = getattr(stack, "gate_up_proj").shape  # noqa: B009 (an nn.Module's)
                params += experts * 3 * hidden * (two_i // 2)
                rows += experts * (two_i + hidden)
    return params, rows


def _experts_fp8_at_load(arch: ModelArch) -> bool:
    from overnight.errors import ModelLoadError
    from overnight.models.registry import model_class_for

    try:
        return bool(arch.num_experts) and experts_fp8_at_load(model_class_for(arch))
    except ModelLoadError:  # an architecture no class implements (shape-only tests)
        return False


def linear_formats(
    scheme: QuantScheme | IntScheme | None, device: torch.device | str
) -> tuple[bool, tuple[int, int, bool] | None]:
    """(fp8_linear, int_linear) for weight_bytes and check_weights_fit, from a source's quantization
    and where it runs (integer checkpoints are dequantized to dtype on the CPU, and on a GPU when their
    scheme was chosen dense: quant/apply.keeps_int_packed)."""
    if isinstance(scheme, QuantScheme):
        return True, None
    if scheme is None or not keeps_int_packed(device, scheme):
        return False, None
    # experts packed unless act-order / W8A8 or groups the kernels do not take (quant/apply.py)
    group = scheme.group_size
    experts = not (scheme.act_order or scheme.int8_activations) and (group is None or group % 16 == 0)
    return False, (scheme.bits, group or 0, experts)


def layer_kv_shape(arch: ModelArch, layer_idx: int) -> tuple[int, int]:
    """(KV heads, head size) of layer `layer_idx`'s cache. Families whose layers differ (Gemma 4's
    full-attention layers have their own) answer through ModelArch.layer_num_kv_heads / layer_head_dim
    where the architecture has them."""
    heads = getattr(arch, "layer_num_kv_heads", None)
    dim = getattr(arch, "layer_head_dim", None)
    return (
        int(heads(layer_idx)) if heads is not None else arch.num_key_value_heads,
        int(dim(layer_idx)) if dim is not None else arch.head_dim,
    )


def kv_bytes_per_sequence(arch: ModelArch, num_tokens: int, chunk: int, elem_bytes: int) -> int:
    """KV bytes one sequence of num_tokens holds at most, prefilled in chunks of at most `chunk` tokens:
    full-attention layers x num_tokens + windowed layers x min(num_tokens, W + chunk) (a window keeps
    W - 1 tokens and the chunk being written) + chunked-attention layers x min(num_tokens, C + chunk)
    (at most C - 1 tokens of the current attention chunk and the chunk being written); KV-shared layers
    hold none. Block rounding aside, this is what the engine's pool gives the sequence
    (engine/kv_groups.py)."""
    total, planes = 0, getattr(arch, "kv_planes", 2)
    for i in range(arch.num_hidden_layers):
        if arch.kv_source_layer(i) != i or arch.is_linear_layer(i):
            continue
        local = arch.layer_window(i) or arch.layer_chunk(i)  # a layer has at most one of them
        heads, dim = layer_kv_shape(arch, i)
        total += (num_tokens if local is None else min(num_tokens, local + chunk)) * planes * heads * dim
    return total * elem_bytes


def activation_estimate(arch: ModelArch, tokens: int, seqs: int, elem_bytes: int) -> int:
    """The largest step's live tensors, roughly: a few hidden-sized rows, q/k/v and the MLP's two
    intermediate rows per token, and float32 logits (plus the sampler's copies) per sequence."""
    per_token = 4 * arch.hidden_size + arch.q_size + 2 * arch.kv_size + 2 * arch.intermediate_size
    return tokens * per_token * elem_bytes + 3 * seqs * arch.vocab_size * 4


def available_memory_bytes(device: torch.device) -> int | None:
    """Memory free for new allocations on `device` (None: unknown). The CPU's is the kernel's
    MemAvailable: free memory plus caches it can drop, not counting swap."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.virtual_memory().available)


def check_weights_fit(
    arch: ModelArch,
    dtype: torch.dtype,
    device: torch.device,
    model: str,
    tensor_parallel_size: int = 1,
    fp8_linear: bool = False,
    int_linear: tuple[int, int, bool] | None = None,
    rank_arch: ModelArch | None = None,
    scheme: QuantScheme | IntScheme | None = None,
) -> None:
    """Raise ConfigError when the weights cannot fit: on a GPU, each rank's share against that GPU's free
    memory; on the CPU, all of them against the RAM available. rank_arch: the shapes of the weights one
    rank holds (parallel/tp_shards.py TPShards.rank_weights_arch: replicated norms, routers and KV heads
    whole), else the whole model's divided by tensor_parallel_size."""
    tp = tensor_parallel_size
    if device.type == "cuda":
        first = device.index or 0
        places = [torch.device("cuda", first + r) for r in range(tp)]
        if tp > 1 and rank_arch is not None:
            share = weight_bytes(rank_arch, dtype, fp8_linear, int_linear=int_linear, scheme=scheme)
        else:
            share = -(-weight_bytes(arch, dtype, fp8_linear, int_linear=int_linear, scheme=scheme) // tp)
    else:
        places, share = [device], weight_bytes(arch, dtype, fp8_linear, int_linear=int_linear, scheme=scheme)
    for place in places:
        free = available_memory_bytes(place)
        if free is None or share <= free:
            continue
        where = f"GPU {place.index}" if place.type == "cuda" else "this machine"
        what = f"a 1/{tp} share of " if tp > 1 else ""
        raise ConfigError(
            f"{model} does not fit: {what}its weights take {share / GIB:.1f} GiB in "
            f"{str(dtype).removeprefix('torch.')}{_format_note(fp8_linear, int_linear)} "
            f"({arch.num_parameters() / 1e9:.2f} B parameters), but "
            f"{where} has {free / GIB:.1f} GiB free. {_what_fits(arch, dtype, place, free, tp, fp8_linear, int_linear, scheme)}"
        )


def _format_note(fp8_linear: bool, int_linear: tuple[int, int, bool] | None) -> str:
    if int_linear is not None:
        return f" with int{int_linear[0]} projections"
    return " with FP8 projections" if fp8_linear else ""


def _what_fits(
    arch: ModelArch,
    dtype: torch.dtype,
    device: torch.device,
    free: int,
    tp: int,
    fp8_linear: bool,
    int_linear: tuple[int, int, bool] | None = None,
    scheme: QuantScheme | IntScheme | None = None,
) -> str:
    def size(d: torch.dtype) -> int:
        return weight_bytes(arch, d, fp8_linear, int_linear=int_linear, scheme=scheme)

    options = [
        f"--dtype {str(d).removeprefix('torch.')} ({size(d) / tp / GIB:.1f} GiB)"
        for d in _SMALLER_DTYPES
        if d.itemsize < dtype.itemsize and size(d) / tp <= free
    ]
    if (
        device.type == "cuda"
        and not fp8_linear
        and int_linear is None
        and not isinstance(scheme, IntScheme)  # an integer checkpoint refuses fp8, held dense too
        and torch.cuda.get_device_capability(device) >= (8, 9)
    ):
        fp8 = weight_bytes(arch, dtype, True) / tp
        if fp8 <= free:  # FP8 projections (quant/): Ada and Hopper GPUs have the tensor cores for them
            options.append(f"--quantization fp8 ({fp8 / GIB:.1f} GiB)")
    if device.type == "cuda" and isinstance(scheme, IntScheme) and scheme.dense:
        packed = replace(scheme, dense=False)  # int_weights dense was chosen: the packed form's bytes
        packed_bytes = weight_bytes(arch, dtype, int_linear=linear_formats(packed, device)[1], scheme=packed)
        if packed_bytes / tp <= free:
            options.append(f"--int-weights packed ({packed_bytes / tp / GIB:.1f} GiB)")
    if device.type == "cuda":
        gpus = torch.cuda.device_count()
        fits = [
            k
            for k in (2, 4, 8)
            if tp < k <= gpus
            and arch.num_attention_heads % k == 0
            and int_linear is None  # integer layers do not shard yet
            and size(dtype) / k <= free
        ]
        if fits:
            options.append(f"--tensor-parallel-size {fits[0]} (of the {gpus} GPUs here)")
    options.append("a smaller model")
    if device.type == "cpu":
        options.append("a machine with a GPU")
    return f"What would fit: {'; or '.join(options)}."
