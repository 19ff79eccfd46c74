"""The quantization pass: FP8 linear layers put into a built model from outside, as tensor parallelism is.

quantize_model replaces every nn.Linear but the LM head (and those a model keeps in the compute dtype,
its `unquantized_linear`: a MoE router; for FP8 also its `fp8_unquantized_linear`: a hybrid's Gated
DeltaNet b / a projections and vision tower) with an Fp8Linear of the same shape (on the
meta device when the model is shape-only, else holding the linear's weights quantized), then lets the
kernels that produce those layers' inputs quantize their outputs themselves. A model declares which
modules those are, per decoder layer, as `linear_input_producers` (producer -> the linear layers that
read its output; models/llama.py, models/qwen3_next.py); a producer with an `fp8_output` flag
(RMSNorm, OffsetRMSNorm, SiluAndMul) then returns a QuantizedActivation, when every one of those
layers present is an Fp8Linear. Where the output also feeds modules kept in the compute dtype (the
model's `dense_input_readers`: a hybrid's router, its bf16 b / a projections), the QuantizedActivation
carries the unquantized output too (OffsetRMSNorm's dense_output), or the producer is not fused.
Inputs nobody produces quantized (the attention output before o_proj) are quantized by the Fp8Linear
itself.

Stacked MoE experts (layers/moe.py) are not nn.Linear: they are e4m3 from the start and each expert
tensor is quantized per row as it loads (an FP8 checkpoint's dequantized with its scales first,
quant/checkpoint.py), so the compute-dtype stack, twice the bytes, is never held: MoE experts are most
of a model's weights (GLM-4.5-Air's 200 GB in bf16, more than an H200 holds; Qwen3-Next-80B's ~150
GiB, where its FP8 weights fit one). A model that says `experts_fp8_at_load = False` (gpt-oss) loads
them in the compute dtype instead and quantize_experts turns them into e4m3 with per-row scales once
every weight is in (the same bytes).

Integer-weight checkpoints (quant/int_scheme.py) get WeightOnlyIntLinear / Int8Linear layers
(quant/int_linear.py) in place of the same nn.Linear layers when the model runs on a GPU, and their
stacked experts become IntExperts (quant/int_moe.py: packed W4A16/W8A16 grouped GEMMs), except for
act-order or W8A8 checkpoints, whose experts load dequantized to the compute dtype. On the CPU the
linears stay nn.Linear and the experts Experts, all loaded dequantized (the plain-torch path); so on a
GPU too for a weight-only scheme chosen dense (IntScheme.dense, the int_weights option: bf16 GEMMs at
large batches), while a W8A8 scheme keeps its Int8Linear layers on a GPU whatever that option says.
"""

from __future__ import annotations

from typing import Protocol, cast, runtime_checkable

import torch
from torch import nn

from overnight.quant.int_linear import Int8Linear, WeightOnlyIntLinear
from overnight.quant.int_moe import IntExperts
from overnight.quant.int_scheme import IntScheme
from overnight.quant.linear import Fp8Linear
from overnight.quant.scheme import QuantScheme, module_matches

# Integer-weight linears on the CPU: False dequantizes them at load (fast plain matmuls); tests set
# True to run the packed layers' reference path there.
PACKED_INT_ON_CPU = False

LM_HEAD = "lm_head"  # stays in the compute dtype, as do the embeddings (not nn.Linear)


def checkpoint_modules(name: str, mapping: dict[str, tuple[str, str | int]]) -> list[str]:
    """The checkpoint projections fused into module `name` (q/k/v_proj for qkv_proj), or [name]."""
    prefix, _, leaf = name.rpartition(".")
    parts = [src for src, (fused, _) in mapping.items() if fused == leaf]
    return [f"{prefix}.{src}" if prefix else src for src in parts] or [name]


def quantized_checkpoint_modules(model: nn.Module) -> dict[str, int | None]:
    """Checkpoint module name -> the block_k of the Fp8Linear it loads into (None: per channel)."""
    mapping = getattr(model, "packed_modules_mapping", {})
    return {
        ckpt: module.block_k
        for name, module in model.named_modules()
        if isinstance(module, Fp8Linear)
        for ckpt in checkpoint_modules(name, mapping)
    }


def int_checkpoint_modules(model: nn.Module) -> dict[str, tuple[str, nn.Module]]:
    """Checkpoint module name -> (the model's module name, its int layer) for every integer layer."""
    mapping = getattr(model, "packed_modules_mapping", {})
    return {
        ckpt: (name, module)
        for name, module in model.named_modules()
        if isinstance(module, (WeightOnlyIntLinear, Int8Linear))
        for ckpt in checkpoint_modules(name, mapping)
    }


