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
from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature

from overnight.kernels.fp8_gemm import _fp8_gemm_kernel
from overnight.kernels.kv_write import _kv_write_kernel
from overnight.kernels.mla_decode import _latent_write_kernel
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


def specialization(kernel, varying: dict[str, object], constexprs: dict | None = None) -> list:
    """The specialization Triton would compile `kernel` for, with the named arguments set (counts or
    tensors) and constexprs 16 unless named."""
    kernel = as_jit(kernel)
    binder = create_function_from_signature(
        kernel.signature, kernel.params, CUDABackend(GPUTarget("cuda", 90, 32))
    )
    buf = torch.zeros(64)
    args, kwargs = [], {}
    for p in kernel.params:
        if p.is_constexpr:
            kwargs[p.name] = (constexprs or {}).get(p.name, 16)
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


def fire_compile_hook(kernel, *args, **constexprs) -> None:
    """What Triton 3.6 does on a cache miss for these arguments on sm_90, up to the compile: bind them,
    build the cache key and call the installed jit_cache_hook with the real record (no GPU needed)."""
    jit = as_jit(kernel)
    backend = CUDABackend(GPUTarget("cuda", 90, 32))
    binder = create_function_from_signature(jit.signature, jit.params, backend)
    kwargs = {**constexprs, "debug": False, "instrumentation_mode": ""}
    bound, spec, options = binder(*args, **kwargs)
    key = compute_cache_key({}, spec, options)
    options, signature, constants, attrs = jit._pack_args(backend, kwargs, bound, spec, options)
    jit._call_hook(triton.knobs.runtime.jit_cache_hook, key, signature, 0, constants, options, [attrs], False)


@triton.jit
def _step_kernel(x_ptr, n, BLOCK: tl.constexpr):  # a kernel to compile in the tests below
    tl.store(x_ptr, n + BLOCK)


def test_tritons_own_repr_does_not_name_the_arguments():
    """Why jit_watch reads the compile record: Triton 3.6's repr lists one "argument" cut from a
    character of the cache key, the same for every variant."""
    seen: list[str] = []
    triton.knobs.runtime.jit_cache_hook = lambda **kw: seen.append(kw["repr"])
    try:
        fire_compile_hook(_step_kernel, torch.zeros(64), 16, BLOCK=64)
        fire_compile_hook(_step_kernel, torch.zeros(64), 17, BLOCK=128)
    finally:
        triton.knobs.runtime.jit_cache_hook = None
    assert seen[0] == seen[1] and seen[0].endswith("](x_ptr: ()")


def test_watch_compiles_collects_and_restores():
    from overnight.kernels import jit_watch

    runtime = triton.knobs.runtime
    before: list[str] = []

    def earlier(**kw):  # a hook someone installed first keeps running, and its answer counts
        before.append(kw["repr"])
        return True

    jit_watch._FIRST_ARGS.pop("_step_kernel", None)
    runtime.jit_cache_hook = earlier
    try:
        with jit_watch.watch_compiles() as compiled:
            hook = runtime.jit_cache_hook
            kw = dict(key="k", fn=None, compile={}, is_manual_warmup=False, already_compiled=False)
            assert hook(repr="_prefill_kernel[num_warps=4](x: ()", **kw) is True
            fire_compile_hook(_step_kernel, torch.zeros(64), 16, BLOCK=64)
        assert compiled == ["_prefill_kernel()", "_step_kernel(x_ptr: *fp32D, n: i32D, BLOCK=64)"]
        assert len(before) == 2 and before[0] == "_prefill_kernel[num_warps=4](x: ()"
        assert runtime.jit_cache_hook is earlier
    finally:
        runtime.jit_cache_hook = None
        jit_watch._FIRST_ARGS.pop("_step_kernel", None)


def test_compiles_after_startup_are_logged(caplog):
    """A second variant of one kernel mid-run is a warning naming what changed; a kernel's first use is
    only information."""
    import logging

    from overnight.kernels import jit_watch

    jit_watch._FIRST_ARGS.pop("_step_kernel", None)
    log = logging.getLogger("overnight.test_jit")
    remove = jit_watch.log_compiles_after_startup(log)
    assert jit_watch.log_compiles_after_startup(log) is remove  # a second engine in the process adds no hook
    try:
        with caplog.at_level(logging.INFO, logger="overnight.test_jit"):
            fire_compile_hook(_step_kernel, torch.zeros(64), 16, BLOCK=64)
            fire_compile_hook(_specialized, torch.zeros(64), 3)
            fire_compile_hook(_step_kernel, torch.zeros(64), 17, BLOCK=64)
        assert [r.levelname for r in caplog.records] == ["INFO", "INFO", "WARNING"]
        message = caplog.records[-1].getMessage()
        assert "variant 2 of _step_kernel" in message and message.endswith("_step_kernel(n: i32D -> i32)")
    finally:
        remove()
        jit_watch._FIRST_ARGS.pop("_step_kernel", None)
    assert triton.knobs.runtime.jit_cache_hook is None


