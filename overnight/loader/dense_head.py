"""The sentence-transformers Dense layers of an embedding model (PoolerConfig.dense, read by
loader/pooling_config.py), loaded for the encoder runner: each folder's linear.weight (and linear.bias)
from model.safetensors, or from pytorch_model.bin (read with weights_only: tensors, never code).

They run on the pooled fp32 vectors, in fp32 (a few rows per batch: nothing to save), before the
Matryoshka cut and normalization, as sentence-transformers orders its modules.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from overnight.config import DenseLayer
from overnight.errors import ModelLoadError
from overnight.loader.hf import iter_safetensors, safetensors_files


class DenseHead:
    def __init__(self, layers: list[tuple[torch.Tensor, torch.Tensor | None, str]]) -> None:
        self.layers = layers  # (weight [out, in], bias [out] or None, activation), fp32 on the device

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        for weight, bias, activation in self.layers:
            rows = F.linear(rows, weight, bias)
            if activation == "tanh":
                rows = torch.tanh(rows)
        return rows


def load_dense_head(layers: tuple[DenseLayer, ...], device: torch.device) -> DenseHead | None:
    """None when the model has no Dense layers; ModelLoadError for missing or misshapen weights."""
    if not layers:
        return None
    loaded = []
    for layer in layers:
        tensors = _read(layer.folder)
        weight, bias = tensors.get("linear.weight"), tensors.get("linear.bias")
        if weight is None or tuple(weight.shape) != (layer.out_features, layer.in_features):
            shape = None if weight is None else tuple(weight.shape)
            raise ModelLoadError(
                f"{layer.folder}: linear.weight of shape ({layer.out_features}, {layer.in_features}) expected, "
                f"found {shape}"
            )
        if layer.bias and (bias is None or tuple(bias.shape) != (layer.out_features,)):
            raise ModelLoadError(f"{layer.folder}: linear.bias of {layer.out_features} values expected")
        loaded.append(
            (
                weight.to(device, torch.float32),
                bias.to(device, torch.float32) if layer.bias and bias is not None else None,
                layer.activation,
            )
        )
    return DenseHead(loaded)


def _read(folder: str) -> dict[str, torch.Tensor]:
    if safetensors_files(folder):
        return dict(iter_safetensors(folder))
    path = os.path.join(folder, "pytorch_model.bin")
    if not os.path.isfile(path):
        raise ModelLoadError(f"{folder}: no model.safetensors or pytorch_model.bin for the Dense layer")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a corrupt or non-tensor pickle
        raise ModelLoadError(f"cannot read {path}: {e}") from None
    return dict(state)
