"""Whether an input takes the Triton kernel path or the PyTorch reference: kernels on a CUDA tensor when
Triton imports, the reference elsewhere. FORCE_KERNELS overrides that for every input: tests set True to
run the kernels on the CPU through the Triton interpreter, or False to run the PyTorch path on a GPU.
Every layer with a kernel (norms, activations, rotary, FP8 linear, MoE) asks here, so one switch flips
them all."""

from __future__ import annotations

import functools

import torch

FORCE_KERNELS: bool | None = None


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_kernels(x: torch.Tensor) -> bool:
    """Whether the layers take their Triton kernel path for input x."""
    if FORCE_KERNELS is not None:
        return FORCE_KERNELS
    return x.is_cuda and _triton_importable()
