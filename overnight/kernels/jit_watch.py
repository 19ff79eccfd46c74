"""Which Triton kernels compile while a block of code runs.

Triton compiles a kernel once per specialization (the constexprs, and for plain integer arguments
whether they equal 1 or are multiples of 16). A variant first met in the middle of a long run costs
about a second of host time while the GPU waits; bench throughput counts them in its timed run, and
bench/profile_gpu.py names them, so a kernel that should not specialize on a per-step count is found.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def watch_compiles() -> Iterator[list[str]]:
    """Yield a list that collects one line per kernel variant compiled (or loaded from Triton's disk
    cache) inside the block: the kernel's name and its arguments' specialization."""
    import triton

    runtime = triton.knobs.runtime
    previous = runtime.jit_cache_hook
    compiled: list[str] = []

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002 (Triton's names)
        compiled.append(repr)
        return (
            previous(  # a hook installed before ours still runs (a true result skips the compile)
                key=key,
                repr=repr,
                fn=fn,
                compile=compile,
                is_manual_warmup=is_manual_warmup,
                already_compiled=already_compiled,
            )
            if previous is not None
            else None
        )

    runtime.jit_cache_hook = hook
    try:
        yield compiled
    finally:
        runtime.jit_cache_hook = previous


def log_compiles_after_startup(log: logging.Logger) -> Callable[[], None]:
    """From now on, log every Triton compile: the first variant of a kernel at INFO (a feature used for
    the first time compiles once), any further variant of the same kernel as a WARNING (a value that
    changes from step to step is specializing it: each such compile stalls a running job for about a
    second). Returns the function that removes the hook (a hook installed before stays chained)."""
    import triton

    runtime = triton.knobs.runtime
    previous = runtime.jit_cache_hook
    variants: dict[str, int] = {}

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002 (Triton's names)
        name = repr.split("[", 1)[0]
        variants[name] = variants.get(name, 0) + 1
        if variants[name] == 1:
            log.info("Triton compiled %s (first use since start-up)", name)
        else:
            log.warning(
                "Triton compiled variant %d of %s during the run: each costs about a second with the GPU "
                "idle; a per-step value is specializing it (%s)",
                variants[name],
                name,
                repr[:300],
            )
        if previous is None:
            return None
        return previous(
            key=key,
            repr=repr,
            fn=fn,
            compile=compile,
            is_manual_warmup=is_manual_warmup,
            already_compiled=already_compiled,
        )

    runtime.jit_cache_hook = hook

    def remove() -> None:
        if runtime.jit_cache_hook is hook:
            runtime.jit_cache_hook = previous

    return remove
