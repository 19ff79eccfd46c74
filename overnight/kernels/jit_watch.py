"""Which Triton kernels compile, and when.

Triton compiles a kernel once per specialization (the constexprs, and for plain integer arguments
whether they equal 1 or are multiples of 16). A variant first met in the middle of a long run costs
about a second of host time while the GPU waits; bench throughput counts them in its timed run,
bench/profile_gpu.py names them, and the engine logs them after start-up, so a kernel that should not
specialize on a per-step count is found.

Both watchers use Triton's jit_cache_hook (called with keyword arguments before every compile, or load
from its disk cache); a hook installed before ours keeps running, and its answer is returned (a true
one tells Triton to skip the compile).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

# Kernel name -> the arguments of its first variant seen in this process: a later variant is reported
# by what differs from it, which names the argument that specializes.
_FIRST_ARGS: dict[str, list[str]] = {}


def _variant(kwargs: dict[str, Any]) -> tuple[str, list[str]]:
    """("name", ["[options]", "arg: type", "CONST=value", ...]) of the variant a hook call compiles.

    The arguments come from the call's `compile` record (its signature, constexpr values and
    specialization attributes), not from Triton's repr, whose argument list Triton 3.6 builds from a
    character of the cache key ("x_ptr: (" whatever the arguments): every variant would read alike."""
    repr_ = kwargs["repr"]  # "name[options](...)"
    name = repr_.split("[", 1)[0].split("(", 1)[0]
    options = repr_[repr_.find("[") : repr_.find("]") + 1] if "[" in repr_ else ""
    record = kwargs.get("compile") or {}
    signature: dict[str, str] = record.get("signature") or {}
    constants: dict[tuple[int, ...], Any] = record.get("constants") or {}
    attrs: dict[tuple[int, ...], Any] = (record.get("configs") or [{}])[0]
    args = [options]
    for i, (arg, ty) in enumerate(signature.items()):
        if (i,) in constants:
            args.append(f"{arg}={constants[(i,)]}")
        else:  # D: divisible by 16 (an integer's value, a pointer's address)
            args.append(f"{arg}: {ty}{'D' if attrs.get((i,)) else ''}")
    return name, args


def describe(name: str, args: list[str]) -> str:
    """A compile in one line: "name(a: i32 -> i32D, ...)", what differs from the kernel's first variant
    (its options, an argument's type or divisibility, a constexpr's value), or with none seen yet
    "name(every argument)", options left out. "name(same)": identical to the first variant, which
    compiles again in a new process or on another device."""
    first = _FIRST_ARGS.get(name)
    if first is None or len(first) != len(args):
        return f"{name}({', '.join(args[1:])})"
    changed = [f"{a} -> {b.split(': ', 1)[-1] if ': ' in a else b}" for a, b in zip(first, args) if a != b]
    return f"{name}({', '.join(changed) or 'same'})"


def _install(on_compile: Callable[[str, list[str]], None]) -> Callable[[], None]:
    """Call on_compile(name, args) before each compile; returns the function that takes the hook out."""
    import triton

    runtime = triton.knobs.runtime
    previous = runtime.jit_cache_hook

    def hook(**kwargs: Any) -> bool | None:
        name, args = _variant(kwargs)
        on_compile(name, args)
        _FIRST_ARGS.setdefault(name, args)
        return previous(**kwargs) if previous is not None else None

    runtime.jit_cache_hook = hook

    def remove() -> None:
        if runtime.jit_cache_hook is hook:
            runtime.jit_cache_hook = previous

    return remove


_REMEMBERING: list[Callable[[], None]] = []


def remember_compiles() -> None:
    """From now on, remember each kernel's first variant (once per process), so that a later variant
    is described by the arguments that changed. Call before the first kernel runs."""
    if not _REMEMBERING:
        _REMEMBERING.append(_install(lambda _name, _args: None))


@contextmanager
def watch_compiles() -> Iterator[list[str]]:
    """Yield a list that collects one line per kernel variant compiled inside the block: describe()'s
    line (the kernel's name and what differs from its first variant)."""
    compiled: list[str] = []
    remove = _install(lambda name, args: compiled.append(describe(name, args)))
    try:
        yield compiled
    finally:
        remove()


_LOGGING: dict[str, Callable[[], None]] = {}  # logger name -> its hook's remover: one hook per logger


def log_compiles_after_startup(log: logging.Logger) -> Callable[[], None]:
    """From now on, log every Triton compile: the first variant of a kernel at INFO (a feature used for
    the first time compiles once), any further variant of the same kernel as a WARNING (a value that
    changes from step to step is specializing it: each such compile stalls a running job for about a
    second). Returns the function that removes the hook. A process that builds several engines logs
    through one hook per logger, not one per engine (which would repeat every line)."""
    if log.name in _LOGGING:
        return _LOGGING[log.name]
    variants: dict[str, int] = {}

    def on_compile(name: str, args: list[str]) -> None:
        variants[name] = variants.get(name, 0) + 1
        if variants[name] == 1:
            log.info("Triton compiled %s (first use since start-up)", name)
        else:
            log.warning(
                "Triton compiled variant %d of %s during the run: each costs about a second with the GPU "
                "idle; a per-step value is specializing it: %s",
                variants[name],
                name,
                describe(name, args)[:600],
            )

    remove_hook = _install(on_compile)

    def remove() -> None:
        _LOGGING.pop(log.name, None)
        remove_hook()

    _LOGGING[log.name] = remove
    return remove
