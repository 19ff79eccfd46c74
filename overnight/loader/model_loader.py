"""Build the model for a ModelSource and fill its weights: safetensors, GGUF (dequantized) or random.

A source with a quantization scheme gets its FP8 layers when it is built (quant/apply.py, on the meta
device), and its checkpoint tensors converted to their layout as they stream in (quant/checkpoint.py);
stacked MoE experts load in the compute dtype and are quantized once loaded (quantize_experts).
Integer checkpoints (AWQ, GPTQ, compressed-tensors int) likewise: packed integer layers (and experts,
quant/int_moe.py) on a GPU, everything dequantized at load on the CPU and, when the int_weights option
chose so (loader/int_form.py), on a GPU too (quant/int_checkpoint.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from overnight.errors import ModelLoadError
from overnight.layers.rotary import RotaryEmbedding
from overnight.loader.dummy import init_dummy_weights
from overnight.loader.expert_form import check_expert_form_device
from overnight.loader.hf import iter_safetensors
from overnight.loader.source import ModelSource
from overnight.models.interface import LoadsWeights, finish_loading
from overnight.models.registry import model_class_for
from overnight.models.vision.interface import TOWER_CHECKPOINT_PREFIXES
from overnight.quant.apply import quantize_experts, quantize_model
from overnight.quant.scheme import QuantScheme, check_fp8_device

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}
_HALF_DTYPES = (torch.bfloat16, torch.float16)


def resolve_dtype(dtype: str | torch.dtype, source: ModelSource, device: torch.device | str) -> torch.dtype:
    """The compute dtype. "auto": float32 on the CPU; on CUDA the checkpoint's own dtype when it is
    bf16/fp16, else bfloat16."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPE_NAMES.values():
            raise ModelLoadError(f"unsupported dtype {dtype}; use bfloat16, float16 or float32")
        return dtype
    name = dtype.lower().removeprefix("torch.")
    if name != "auto":
        if name not in _DTYPE_NAMES:
            raise ModelLoadError(f"unsupported dtype {dtype!r}; use auto, bfloat16, float16 or float32")
        return _DTYPE_NAMES[name]
    if torch.device(device).type == "cpu":
        return torch.float32
    checkpoint = _DTYPE_NAMES.get(str(source.config_dtype).lower().removeprefix("torch."))
    return checkpoint if checkpoint in _HALF_DTYPES else torch.bfloat16


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(
    source: ModelSource,
    dtype: torch.dtype,
    device: torch.device | str,
    runner: str = "generate",
    runs_on: torch.device | str | None = None,
) -> nn.Module:
    """The model in `dtype` on `device` with *uninitialized* weights (the caller fills every one); a
    decoder run for pooling comes without its LM head (models/for_pooling.py).

    Built on the meta device and then given storage on `device`: a large model never passes through
    host memory, and no time goes into random init that loading would overwrite. device="meta" gives
    a shape-only model. runs_on: where a shape-only model will run (it decides the form of integer
    layers: packed, or dequantized on the CPU); `device` when not given.
    """
    cls = model_class_for(source.arch)
    with _default_dtype(dtype), torch.device("meta"):
        model = cls(source.arch)
        if source.quantization is not None:
            quantize_model(model, source.quantization, device if runs_on is None else runs_on)
        if runner == "pooling" and not source.arch.is_encoder:  # a classifier's head built here too
            from overnight.models.for_pooling import DecoderForPooling

            model = DecoderForPooling(model, source.lm_head_classifier)
    if torch.device(device).type == "meta":
        return model
    if isinstance(source.quantization, QuantScheme):
        check_fp8_device(device, source.quantization)
    check_expert_form_device(source.arch, device)
    _materialize(model, device)
    return model


def _materialize(model: nn.Module, device: torch.device | str) -> None:
    """Give a meta model storage on `device`, keeping shared parameters (tied embeddings) shared and
    recomputing the rotary tables."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append((module, name))
    model.to_empty(device=device)  # replaces each owner's parameter with a separate new one
    for (first, first_name), *others in owners.values():
        for module, name in others:
            setattr(module, name, getattr(first, first_name))
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_table()


def load_model(
    source: ModelSource,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int = 0,
    runner: str = "generate",
) -> nn.Module:
    """The model of `source`, weights loaded, in eval mode, in `dtype` on `device`, without autograd. A
    decoder is a CausalLM (models/interface.as_causal_lm), an encoder its own class (encoder/runner.py)."""
    model = build_model(source, dtype, device, runner)
    if source.kind == "dummy":
        init_dummy_weights(model, seed)
    elif isinstance(model, LoadsWeights):
        model.load_weights(checkpoint_weights(source, model, device))
    else:
        raise TypeError(f"{type(model).__name__} has no load_weights (models/interface.py)")
    finish_loading(model)
    if isinstance(source.quantization, QuantScheme):
        quantize_experts(model)
    return model.requires_grad_(False).eval()


def checkpoint_weights(
    source: ModelSource, model: nn.Module, device: torch.device | str
) -> Iterable[tuple[str, torch.Tensor]]:
    """The (HF name, tensor) stream of a safetensors or GGUF source, FP8 layers' tensors already in
    their layout (model: the built model, possibly sharded; only its module names and layouts count)."""
    if source.kind == "hf":
        # A text-only run (ModelArch.text_only) never reads the tower's tensors; its model has no place
        # for them, so load_weights would refuse them as unexpected.
        skip = TOWER_CHECKPOINT_PREFIXES if source.arch.text_only else ()
        weights: Iterable[tuple[str, torch.Tensor]] = iter_safetensors(source.path, device, skip)
    elif source.kind == "gguf":
        from overnight.loader.gguf import iter_gguf_weights  # written alongside; imported on use

        weights = iter_gguf_weights(source.path)
    else:
        raise ModelLoadError(f"unknown model source kind {source.kind!r}")
    # A family whose checkpoints name tensors their own way (Mixtral's experts, Mistral 3's text model
    # under a vision tower) renames them first, so FP8 conversion and tensor-parallel slicing see the
    # names of the other families.
    rename = getattr(model, "rename_checkpoint", None)
    if rename is not None:
        weights = rename(weights)
    if isinstance(source.quantization, QuantScheme):
        from overnight.quant.checkpoint import fp8_checkpoint_weights

        weights = fp8_checkpoint_weights(weights, model, source.quantization)
    elif source.quantization is not None:
        from overnight.quant.int_checkpoint import int_checkpoint_weights

        weights = int_checkpoint_weights(weights, model, source.quantization)
    return weights
