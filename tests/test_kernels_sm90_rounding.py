"""Roundings the compiled kernels keep on the H200 (sm_90), read from the PTX that Triton's bundled
toolchain emits without a GPU (in a child process without TRITON_INTERPRET: tests/sm90.py); the
interpreter computes neither in the GPU's way, so only the compiled code can show them.

- rotary: no fma in fp16/bf16/fp32 (each product rounds to q's dtype before the sum, as the reference
  does; with contraction, 1 output in 7 was an ulp off on an H200).
"""

from __future__ import annotations

import json
import re

import pytest

from tests.sm90 import child_report, ptx_sm90

pytestmark = pytest.mark.slow  # a few seconds of compilation


def _ops(ptx: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for op in re.findall(r"^\s*((?:fma|add|sub|mul|wgmma)\.[\w.]+)", ptx, re.M):
        counts[op] = counts.get(op, 0) + 1
    return counts


def report() -> None:
    """The child process: each case's PTX instruction counts, as one JSON object."""
    from overnight.kernels.rotary import COMPILE_OPTIONS, _rotary_kernel

    out = {}
    for dt in ("fp16", "bf16", "fp32"):
        types = dict(q_ptr=f"*{dt}", k_ptr=f"*{dt}", q_w_ptr=f"*{dt}", k_w_ptr=f"*{dt}")
        types.update(pos_ptr="*i64", cache_ptr="*fp32", eps="fp32")
        cx = dict(HQ=4, HKV=2, HALF=32, BLOCK_HQ=4, BLOCK_HKV=2, BLOCK_HALF=32, NORM=False, STEP=1, OFF=32)
        out[f"rotary-{dt}"] = _ops(ptx_sm90(_rotary_kernel, types, cx, **COMPILE_OPTIONS))
    print(json.dumps(out))


@pytest.fixture(scope="module")
def ops() -> dict[str, dict[str, int]]:
    return child_report("tests.test_kernels_sm90_rounding", tool="ptxas")


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_rotary_rounds_each_product(ops: dict[str, dict[str, int]], dtype: str) -> None:
    counts = ops[f"rotary-{dtype}"]
    assert not any(op.startswith("fma") for op in counts), counts
    assert sum(n for op, n in counts.items() if op.startswith("mul.rn.")) >= 4, counts  # the rotation's
