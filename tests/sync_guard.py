"""A CPU stand-in for CUDA-graph capture: fail on the host syncs and data-dependent shapes that a
captured decode step may not contain.

On the GPU a decode step is captured once and replayed (runner/cuda_graph.py), so a model's forward
must not read tensor values on the host (.item(), .tolist(), bool(t), int(t), .cpu(), .numpy()) nor
make shapes from them (nonzero, unique, masked_select, repeat_interleave by a tensor without
output_size, bincount). Boolean-mask indexing is not caught: patching Tensor.__getitem__ gives the type
a sequence slot that deleting the patch leaves behind, after which torch treats 0-d tensors as
sequences (torch.tensor([t0, t1]) calls len() on them) in every later test of the process. On the CPU none of these fail, so `no_host_syncs()` patches them to raise
when the nearest caller among our code is a model, layer or kernel wrapper. Calls made by the Triton
interpreter (which copies kernel arguments through numpy) and by the CPU attention backend (a test
stand-in; the GPU backends are captured on their own, tests/test_cuda_graph*.py) pass.

Use with dispatch.FORCE_KERNELS = True, so every layer takes the path it takes on the GPU.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

import overnight

_OURS = os.path.dirname(os.path.abspath(overnight.__file__)) + os.sep
_TRITON = os.sep + "triton" + os.sep
# Our code that may sync: the CPU attention backend, a test stand-in for the captured GPU backends.
_EXEMPT = (os.path.join(_OURS, "attention", "torch_backend.py"),)


class HostSync(AssertionError):
    pass


def _culprit() -> str | None:
    """file:line of the nearest caller that is our code and not exempt; None when the nearest of our
    code and Triton is Triton's, or exempt, or there is none."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if _TRITON in name:
            return None
        if name.startswith(_OURS):
            return None if name in _EXEMPT else f"{name[len(_OURS) :]}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return None


def _guard(what: str, original: Callable[..., Any], when: Callable[..., bool] | None = None) -> Callable:
    def guarded(*args: Any, **kwargs: Any) -> Any:
        if when is None or when(*args, **kwargs):
            where = _culprit()
            if where is not None:
                raise HostSync(f"{what} at overnight/{where}: a host sync or data-dependent shape")
        return original(*args, **kwargs)

    return guarded


def _tensor_repeats(repeats: Any, kwargs: dict[str, Any]) -> bool:
    return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None


@contextlib.contextmanager
def no_host_syncs() -> Iterator[None]:
    T = torch.Tensor
    patches: list[tuple[Any, str, Callable[..., Any] | None]] = [
        (T, "item", None),
        (T, "tolist", None),
        (T, "__bool__", None),
        (T, "__int__", None),
        (T, "__float__", None),
        (T, "__index__", None),
        (T, "cpu", None),
        (T, "numpy", None),
        (T, "nonzero", None),
        (T, "unique", None),
        (T, "masked_select", None),
        (T, "argwhere", None),
        (T, "bincount", None),
        (T, "repeat_interleave", lambda self, repeats=None, *a, **k: _tensor_repeats(repeats, k)),
        (torch, "nonzero", None),
        (torch, "unique", None),
        (torch, "masked_select", None),
        (torch, "argwhere", None),
        (torch, "bincount", None),
        (torch, "repeat_interleave", lambda x, repeats=None, *a, **k: _tensor_repeats(repeats, k)),
    ]
    # What each owner itself defines (vars, not getattr): many of Tensor's methods are inherited from
    # torch._C.TensorBase, and setting the inherited one back on Tensor would change the type's slots
    # (len() and indexing of 0-d tensors broke in later tests). Those are deleted again instead.
    missing = object()
    saved = [(owner, name, vars(owner).get(name, missing)) for owner, name, _ in patches]
    try:
        for owner, name, when in patches:
            setattr(
                owner, name, _guard(f"{getattr(owner, '__name__', owner)}.{name}", getattr(owner, name), when)
            )
        yield
    finally:
        for owner, name, original in saved:
            if original is missing:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
