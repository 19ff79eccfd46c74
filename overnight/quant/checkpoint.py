"""Checkpoint tensors converted into the model's FP8 layout while they stream in.

fp8_checkpoint_weights sits between a checkpoint reader and model.load_weights (and tensor parallelism's
slicing, which then cuts weights and scales alike by rows). For each checkpoint projection that loads
into an Fp8Linear (q_proj, ..., down_proj) it yields `<module>.weight` (e4m3 [N, K]) and
`<module>.weight_scale` in the layer's layout, so the loader fuses q/k/v and gate/up scales exactly as
it fuses their weights (each shard keeps its own rows of scales):

    checkpoint                                   per-channel layer        block layer (block_k)
    float weight (online, or an ignored layer)   quantized per row        quantized per row block
    e4m3 + one scale per tensor                  scale repeated per row   repeated per row and block
    e4m3 + one scale per row ([N] or [N, 1])     as is                    repeated per block
    e4m3 + block grid [N / bn, K / bk]           requantized per row      grid rows repeated bn times

Layers a model keeps in the compute dtype but that FP8 checkpoints store in FP8 (its
`dequantized_at_load`: Qwen3-MoE's stacked experts) get their weights dequantized with their scales
here, in float32. A weight and its scale may arrive in either order (or different files): the first is
held until the second comes. input_scale tensors (and fbgemm_fp8's input_scale_ub, where a writer saved
it) are checked (positive, finite) and dropped (quant/scheme.py says why).

Stacked experts stored e4m3 whole (fbgemm_fp8's Llama 4 experts, already transposed into the model's
layout by the model's rename_checkpoint) come with one scale per expert and output row:

    <stack>.gate_up_proj e4m3 [E, 2I, H] + gate_up_proj_scale [E, 1, 2I] / [E, 2I, 1] / [E, 2I]
    <stack>.down_proj    e4m3 [E, H, I]  + down_proj_scale    [E, H, 1] / [E, 1, H] / [E, H]

For experts held as e4m3 while loading (layers/moe.py store_fp8_) they pass as they are, each weight
followed at once by `<stack>.gate_up_scale` / `down_scale` [E, rows] (models/checkpoint.py writes both
into the Experts: no second rounding); other experts get the weight dequantized. Per-expert tensors
(experts.N.gate_proj.weight) with per-row scales ([rows] or [rows, 1]: fbgemm_fp8, compressed-tensors
channel) likewise pass as e4m3 with their `weight_scale` [rows] into such experts; per-tensor and
block-scaled ones are dequantized (and requantized per row as they load).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from overnight.errors import ModelLoadError
from overnight.quant.apply import QuantizedAfterLoad, quantized_checkpoint_modules
from overnight.quant.fp8 import (
    FP8_DTYPE,
    dequantize_weight,
    expand_block_scales,
    quantize_weight,
    quantize_weight_per_channel,
)
from overnight.quant.scheme import QuantScheme, module_matches

_FP8_TYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


def fp8_checkpoint_weights(
    weights: Iterable[tuple[str, torch.Tensor]], model: nn.Module, scheme: QuantScheme
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's (name, tensor) pairs with every FP8 layer's weight in the model's layout (see
    the module docstring); other tensors pass through. Raises ModelLoadError for an FP8 weight without
    its scale (or the reverse), a scale of the wrong shape, or an FP8 tensor for a layer kept in the
    compute dtype."""
    layouts = quantized_checkpoint_modules(model)
    dequantized = getattr(model, "dequantized_at_load", ())
    stacks = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedAfterLoad)}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    stacked: dict[str, dict[str, torch.Tensor]] = {}  # "<stack>.<proj>" -> its weight or scale, held
    for name, tensor in weights:
        module, _, kind = name.rpartition(".")
        if kind == "input_scale_ub":  # fbgemm_fp8's activation bound, if a writer saved it: not applied
            _check_input_scale(name, tensor)
            continue
        if module in stacks and kind.removesuffix("_scale") in _STACKED:
            proj = kind.removesuffix("_scale")
            if kind == proj and tensor.dtype not in _FP8_TYPES:
                yield name, tensor  # float experts: quantized as they load, or kept
                continue
            parts = stacked.setdefault(f"{module}.{proj}", {})
            parts["scale" if kind != proj else "weight"] = tensor
            if len(parts) == 2:
                del stacked[f"{module}.{proj}"]
                yield from _stack_to_layout(module, proj, parts["weight"], parts["scale"], stacks[module])
            continue
        if (
            module not in layouts
            and kind in ("weight", scheme.scale_name, "input_scale")
            and module_matches(module, dequantized)
        ):
            # An FP8 tensor of a layer the model runs in the compute dtype (MoE experts): dequantized with
            # its scale, whichever arrives second; a float one passes as it is.
            if kind == "input_scale":
                _check_input_scale(name, tensor)
                continue
            if kind == "weight" and tensor.dtype not in _FP8_TYPES:
                yield name, tensor
                continue
            parts = pending.setdefault(module, {})
            parts[kind] = tensor
            if "weight" in parts and scheme.scale_name in parts:
                del pending[module]
                block_k = scheme.weight_block[1] if scheme.weight_block is not None else None
                data, scale = _to_layout(module, parts["weight"], parts[scheme.scale_name], block_k, scheme)
                per_row = block_k is None and parts[scheme.scale_name].numel() > 1
                if per_row and _held_as_e4m3(module, stacks):
                    yield from _named(module, data, scale)  # as saved: already the stack's layout
                else:
                    yield f"{module}.weight", dequantize_weight(data, scale)
        elif module not in layouts:
            if tensor.dtype in _FP8_TYPES:
                raise ModelLoadError(
                    f"checkpoint tensor {name} is FP8, but {module or name} is not an FP8 layer here "
                    "(the LM head and embeddings stay in the compute dtype)"
                )
            yield name, tensor
        elif kind == "input_scale":
            _check_input_scale(name, tensor)
        elif kind == "weight" and tensor.dtype not in _FP8_TYPES:
            yield from _named(module, *quantize_weight(tensor, layouts[module]))
        elif kind in ("weight", scheme.scale_name):
            parts = pending.setdefault(module, {})
            parts[kind] = tensor
            if "weight" in parts and scheme.scale_name in parts:
                del pending[module]
                data, scale = _to_layout(
                    module, parts["weight"], parts[scheme.scale_name], layouts[module], scheme
                )
                yield from _named(module, data, scale)
        else:
            yield name, tensor  # a bias; anything else the loader reports as unexpected
    if pending:
        raise ModelLoadError(_unpaired(pending, scheme.scale_name))
    if stacked:
        missing = sorted(f"{n}_scale" if "weight" in p else n for n, p in stacked.items())
        raise ModelLoadError(
            "FP8 checkpoint is incomplete: every FP8 expert stack needs its scale tensor and the reverse; "
            f"missing: {', '.join(missing[:6])}"
        )


