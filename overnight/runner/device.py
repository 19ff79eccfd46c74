"""Which device the engine runs on, and how much memory it has (no CUDA context is created: only counted
and queried)."""

from __future__ import annotations

import torch

from overnight.errors import ConfigError


def pick_device(requested: str | None) -> torch.device:
    """The device option resolved: CUDA when available unless one is named."""
    if requested:
        device = torch.device(requested)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(
                f"device {requested!r} asked for, but this machine has no CUDA GPU: use --device cpu"
            )
        return device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def device_memory_gib(device: torch.device) -> float | None:
    """Total memory of a CUDA device in GiB; None for the CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory / 2**30