def ignored(model: nn.Module, scheme: QuantScheme | IntScheme, module: str) -> bool:
    """Whether the scheme's ignore list names checkpoint module `module` (a model name) under any name
    the model's checkpoints give it (its `checkpoint_names`: an image model's text layers are
    model.layers.* here but model.language_model.* in transformers 5's checkpoints)."""
    names = getattr(model, "checkpoint_names", None)
    return scheme.ignores(*(names(module) if names is not None else (module,)))


def keeps_int_packed(device: torch.device | str, scheme: IntScheme | None = None) -> bool:
    """Whether an integer checkpoint keeps packed layers on `device` (else: nn.Linear and float experts,
    dequantized at load): on a GPU, unless its scheme was chosen dense (the int_weights option)."""
    if scheme is not None and scheme.dense:
        return False
    return torch.device(device).type != "cpu" or PACKED_INT_ON_CPU


def _set_module(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, module)


def quantize_model(
    model: nn.Module, scheme: QuantScheme | IntScheme, device: torch.device | str = "meta"
) -> nn.Module:
    """Make `model`'s linear layers FP8 or integer in place (see the module docstring) and return it;
    device: where the model will run. A fused layer stays in the compute dtype only when the scheme
    ignores every checkpoint part of it."""
    if isinstance(scheme, IntScheme) and not keeps_int_packed(device, scheme):
        return model
    for name, linear, quantized in linear_forms(model, scheme):
        if quantized:
            _set_module(model, name, _quantized(linear, scheme))
    if isinstance(scheme, IntScheme):
        _int_experts(model, scheme)
    elif experts_fp8_at_load(model):  # e4m3 from the start, quantized as they load (layers/moe.py)
        for module in model.modules():
            if isinstance(module, QuantizedAfterLoad):
                module.store_fp8_()
    _set_producers(model, True)
    return model


def linear_forms(model: nn.Module, scheme: QuantScheme | IntScheme) -> list[tuple[str, nn.Linear, bool]]:
    """(name, layer, whether the scheme quantizes it) for every nn.Linear a quantized format covers: all
    but the LM head and those the model keeps in the compute dtype (`unquantized_linear`, for FP8 also
    `fp8_unquantized_linear`). False: the checkpoint's ignore list names every checkpoint part of it.
    quantize_model and the pre-load memory estimate (loader/fit.py) both decide by this."""
    mapping = getattr(model, "packed_modules_mapping", {})
    kept = getattr(model, "unquantized_linear", ())
    if isinstance(scheme, QuantScheme):  # what FP8 keeps besides (a hybrid's small DeltaNet projections)
        kept = (*kept, *getattr(model, "fp8_unquantized_linear", ()))
    forms = []
    for name, module in model.named_modules():
        if type(module) is not nn.Linear or name.rpartition(".")[2] == LM_HEAD or module_matches(name, kept):
            continue
        dense = all(ignored(model, scheme, part) for part in checkpoint_modules(name, mapping))
        forms.append((name, module, not dense))
    return forms


