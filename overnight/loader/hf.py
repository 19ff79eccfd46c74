"""Reading HF safetensors checkpoints: one file, or shards listed in model.safetensors.index.json."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch
from safetensors import SafetensorError, safe_open

from overnight.errors import ModelLoadError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")


def safetensors_files(folder: str) -> list[str]:
    """The checkpoint's weight files in load order; [] when the folder holds none."""
    index = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"cannot read the shard index {index}: {e}") from None
        files = [os.path.join(folder, name) for name in sorted(set(weight_map.values()))]
        absent = [p for p in files if not os.path.isfile(p)]
        if absent:
            raise ModelLoadError(f"shard listed in {index} not found: {', '.join(absent)}")
        return files
    single = os.path.join(folder, SINGLE_FILE)
    if os.path.isfile(single):
        return [single]
    return sorted(os.path.join(folder, name) for name in os.listdir(folder) if name.endswith(".safetensors"))


def pickle_files(folder: str) -> list[str]:
    return sorted(name for name in os.listdir(folder) if name.endswith(PICKLE_SUFFIXES))


def _safetensors_device(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)


def iter_safetensors(
    folder: str, device: torch.device | str = "cpu", skip: tuple[str, ...] = ()
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of the checkpoint, read straight onto `device`, except those
    whose names start with one of `skip` (never read: a text-only run's vision tower).

    A file that is truncated or not safetensors raises ModelLoadError naming it.
    """
    files = safetensors_files(folder)
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {folder}")
    target = _safetensors_device(device)
    for path in files:
        try:
            with safe_open(path, framework="pt", device=target) as f:
                names = list(f.keys())
                for name in names:
                    if skip and name.startswith(skip):
                        continue
                    tensor = f.get_tensor(name)
                    yield name, tensor
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"cannot read weights file {path} (corrupt or truncated?): {e}") from None
