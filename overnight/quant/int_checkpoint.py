"""Integer checkpoints' tensors converted while they stream in (the integer counterpart of
quant/checkpoint.py, between the checkpoint reader and model.load_weights).

A quantized checkpoint module (one shipping qweight / weight_packed / an int8 weight, with the parts
its scheme requires: IntScheme.required_parts) is held until all its parts have arrived, in any order
or file, then unpacked into the canonical form (quant/int_formats.py) and either

    - repacked for the integer layer it loads into (GPU): `<module>.packed_weight`, `.group_scale`,
      `.group_zero` (asymmetric), rows first so q/k/v and gate/up fuse by stacking; an act-order
      column permutation is written into the layer's input_perm buffer, and the parts of one fused
      layer must agree on it (they do when written by GPTQ: the order comes from their shared input);
      W8A8: `<module>.weight` int8 and `.weight_scale` [out];
    - or, for an expert of an IntExperts stack (quant/int_moe.py), its packed codes as
      `<module>.weight` (stacked by the loader like a float expert's) and its scales and zeros written
      into the stack's buffers;
    - or dequantized to `<module>.weight` in float32 (the loader casts to the compute dtype): every
      linear and expert on the CPU, and on a GPU under int_weights dense (IntScheme.dense: the model
      was built without integer layers, so none is in `layers` / `experts` here), act-order and W8A8
      experts everywhere, and any quantized tensor of a layer kept in float. An act-order weight's
      columns come back in the input's order (IntWeight.dequantize reads g_idx).

Other tensors pass through. A float weight for a layer built as an integer one means the config's
ignore list does not match the weights: refused by name, as are unpaired parts at the end.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from overnight.errors import ModelLoadError
from overnight.quant.apply import int_checkpoint_modules, int_experts_modules
from overnight.quant.int_formats import IntWeight, from_awq, from_compressed_tensors, from_gptq, kernel_layout
from overnight.quant.int_linear import Int8Linear, WeightOnlyIntLinear
from overnight.quant.int_moe import IntExperts
from overnight.quant.int_scheme import IntScheme


def int_checkpoint_weights(
    weights: Iterable[tuple[str, torch.Tensor]], model: nn.Module, scheme: IntScheme
) -> Iterator[tuple[str, torch.Tensor]]:
    layers = int_checkpoint_modules(model)
    experts = int_experts_modules(model)
    projections = expert_projections(model)
    required = scheme.required_parts()
    parts_of = required | scheme.optional_parts()
    pending: dict[str, dict[str, torch.Tensor]] = {}
    done: set[str] = set()
    perms: dict[str, torch.Tensor | None] = {}  # model module -> the column order its first part set
    for name, tensor in weights:
        module, _, kind = name.rpartition(".")
        if kind not in parts_of or not _is_quantized_part(kind, tensor):
            if module in layers and kind == "weight":
                raise ModelLoadError(
                    f"checkpoint tensor {name} is {tensor.dtype}, but {module} is quantized here: the "
                    "quantization_config's ignore list does not name it"
                )
            yield name, tensor
            continue
        if module in done:  # an optional part after the module was converted (GPTQ's g_idx)
            _check_late_part(name, tensor, scheme.group_size)
            continue
        parts = pending.setdefault(module, {})
        parts[kind] = tensor
        if not required <= parts.keys():
            continue
        del pending[module]
        done.add(module)
        yield from _convert(module, parts, scheme, layers, experts, projections, perms)
    if pending:
        missing = sorted(f"{m}.{p}" for m, parts in pending.items() for p in required - parts.keys())
        more = f" ... and {len(missing) - 6} more" if len(missing) > 6 else ""
        raise ModelLoadError(
            f"{scheme.method} checkpoint is incomplete: missing {', '.join(missing[:6])}{more}"
        )


# A checkpoint expert projection: (stack, expert, projection)
_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.([^.]+)")


def expert_projections(model: nn.Module) -> dict[str, tuple[str, int]]:
    """Checkpoint expert projection name -> (IntExperts weight prefix, shard): the model's
    packed_modules_mapping read as the loader reads it (gate_proj -> gate_up_proj shard 0, ...; a
    parameter no entry maps to is its own checkpoint name)."""
    mapping: dict[str, tuple[str, str | int]] = getattr(model, "packed_modules_mapping", {})
    out: dict[str, tuple[str, int]] = {}
    for leaf, prefix in (("gate_up_proj", "gate_up"), ("down_proj", "down")):
        sources = [(src, shard) for src, (fused, shard) in mapping.items() if fused == leaf]
        for src, shard in sources or [(leaf, 0)]:
            out[src] = (prefix, int(shard))
    return out


def _packed_expert(
    module: str,
    parts: dict[str, torch.Tensor],
    scheme: IntScheme,
    stack: IntExperts,
    e: int,
    where: tuple[str, int],
) -> Iterator[tuple[str, torch.Tensor]]:
    """One expert projection into IntExperts: its codes go through the loader (stacked like a float
    expert weight), its scales and zeros straight into the stack's buffers at the same rows."""
    packed, scale, zero, perm = kernel_layout(canonical(module, parts, scheme), module)
    assert perm is None  # act-order experts are not packed (quant/apply.py)
    prefix, shard = where
    if stack.gate_up_zero is None and not bool((zero == float(1 << (scheme.bits - 1))).all()):
        raise ModelLoadError(
            f"{module}: a symmetric scheme with zero points other than {1 << (scheme.bits - 1)}"
        )
    # a tensor-parallel stack holds its share of the intermediate size: gate/up rows, down groups
    scale = stack.expert_share(f"{module}.group_scale", scale)
    rows = scale.shape[0]
    start = shard * stack.intermediate_size
    target_scale: torch.Tensor = getattr(stack, f"{prefix}_scale")
    if tuple(target_scale.shape[2:]) != tuple(scale.shape[1:]) or start + rows > target_scale.shape[1]:
        raise ModelLoadError(
            f"{module}: scales {list(scale.shape)} do not fit the experts' {list(target_scale.shape[1:])}"
        )
    target_scale[e, start : start + rows].copy_(scale)
    target_zero: torch.Tensor | None = getattr(stack, f"{prefix}_zero")
    if target_zero is not None:
        target_zero[e, start : start + rows].copy_(stack.expert_share(f"{module}.group_zero", zero))
    yield f"{module}.weight", packed