_STACKED = ("gate_up_proj", "down_proj")
_PER_EXPERT = re.compile(r"(.*\.experts)\.\d+\.(gate|up|down)_proj")


def _held_as_e4m3(module: str, stacks: dict[str, QuantizedAfterLoad]) -> bool:
    """Whether `module` is one expert's projection (experts.N.gate_proj) of a stack held as e4m3."""
    match = _PER_EXPERT.fullmatch(module)
    return match is not None and getattr(stacks.get(match.group(1)), "stores_fp8", False)


def _stack_to_layout(
    module: str, proj: str, weight: torch.Tensor, scale: torch.Tensor, stack: QuantizedAfterLoad
) -> Iterator[tuple[str, torch.Tensor]]:
    """An e4m3 expert stack [E, rows, in] and its per-row scales in the model's names (module docstring)."""
    if weight.dtype != FP8_DTYPE or weight.dim() != 3:
        raise ModelLoadError(
            f"{module}.{proj} is {weight.dtype} {list(weight.shape)}; FP8 expert stacks must be "
            "float8_e4m3fn [experts, rows, columns]"
        )
    e, n = weight.shape[:2]
    if tuple(scale.shape) not in ((e, 1, n), (e, n, 1), (e, n)):
        raise ModelLoadError(
            f"{module}.{proj}_scale is {list(scale.shape)}; {e} experts of {n} output rows need one "
            f"scale per expert and row: [{e}, 1, {n}], [{e}, {n}, 1] or [{e}, {n}]"
        )
    rows = scale.float().reshape(e, n).contiguous()
    if not bool(torch.isfinite(rows).all()) or bool((rows < 0).any()):
        raise ModelLoadError(f"{module}.{proj}_scale must hold non-negative finite scales")
    if getattr(stack, "stores_fp8", False):
        yield f"{module}.{proj}", weight
        yield f"{module}.{proj.replace('_proj', '_scale')}", rows
    else:
        yield f"{module}.{proj}", weight.float() * rows[:, :, None]


