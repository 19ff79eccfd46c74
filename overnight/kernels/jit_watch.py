"""Which Triton kernels compile while a block of code runs.

Triton compiles a kernel once per specialization (the constexprs, and for plain integer arguments
whether they equal 1 or are multiples of 16). A variant first met in the middle of a long run costs
about a second of host time while the GPU waits; bench throughput counts them in its timed run, and
bench/profile_gpu.py names them, so a kernel that should not specialize on a per-step count is found.
"""

from __future__ import annotations

from collections.abc import Iterator
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
