"""Per-step counts must not pick a Triton kernel variant: a variant first met mid-run compiles for about
a second while the GPU idles (the H200 profile of long-1024-1024 found 8 such compiles in one timed run).
Checked through Triton's own argument binder for sm_90, so no GPU is needed: every value a count can take
(0, 1, multiples of 16, others) must give the same specialization key."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.runtime.jit import JITFunction, create_function_from_signature

from overnight.kernels.fp8_gemm import _fp8_gemm_kernel
from overnight.kernels.moe_align import (
    _moe_align_atomic_count_kernel,
    _moe_align_atomic_finish_kernel,
    _moe_align_count_kernel,
    _moe_align_offsets_kernel,
    _moe_align_scatter_kernel,
)
from overnight.kernels.moe_gemm import _moe_gemm_kernel
from overnight.kernels.moe_router import _router_topk_kernel
from overnight.kernels.paged_prefill import _prefill_kernel

COUNT_VALUES = [0, 1, 16, 17, 512, 530, 16384]


def as_jit(kernel) -> JITFunction:
    """The compiled-mode function (the tests run under TRITON_INTERPRET, which wraps the kernel's Python
    function and keeps the decorator's arguments)."""
    if isinstance(kernel, JITFunction):
        return kernel
    keep = ("do_not_specialize", "do_not_specialize_on_alignment")
    return JITFunction(kernel.fn, **{k: v for k, v in kernel.kwargs.items() if k in keep})


def specialization(kernel, varying: dict[str, int]) -> list:
    """The specialization Triton would compile `kernel` for, with the named arguments set."""
    kernel = as_jit(kernel)
    binder = create_function_from_signature(
        kernel.signature, kernel.params, CUDABackend(GPUTarget("cuda", 90, 32))
    )
    buf = torch.zeros(64)
    args, kwargs = [], {}
    for p in kernel.params:
        if p.is_constexpr:
            kwargs[p.name] = 16
        elif p.name in varying:
            args.append(varying[p.name])
        elif "ptr" in p.name:
            args.append(buf)
        else:
            args.append(128)  # strides and fixed sizes: the same in every call here
    _, spec, _ = binder(*args, **kwargs)
    return spec


@triton.jit
def _specialized(x_ptr, n):  # a control: a plain count is specialized
    tl.store(x_ptr, n)


@pytest.mark.parametrize(
    "kernel,counts",
    [
        (_prefill_kernel, ["num_decodes", "num_prefills", "search_steps"]),
        (_router_topk_kernel, ["num_tokens"]),
        (_moe_align_count_kernel, ["num_pairs"]),
        (_moe_align_offsets_kernel, ["num_chunks", "num_pairs"]),
        (_moe_align_scatter_kernel, ["num_pairs"]),
        (_moe_align_atomic_count_kernel, ["num_pairs"]),
        (_moe_align_atomic_finish_kernel, ["num_pairs", "max_tiles"]),
        (_moe_gemm_kernel, ["num_pairs", "num_tiles_m"]),
        (_fp8_gemm_kernel, ["M"]),
    ],
    ids=lambda v: v.fn.__name__ if hasattr(v, "fn") else "-".join(v),
)
def test_step_counts_do_not_specialize(kernel, counts):
    keys = {str(specialization(kernel, {name: value for name in counts})) for value in COUNT_VALUES}
    assert len(keys) == 1, f"{kernel.fn.__name__}: {len(keys)} variants over counts {COUNT_VALUES}"


def test_control_plain_count_specializes():
    """The check above can fail: without do_not_specialize, 1, 16 and 17 are three variants."""
    keys = {str(specialization(_specialized, {"n": v})) for v in (1, 16, 17)}
    assert len(keys) == 3


def test_watch_compiles_collects_and_restores():
    from overnight.kernels.jit_watch import watch_compiles

    runtime = triton.knobs.runtime
    before: list[str] = []

    def earlier(**kw):  # a hook someone installed first keeps running, and its answer counts
        before.append(kw["repr"])
        return True

    runtime.jit_cache_hook = earlier
    try:
        with watch_compiles() as compiled:
            hook = runtime.jit_cache_hook
            kw = dict(key="k", fn=None, compile={}, is_manual_warmup=False, already_compiled=False)
            assert hook(repr="_prefill_kernel[num_warps=4](...)", **kw) is True
        assert compiled == ["_prefill_kernel(...)"] and before == ["_prefill_kernel[num_warps=4](...)"]
        assert runtime.jit_cache_hook is earlier
    finally:
        runtime.jit_cache_hook = None


def test_compiles_after_startup_are_logged(caplog):
    """A second variant of one kernel mid-run is a warning; a kernel's first use is only information."""
    import logging

    from overnight.kernels.jit_watch import log_compiles_after_startup

    log = logging.getLogger("overnight.test_jit")
    remove = log_compiles_after_startup(log)
    assert log_compiles_after_startup(log) is remove  # a second engine in the process adds no hook
    try:
        hook = triton.knobs.runtime.jit_cache_hook
        kw = dict(key="k", fn=None, compile={}, is_manual_warmup=False, already_compiled=False)
        with caplog.at_level(logging.INFO, logger="overnight.test_jit"):
            hook(repr="_prefill_kernel[num_warps=4](num_decodes: i32D)", **kw)
            hook(repr="_apply_token_bitmask_kernel[num_warps=4](...)", **kw)
            hook(repr="_prefill_kernel[num_warps=4](num_decodes: i32)", **kw)
        assert [r.levelname for r in caplog.records] == ["INFO", "INFO", "WARNING"]
        assert "variant 2 of _prefill_kernel" in caplog.records[-1].getMessage()
    finally:
        remove()
    assert triton.knobs.runtime.jit_cache_hook is None


def test_a_later_variant_is_described_by_what_changed():
    """The report of a mid-run compile names the argument whose specialization changed (Triton's own
    repr is mostly options and was cut before the arguments)."""
    from overnight.kernels import jit_watch

    jit_watch._FIRST_ARGS.pop("_step_kernel", None)
    kw = dict(key="k", fn=None, compile={}, is_manual_warmup=False, already_compiled=False)
    opts = "num_warps=4, num_ctas=1, num_stages=3, enable_fp_fusion=True, launch_cooperative_grid=False"
    try:
        with jit_watch.watch_compiles() as compiled:
            hook = triton.knobs.runtime.jit_cache_hook
            hook(repr=f"_step_kernel[{opts}](x_ptr: *fp32D, n: i32D, BLOCK: 64)", **kw)
            hook(repr=f"_step_kernel[{opts}](x_ptr: *fp32, n: i32D, BLOCK: 64)", **kw)
        assert compiled == [
            "_step_kernel(x_ptr: *fp32D, n: i32D, BLOCK: 64)",
            "_step_kernel(x_ptr: *fp32D -> *fp32)",
        ]
    finally:
        jit_watch._FIRST_ARGS.pop("_step_kernel", None)
        triton.knobs.runtime.jit_cache_hook = None