def int_experts_forms(model: nn.Module, scheme: IntScheme) -> list[tuple[str, nn.Module, bool]]:
    """(name, stack, whether it becomes IntExperts) for every stack of experts whose sizes the packed
    kernels take (packs_experts); False: the ignore list names its experts."""
    forms = []
    for name, module in model.named_modules():
        if not isinstance(module, QuantizedAfterLoad):
            continue
        if not getattr(getattr(module, "activation", None), "gated", True):
            continue  # ungated experts (Nemotron-H's relu^2): the packed kernels are gated; loaded dequantized
        _, two_i, hidden = module.gate_up_proj.shape  # type: ignore[attr-defined]
        if packs_experts(scheme, hidden, two_i // 2):
            forms.append((name, cast(nn.Module, module), not ignored(model, scheme, f"{name}.0.gate_proj")))
    return forms


def experts_fp8_at_load(model: nn.Module | type) -> bool:
    """Whether a model (class) holds its FP8 experts as e4m3 while loading, rather than in the compute
    dtype until quantize_experts: every model but one that sets `experts_fp8_at_load = False`."""
    return bool(getattr(model, "experts_fp8_at_load", True))


def _int_experts(model: nn.Module, scheme: IntScheme) -> None:
    """Replace each stack of experts (layers/moe.py's Experts) by IntExperts where the kernels take the
    checkpoint's layout: weight-only, no act-order, groups of a multiple of 16 dividing both sizes."""
    for name, stack, packed in int_experts_forms(model, scheme):
        if packed:
            _set_module(
                model, name, IntExperts.replacing(stack, scheme.bits, scheme.group_size, scheme.symmetric)
            )


def packs_experts(scheme: IntScheme, hidden_size: int, intermediate_size: int) -> bool:
    """Whether experts of these sizes become IntExperts (_int_experts): weight-only, no act-order, and
    groups the kernels take (a multiple of 16 dividing both sizes; channel-wise: sizes of 16s)."""
    if scheme.int8_activations or scheme.act_order:
        return False
    sizes, group = (hidden_size, intermediate_size), scheme.group_size
    if group is None:
        return all(s % 16 == 0 for s in sizes)
    return group % 16 == 0 and all(s % group == 0 for s in sizes)


def int_experts_modules(model: nn.Module) -> dict[str, IntExperts]:
    return {name: module for name, module in model.named_modules() if isinstance(module, IntExperts)}


def _quantized(linear: nn.Linear, scheme: QuantScheme | IntScheme) -> nn.Module:
    if isinstance(scheme, QuantScheme):
        return Fp8Linear.replacing(linear, scheme.block_k)
    if scheme.int8_activations:
        return Int8Linear.replacing(linear)
    return WeightOnlyIntLinear.replacing(
        linear, scheme.bits, scheme.group_size, scheme.symmetric, scheme.act_order
    )


@runtime_checkable
class QuantizedAfterLoad(Protocol):
    """A module whose weights load in the compute dtype and become FP8 once loaded (layers/moe.py's
    Experts: quant/ cannot import layers/, which imports quant/)."""

    def quantize_fp8_(self) -> None: ...

    def store_fp8_(self) -> None: ...

    def dequantize_(self) -> None: ...


def quantize_experts(model: nn.Module) -> None:
    """Quantize every loaded stack of experts to FP8 (Experts.quantize_fp8_), then give the float
    copies' memory back to the device, so the KV pool sized after loading can use it."""
    experts = [m for m in model.modules() if isinstance(m, QuantizedAfterLoad)]
    for module in experts:
        module.quantize_fp8_()
    if experts and torch.cuda.is_available():
        torch.cuda.empty_cache()


@torch.no_grad()
def dequantize_model(model: nn.Module) -> nn.Module:
    """The inverse, for comparisons: every Fp8Linear (or integer layer) becomes an nn.Linear holding its
    dequantized weight in the compute dtype, and producers return plain tensors again."""
    for name, module in list(model.named_modules()):
        if type(module) not in (Fp8Linear, WeightOnlyIntLinear, Int8Linear):
            continue
        dense = nn.Linear(
            module.in_features,
            module.out_features,
            bias=module.bias is not None,
            device=next(module.parameters()).device,
            dtype=module.out_dtype,
        ).requires_grad_(False)
        dense.weight.copy_(module.dequantized_weight())
        if module.bias is not None:
            dense.bias.copy_(module.bias)
        _set_module(model, name, dense)
    for name, module in list(model.named_modules()):
        if isinstance(module, IntExperts):
            gate_up, down = module.dequantized(module.compute_dtype)
            with torch.device(gate_up.device):
                stack = module.dense_type(module.num_experts, module.hidden_size, module.intermediate_size)
            stack.gate_up_proj = nn.Parameter(gate_up, requires_grad=False)
            stack.down_proj = nn.Parameter(down, requires_grad=False)
            _set_module(model, name, stack)
    for experts in model.modules():
        if isinstance(experts, QuantizedAfterLoad):
            experts.dequantize_()
    _set_producers(model, False)
    return model


def _set_producers(model: nn.Module, on: bool) -> None:
    """Set fp8_output on each declared producer whose consumers are all Fp8Linear (or clear it); and
    dense_output where the model also declares readers of the output in the compute dtype
    (`dense_input_readers`, read through quant/fp8.dense_input) and one is present in the block."""
    producers: dict[str, str | tuple[str, ...]] = getattr(model, "linear_input_producers", {})
    readers: dict[str, tuple[str, ...]] = getattr(model, "dense_input_readers", {})
    for _, block in model.named_modules():
        for producer_name, consumer_names in producers.items():
            producer = _submodule(block, producer_name)
            if producer is None or not hasattr(producer, "fp8_output"):
                continue
            names = (consumer_names,) if isinstance(consumer_names, str) else consumer_names
            consumers = [c for c in (_submodule(block, name) for name in names) if c is not None]
            dense = any(_submodule(block, name) is not None for name in readers.get(producer_name, ()))
            fp8 = on and bool(consumers) and all(isinstance(c, Fp8Linear) for c in consumers)
            if dense and fp8 and not hasattr(producer, "dense_output"):
                fp8 = False  # a producer that cannot hand over both forms
            setattr(producer, "fp8_output", fp8)  # noqa: B010 (a flag of some producer classes)
            if hasattr(producer, "dense_output"):
                setattr(producer, "dense_output", fp8 and dense)  # noqa: B010


def _submodule(block: nn.Module, name: str) -> nn.Module | None:
    try:
        return block.get_submodule(name)
    except AttributeError:
        return None