def test_a_later_variant_is_described_by_what_changed():
    """The report of a mid-run compile names the argument whose specialization changed: a pointer's
    alignment, a constexpr's value, the options; an identical variant (another process) says so."""
    from overnight.kernels import jit_watch

    jit_watch._FIRST_ARGS.pop("_step_kernel", None)
    buf = torch.zeros(64)
    try:
        with jit_watch.watch_compiles() as compiled:
            fire_compile_hook(_step_kernel, buf, 16, BLOCK=64)
            fire_compile_hook(_step_kernel, buf[1:], 16, BLOCK=64)  # 4 bytes past an aligned address
            fire_compile_hook(_step_kernel, buf, 16, BLOCK=128)
            fire_compile_hook(_step_kernel, buf, 16, BLOCK=64, num_warps=8)
            fire_compile_hook(_step_kernel, buf, 16, BLOCK=64)
        assert compiled[1:] == [
            "_step_kernel(x_ptr: *fp32D -> *fp32)",
            "_step_kernel(BLOCK=64 -> BLOCK=128)",
            "_step_kernel([num_warps=4, num_ctas=1, num_stages=3, enable_fp_fusion=True, "
            "launch_cooperative_grid=False] -> [num_warps=8, num_ctas=1, num_stages=3, "
            "enable_fp_fusion=True, launch_cooperative_grid=False])",
            "_step_kernel(same)",
        ]
    finally:
        jit_watch._FIRST_ARGS.pop("_step_kernel", None)
        triton.knobs.runtime.jit_cache_hook = None


def test_lora_rows_do_not_specialize_on_the_request_count():
    """The LoRA kernels read a step's tiles from int32 buffers; Triton specializes a pointer on 16-byte
    alignment and an int on being 1 or a multiple of 16. Segments packed back to back (n requests
    each) once gave a new variant whenever n % 4 changed (an H100 LoRA run compiled 4 mid-run), and
    the shrink's split of K changes with the step's rows (1 on a large prefill step). Every request
    count, mix and split binds the same variant."""
    from overnight.kernels.lora import _expand_kernel, _shrink_kernel, shrink_splits
    from overnight.lora.layers import LoRABatch

    batch = LoRABatch(max_tokens=256, max_slots=6, device=torch.device("cpu"))
    for kernel in (_shrink_kernel, _expand_kernel):
        keys = set()
        for n in range(1, 10):
            decode = n % 2 == 0  # a row a request, and a padding row
            rows_each = 1 if decode else 3
            num_rows = rows_each * n + decode
            batch.map_rows([i % 7 - 1 for i in range(n)], [rows_each] * n, num_rows, decode)
            varying: dict[str, object] = {"order_ptr": batch.rows.order, "tiles_ptr": batch.rows.tiles}
            if kernel is _shrink_kernel:
                splits, width = shrink_splits(4096, 1024 * n if n > 5 else num_rows, 3)
                varying.update(NUM_SPLITS=splits, K_SPLIT=width)
            keys.add(str(specialization(kernel, varying, {"PRECISION": "tf32"})))
        assert len(keys) == 1, f"{kernel.fn.__name__}: {len(keys)} variants over request counts 1-9"


@pytest.mark.parametrize(
    "kernel,slot_arg", [(_kv_write_kernel, "slot_ptr"), (_latent_write_kernel, "slot_mapping_ptr")]
)
def test_cache_writes_do_not_specialize_on_a_groups_slot_offset(kernel, slot_arg):
    """Group g's slot mapping starts g * rows int64s into one buffer (runner/inputs.py): with an odd row
    count the second group's pointer is 8 bytes off 16; the write kernels bind one variant either way."""
    slots = torch.zeros(64, dtype=torch.int64)
    # group 1's slots of a step of 16 or 17 rows
    keys = {str(specialization(kernel, {slot_arg: slots[rows:]})) for rows in (16, 17)}
    assert len(keys) == 1