def _named(module: str, data: torch.Tensor, scale: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    yield f"{module}.weight", data
    yield f"{module}.weight_scale", scale


def _unpaired(pending: dict[str, dict[str, torch.Tensor]], scale_name: str) -> str:
    missing = sorted(
        f"{module}.{scale_name if 'weight' in parts else 'weight'}" for module, parts in pending.items()
    )
    more = f" ... and {len(missing) - 6} more" if len(missing) > 6 else ""
    return (
        "FP8 checkpoint is incomplete: every FP8 weight needs its scale tensor and the reverse; "
        f"missing: {', '.join(missing[:6])}{more}"
    )


def _check_input_scale(name: str, scale: torch.Tensor) -> None:
    if scale.numel() == 0 or not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
        raise ModelLoadError(f"checkpoint tensor {name} must hold positive finite scales")


def _to_layout(
    module: str, weight: torch.Tensor, scale: torch.Tensor, block_k: int | None, scheme: QuantScheme
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 scale) of one checkpoint projection in the layer's layout."""
    if weight.dtype != FP8_DTYPE or weight.dim() != 2:
        raise ModelLoadError(
            f"{module}.weight is {weight.dtype} {list(weight.shape)}; FP8 weights must be float8_e4m3fn [out, in]"
        )
    n, k = weight.shape
    scale = scale.float()
    if not bool(torch.isfinite(scale).all()):
        raise ModelLoadError(f"{module}.{scheme.scale_name} holds non-finite values")
    if scheme.weight_block is not None:
        bn, bk = scheme.weight_block
        grid = (-(-n // bn), -(-k // bk))
        if tuple(scale.shape) != grid:
            raise ModelLoadError(
                f"{module}.{scheme.scale_name} is {list(scale.shape)}; a {n} x {k} weight in "
                f"{bn} x {bk} blocks needs {list(grid)}"
            )
        rows = expand_block_scales(scale, bn, n)  # [N, ceil(K / bk)]
        if block_k is None:
            return quantize_weight_per_channel(dequantize_weight(weight, rows))
        return weight, rows  # the layer keeps the checkpoint's blocks: block_k == bk
    if scale.numel() == 1:
        per_row = scale.reshape(1).expand(n)
    elif tuple(scale.shape) in ((n,), (n, 1)):
        per_row = scale.reshape(n)
    else:
        raise ModelLoadError(
            f"{module}.{scheme.scale_name} is {list(scale.shape)}; a weight of {n} rows needs one scale "
            f"per tensor ([] or [1]) or per row ([{n}] or [{n}, 1])"
        )
    if block_k is None:
        return weight, per_row.contiguous()
    return weight, per_row[:, None].expand(n, -(-k // block_k)).contiguous()