def _is_quantized_part(kind: str, tensor: torch.Tensor) -> bool:
    """Whether a tensor named as one of the scheme's parts is one (a "weight" only when int8: W8A8)."""
    return kind != "weight" or tensor.dtype == torch.int8


def _check_late_part(name: str, tensor: torch.Tensor, group_size: int | None) -> None:
    g = tensor.reshape(-1).long()
    k = g.numel()
    size = group_size or k
    if not torch.equal(g, torch.arange(k, device=g.device) // size):
        raise ModelLoadError(
            f"checkpoint tensor {name} orders columns out of group order, but the quantization_config "
            "does not say desc_act / actorder: refusing to guess"
        )


def canonical(module: str, parts: dict[str, torch.Tensor], scheme: IntScheme) -> IntWeight:
    """The module's weight unpacked from the scheme's layout (W4A16/W8A16 formats)."""
    if scheme.method == "awq":
        return from_awq(module, parts)
    if scheme.method == "gptq":
        w = from_gptq(module, parts, scheme.bits, scheme.gptq_v1)
    else:
        w = from_compressed_tensors(module, parts, scheme.bits, scheme.symmetric)
    if w.g_idx is not None and not scheme.act_order:
        raise ModelLoadError(
            f"{module}: its g_idx orders columns out of group order, but the quantization_config does not "
            "say desc_act / actorder"
        )
    return w


def _int8(module: str, parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    weight, scale = parts["weight"], parts["weight_scale"].float()
    if weight.dim() != 2 or scale.numel() != weight.shape[0]:
        raise ModelLoadError(
            f"{module}: int8 weight {list(weight.shape)} needs one weight_scale per row, got {list(scale.shape)}"
        )
    return weight, scale.reshape(-1)


def dequantized(module: str, parts: dict[str, torch.Tensor], scheme: IntScheme) -> torch.Tensor:
    """The module's weight [out, in] in float32, from its checkpoint parts."""
    if scheme.int8_activations:
        weight, scale = _int8(module, parts)
        return weight.float() * scale[:, None]
    return canonical(module, parts, scheme).dequantize(torch.float32)


def _convert(
    module: str,
    parts: dict[str, torch.Tensor],
    scheme: IntScheme,
    layers: dict[str, tuple[str, nn.Module]],
    experts: dict[str, IntExperts],
    projections: dict[str, tuple[str, int]],
    perms: dict[str, torch.Tensor | None],
) -> Iterator[tuple[str, torch.Tensor]]:
    expert = _EXPERT.fullmatch(module)
    if expert is not None and expert.group(1) in experts:
        where = projections.get(expert.group(3))
        if where is None:
            raise ModelLoadError(
                f"{module}: not an expert projection of this model ({', '.join(projections)})"
            )
        yield from _packed_expert(
            module, parts, scheme, experts[expert.group(1)], int(expert.group(2)), where
        )
        return
    if module not in layers:
        yield f"{module}.weight", dequantized(module, parts, scheme)
        return
    target, layer = layers[module]
    if isinstance(layer, Int8Linear):
        weight, scale = _int8(module, parts)
        yield f"{module}.weight", weight
        yield f"{module}.weight_scale", scale
        return
    packed, scale, zero, perm = kernel_layout(canonical(module, parts, scheme), module)
    if target in perms:
        first = perms[target]
        same = first is None if perm is None else first is not None and torch.equal(first, perm)
        if not same:
            raise ModelLoadError(
                f"{module}: its act-order column order differs from the other projections fused into "
                f"{target}; such checkpoints are not supported on the GPU yet"
            )
    else:
        perms[target] = perm
        if perm is not None:
            assert isinstance(layer, WeightOnlyIntLinear) and layer.input_perm is not None
            layer.input_perm.copy_(perm)  # a buffer: set here, the loader copies parameters only
    yield f"{module}.packed_weight", packed
    yield f"{module}.group_scale", scale
    if scheme.symmetric:
        expected = float(1 << (scheme.bits - 1))
        if not bool((zero == expected).all()):
            raise ModelLoadError(f"{module}: a symmetric scheme with zero points other than {expected:g}")
    else:
        yield f"{module}.group_zero", zero
