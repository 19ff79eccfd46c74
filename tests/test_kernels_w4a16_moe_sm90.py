"""The packed-int MoE GEMM's default tiles (kernels/w4a16_moe.py's TIERS) compile for the H100/H200
(sm_90) and fit it, as tests/test_kernels_w4a16_sm90.py checks the dense W4A16 kernel: Triton's bundled
compiler builds each cubin on the CPU (tests/sm90.py). Besides shared memory and spills it checks what
made the first version slow (kernels/w4a16_moe_baseline.py's docstring): the packed words and a's rows
must come by 16-byte copies, no code may be converted by cvt (the exponent trick instead), no
dequantized tile stored to shared memory as scalars, and the tiles of 64 rows and more must use wgmma.
On words in MMA order (MMA_TIERS, 128-deep K steps) the swapped tiles, the 64-row tier's included,
must also feed wgmma from registers as unpacked: no ldmatrix.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.sm90 import SHARED_LIMIT, child_report, compile_for_sm90, compile_sm90

pytestmark = pytest.mark.slow  # a few seconds of compilation per kernel

SIZES = ("N", "K")  # model sizes: multiples of 16, as Triton sees them


def moe_case(
    block_m: int, tiles, gated: bool, kernel: str = "v2", has_zero: bool = True, group: int = 128, mma: bool = False
):  # fmt: skip
    """The kernel, its argument types, constexprs, warps and stages for one GEMM of a config (mma: the
    words in MMA order)."""
    from overnight.kernels.w4a16_moe import _block_k, _w4a16_moe_kernel, _w4a16_moe_kernel_v1

    fn = _w4a16_moe_kernel_v1 if kernel == "v1" else _w4a16_moe_kernel
    types = {p.name: "*i32" for p in fn.params if p.name.endswith("_ptr")}
    types.update(a_ptr="*bf16", s_ptr="*fp32", z_ptr="*fp32", out_ptr="*bf16", topk_weights_ptr="*fp32")
    cx = dict(
        A_DIV=8 if gated else 1, GATED=gated, MUL_WEIGHT=not gated, BITS=4, GROUP=group, HAS_ZERO=has_zero,
        BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_K=128 if mma else _block_k(group, tiles.block_k),
        DOT_PRECISION="tf32",
    )  # fmt: skip
    if kernel != "v1":
        half = tiles.unpack == "half"
        cx.update(SCALE_AFTER=tiles.scale_after, SWAP_AB=tiles.swap_ab, GROUP_M=tiles.group_m)
        cx.update(HALF=half, FAST=half, MMA_ORDER=mma)
    return fn, types, cx, tiles.num_warps, tiles.num_stages


def tier_cases() -> dict:
    from dataclasses import replace

    from overnight.kernels.w4a16_moe import MMA_TIERS, TIERS, V1_CONFIG

    cases = {}
    for _, cfg in TIERS:
        for gemm, tiles, gated in (("gate_up", cfg.gemm1, True), ("down", cfg.gemm2, False)):
            for zeros in (True, False):
                name = f"m{cfg.block_m}-{gemm}-{'zero' if zeros else 'sym'}"
                cases[name] = (cfg.block_m, tiles, gated, "v2", zeros)
    cases["v1-m16-gate_up"] = (V1_CONFIG.block_m, V1_CONFIG.gemm1, True, "v1", True)
    # the "half" unpack on the largest tier's tiles (bench/w4a16_variants_gpu.py's MoE candidates)
    big = TIERS[-1][1]
    for gemm, tiles, gated in (("gate_up", big.gemm1, True), ("down", big.gemm2, False)):
        half = replace(tiles, scale_after=False, unpack="half")
        cases[f"half-m{big.block_m}-{gemm}"] = (big.block_m, half, gated, "v2", True)
    for _, cfg in MMA_TIERS:  # MMA order (zero points: the larger kernel)
        for gemm, tiles, gated in (("gate_up", cfg.gemm1, True), ("down", cfg.gemm2, False)):
            cases[f"mma-m{cfg.block_m}-{gemm}"] = (cfg.block_m, tiles, gated, "v2", True, 128, True)
    return cases


def measure(case: tuple) -> list:
    """[shared, registers, stack, 16-byte copies, int-to-float cvts, scalar 16-bit shared stores,
    wgmma, ldmatrix] of one case compiled for sm_90."""
    kernel, types, cx, warps, stages = moe_case(*case)
    shared, regs, stack = compile_sm90(kernel, types, cx, warps, stages, SIZES)
    ptx = compile_for_sm90(kernel, types, cx, dict(num_warps=warps, num_stages=stages), SIZES).asm["ptx"]
    wide = len(re.findall(r"cp\.async\.cg\.shared\.global[^;]*, 0x10", ptx))
    cvt = len(re.findall(r"cvt\.rn\.f32\.[su]32", ptx))
    stores, wgmma = ptx.count("st.shared.b16"), ptx.count("wgmma.mma_async")
    return [shared, regs, stack, wide, cvt, stores, wgmma, ptx.count("ldmatrix")]


def report() -> None:
    """The child process: each case's measure() or its error, as one JSON object."""
    out: dict[str, object] = {}
    for name, case in tier_cases().items():
        try:
            out[name] = measure(case)
        except Exception as e:  # reported per case, so one failure does not hide the others
            out[name] = f"{type(e).__name__}: {str(e)[-600:]}"
    print(json.dumps(out))


@pytest.fixture(scope="module")
def usage() -> dict[str, object]:
    return child_report("tests.test_kernels_w4a16_moe_sm90")


@pytest.mark.parametrize("name", list(tier_cases()))
def test_moe_kernel_compiles_and_fits_sm90(usage: dict[str, object], name: str) -> None:
    result = usage[name]
    assert isinstance(result, list), f"{name} does not compile for sm_90: {result}"
    shared, regs, stack, wide, cvt, scalar_stores, wgmma, ldmatrix = result
    assert shared <= SHARED_LIMIT, f"{name}: {shared} bytes of shared memory"
    if name.startswith("v1"):  # the baseline's faults, as its docstring records them
        assert cvt > 0 and scalar_stores > 0, result
        return
    assert stack == 0, f"{name}: spills, {stack} bytes of stack ({regs} registers)"
    assert wide > 0, f"{name}: no 16-byte global-to-shared copies"
    assert cvt == 0, f"{name}: {cvt} int-to-float conversions (the exponent trick is lost)"
    assert scalar_stores == 0, f"{name}: {scalar_stores} scalar 16-bit stores to shared memory"
    rows = int(name.removeprefix("half-").removeprefix("mma-").split("-")[0][1:])
    if rows >= 64:
        assert wgmma > 0, f"{name}: a {rows}-row tile without wgmma"
    case = tier_cases()[name]
    if name.startswith("mma-") and case[1].swap_ab:
        assert wgmma > 0 and ldmatrix == 0, f"{name}: MMA-ordered weights go through shared memory"
