"""The MXFP4 expert GEMMs compiled for sm_90 on the CPU (tests/sm90.py), at the default tiles of every
tier, gated with gpt-oss's biases and clamped SwiGLU, in every decoding (moe_gemm.MXFP4_DECODES): each
must fit an sm_90 block's shared memory; "bits" and "v2" must leave no per-weight int-to-float
conversion or exp2 (the first version's: ~2 cvt and 1 ex2 a weight); "v2" (kernels/mxfp4_moe.py) must
not spill, must pipeline its loads (cp.async, no single-byte loads of the weights) and use wgmma from 64
rows. The counts are what moe_gemm.py's note on why the first version is slow cites.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.sm90 import SHARED_LIMIT, child_report, compile_for_sm90, compile_sm90

pytestmark = pytest.mark.slow  # a few seconds of compilation per kernel

TIERS = (4, 16, 64, 1000)  # rows per expert: one per default tier (moe_configs.default_config)


def v2_case(rows: int) -> tuple:
    from overnight.kernels.moe_configs import default_config
    from overnight.kernels.mxfp4_moe import _mxfp4_moe_kernel, k_step

    cfg = default_config(num_tokens=rows * 8, top_k=8, num_experts=64)
    t = cfg.gemm1
    types = dict(
        a_ptr="*bf16", qw_ptr="*i32", s_ptr="*u8", bias_ptr="*bf16", out_ptr="*bf16", topk_weights_ptr="*fp32",
        sorted_ids_ptr="*i32", expert_ids_ptr="*i32", num_padded_ptr="*i32", alpha="fp32", limit="fp32",
    )  # fmt: skip
    cx = dict(
        A_DIV=1, GATED=True, HAS_BIAS=True, ACTIVATION=1, MUL_WEIGHT=False, BLOCK_M=cfg.block_m,
        BLOCK_N=t.block_n, GROUP_M=t.group_m, DOT_PRECISION="tf32",
    )  # fmt: skip
    cx["BLOCK_K"] = k_step(2880, t.block_k)  # gpt-oss's hidden size
    return _mxfp4_moe_kernel, types, cx, t.num_warps, t.num_stages


def measure(rows: int, decode: str) -> list[int]:
    """[shared, registers, stack, 1-byte global loads, int-to-float cvts, ex2, elements a thread decodes
    per K step, cp.async, wgmma] of the gated MXFP4 GEMM at a tier's default tiles."""
    from tests.test_kernels_sm90_fit import moe_case

    if decode == "v2":
        kernel, types, cx, warps, stages = v2_case(rows)
    else:
        kernel, types, cx, warps, stages = moe_case("bf16", rows, mxfp4=True)
        cx["MXFP4_BITS"] = decode == "bits"
    block_k = cx["BLOCK_K"]
    shared, regs, stack = compile_sm90(kernel, types, cx, warps, stages, ("N", "K"))
    ptx = compile_for_sm90(kernel, types, cx, dict(num_warps=warps, num_stages=stages), ("N", "K")).asm["ptx"]
    byte_loads = len(re.findall(r"ld\.global[^;]*\.(u8|b8)", ptx))
    cvt = len(re.findall(r"cvt\.rn\.f32\.[su](32|16|8)", ptx))
    per_thread = 2 * block_k * cx["BLOCK_N"] // (32 * warps)  # gate and up tiles
    ex2 = ptx.count("ex2.approx")
    return [
        shared,
        regs,
        stack,
        byte_loads,
        cvt,
        ex2,
        per_thread,
        ptx.count("cp.async"),
        ptx.count("wgmma.mma_async"),
    ]


def report() -> None:
    out: dict[str, object] = {}
    for rows in TIERS:
        for decode in ("v1", "bits", "v2"):
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


@pytest.mark.parametrize("rows", TIERS)
def test_mxfp4_v2_pipelines_without_spills(usage: dict[str, object], rows: int) -> None:
    v2 = usage[f"v2-r{rows}"]
    assert isinstance(v2, list), v2
    shared, regs, stack, byte_loads, cvt, _, per_thread, cp_async, wgmma = v2
    assert shared <= SHARED_LIMIT and stack == 0, (
        f"v2: {shared} bytes shared, {stack} of stack ({regs} registers)"
    )
    assert cvt <= per_thread // 8, f"v2: {cvt} int-to-float cvts for {per_thread} weights"
    assert cp_async > 0, "v2: no cp.async: its loads are not pipelined"
    # single bytes: only the scales, one a word (8 weights) at most
    assert byte_loads <= per_thread // 8, (
        f"v2: {byte_loads} single-byte global loads for {per_thread} weights"
    )
    if rows >= 64:
        assert wgmma > 0, f"v2: no wgmma at {rows} rows an expert"
