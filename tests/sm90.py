"""Compiling Triton kernels for the H200 (sm_90) without a GPU, for the tests that check what only the
compiled code shows (test_kernels_*sm90*.py): register spills, shared memory, the PTX's roundings.

Triton lowers a kernel to PTX and a cubin with its bundled ptxas; cuobjdump reads the cubin's
resource usage. The compiler cannot read kernels under TRITON_INTERPRET (their helpers are the
interpreter's functions then), so each test file compiles its cases in one child process without it
(child_report), which imports the file and prints its report() as one JSON line.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import triton

SHARED_LIMIT = 227 * 1024  # an sm_90 block's dynamic shared memory
NVIDIA_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
# Types of the attention kernels' pointer arguments, for those a case's types do not name.
POINTERS = dict(
    block_tables_ptr="*i32", seq_lens_ptr="*i32", query_start_loc_ptr="*i32", kv_scale_ptr="*fp32",
    sinks_ptr="*fp32", key_limit_ptr="*i32", part_out_ptr="*fp32", part_lse_ptr="*fp32", q_ptr="*bf16", out_ptr="*bf16",
)  # fmt: skip


def compile_for_sm90(
    kernel, types: dict[str, str], constexprs: dict, options: dict[str, Any], divisible: tuple = ()
):
    """The kernel compiled for sm_90. An argument's type: types', else POINTERS', else fp32 for
    qk_scale and i32 for the rest. divisible: integer arguments besides the strides that Triton would
    see as multiples of 16 (model sizes), which its pipeliner needs to know."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, attrs = {}, {}
    for i, p in enumerate(kernel.params):
        if p.is_constexpr or p.name in constexprs:  # None descriptors are constexprs too
            sig[p.name] = "constexpr"
            continue
        sig[p.name] = types.get(p.name) or POINTERS.get(p.name) or ("fp32" if p.name == "qk_scale" else "i32")
        if sig[p.name].startswith("*") or p.name.startswith("stride") or p.name in divisible:
            attrs[(i,)] = [["tt.divisibility", 16]]  # as Triton specializes aligned pointers and strides
    cx = {(kernel.arg_names.index(k),): v for k, v in constexprs.items()}
    return triton.compile(
        ASTSource(kernel, sig, cx, attrs), target=GPUTarget("cuda", 90, 32), options=options
    )


def compile_sm90(
    kernel, types: dict[str, str], constexprs: dict, num_warps: int, num_stages: int, divisible: tuple = ()
) -> tuple[int, int, int]:
    """(shared bytes, registers, stack bytes) of the kernel compiled for sm_90 (compile_for_sm90)."""
    options = dict(num_warps=num_warps, num_stages=num_stages)
    compiled = compile_for_sm90(kernel, types, constexprs, options, divisible)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run(
            [os.path.join(NVIDIA_BIN, "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True
        ).stdout
    regs, stack = re.search(r"REG:(\d+)", usage), re.search(r"STACK:(\d+)", usage)
    assert regs and stack, usage
    return compiled.metadata.shared, int(regs.group(1)), int(stack.group(1))


def ptx_sm90(kernel, types: dict[str, str], constexprs: dict, **options) -> str:
    """The PTX of the kernel compiled for sm_90 with 4 warps and `options`."""
    return compile_for_sm90(kernel, types, constexprs, dict(num_warps=4, **options)).asm["ptx"]


def child_report(module: str, tool: str = "cuobjdump") -> Any:
    """`module`'s report() run in a child process without TRITON_INTERPRET: the JSON it prints. Skips
    the test when Triton's bundled CUDA tool `tool` is not installed."""
    if not os.path.exists(os.path.join(NVIDIA_BIN, tool)):
        pytest.skip("Triton's bundled CUDA tools are not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    code = f"from {module} import report; report()"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root)
    assert child.returncode == 0, child.stderr[-3000:]
    return json.loads(child.stdout.strip().splitlines()[-1])
