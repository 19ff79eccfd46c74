"""The MXFP4 expert GEMM (kernels/moe_gemm.py, W_MXFP4) compiled for sm_90 on the CPU (tests/sm90.py), at
the default tiles of every tier, gated with gpt-oss's biases and clamped SwiGLU, in both decodings
(MXFP4_DECODES): each must fit an sm_90 block's shared memory, and "bits" must leave no per-weight
int-to-float conversion or exp2 (the first version's: ~2 cvt and 1 ex2 a weight). The counts are what
moe_gemm.py's note on why the first version is slow cites.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.sm90 import SHARED_LIMIT, child_report, compile_for_sm90, compile_sm90

pytestmark = pytest.mark.slow  # a few seconds of compilation per kernel

TIERS = (4, 16, 64, 1000)  # rows per expert: one per default tier (moe_configs.default_config)


def measure(rows: int, decode: str) -> list[int]:
    """[shared, registers, stack, 1-byte global loads, int-to-float cvts, ex2, elements a thread decodes
    per K step] of the gated MXFP4 GEMM at a tier's default tiles."""
    from tests.test_kernels_sm90_fit import moe_case

    kernel, types, cx, warps, stages = moe_case("bf16", rows, mxfp4=True)
    cx["MXFP4_BITS"] = decode == "bits"
    shared, regs, stack = compile_sm90(kernel, types, cx, warps, stages, ("N", "K"))
    ptx = compile_for_sm90(kernel, types, cx, dict(num_warps=warps, num_stages=stages), ("N", "K")).asm["ptx"]
    byte_loads = len(re.findall(r"ld\.global[^;]*\.(u8|b8)", ptx))
    cvt = len(re.findall(r"cvt\.rn\.f32\.[su](32|16|8)", ptx))
    per_thread = 2 * cx["BLOCK_K"] * cx["BLOCK_N"] // (32 * warps)  # gate and up tiles
    return [shared, regs, stack, byte_loads, cvt, ptx.count("ex2.approx"), per_thread]


def report() -> None:
    out: dict[str, object] = {}
    for rows in TIERS:
        for decode in ("v1", "bits"):
            try:
                out[f"{decode}-r{rows}"] = measure(rows, decode)
            except Exception as e:  # reported per case, so one failure does not hide the others
                out[f"{decode}-r{rows}"] = f"{type(e).__name__}: {str(e)[-600:]}"
    print(json.dumps(out))


@pytest.fixture(scope="module")
def usage() -> dict[str, object]:
    return child_report("tests.test_kernels_moe_mxfp4_sm90")


@pytest.mark.parametrize("rows", TIERS)
def test_mxfp4_decodes_compile_and_fit_sm90(usage: dict[str, object], rows: int) -> None:
    v1, bits = usage[f"v1-r{rows}"], usage[f"bits-r{rows}"]
    assert isinstance(v1, list) and isinstance(bits, list), (v1, bits)
    for result in (v1, bits):
        assert result[0] <= SHARED_LIMIT, result
    per_thread = v1[6]
    assert v1[4] >= per_thread, f"v1: {v1[4]} cvts for {per_thread} weights (its known cost)"
    # bits: the few conversions and ex2 left are per scale (1 in 32 weights) and the activation's
    assert bits[4] <= per_thread // 8, f"bits: {bits[4]} int-to-float cvts for {per_thread} weights"
    assert bits[5] < v1[5], f"bits: {bits[5]} ex2 against v1's {v1[5]}"  # the rest: the SwiGLU's sigmoid
    assert bits[2] <= v1[2], f"bits spills more than v1: {bits[2]} > {v1[2]} bytes"
