"""The integer-weight GEMMs' default variants compile for the H100/H200 (sm_90) and fit it: Triton's
bundled compiler builds each cubin on the CPU (tests/sm90.py), so spills, shared memory over the limit
and lost vectorization show here before a GPU run. For the fused W4A16 kernel it also checks what made
the first version slow (kernels/w4a16_baseline.py's docstring): the packed words must be fetched with
16-byte copies, and the large-M tiles must use Hopper's wgmma.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.sm90 import SHARED_LIMIT, child_report, compile_for_sm90, compile_sm90

pytestmark = pytest.mark.slow  # a few seconds of compilation per kernel

TYPES = dict(
    x_ptr="*bf16", qw_ptr="*i32", s_ptr="*fp32", z_ptr="*fp32", out_ptr="*bf16", w_ptr="*bf16",
    a_ptr="*i8", sa_ptr="*fp32", b_ptr="*i8", sb_ptr="*fp32",
)  # fmt: skip
SIZES = ("N", "K", "k_per_split")  # model sizes: multiples of 16, as Triton sees them


def w4a16_case(
    m: int, bits: int = 4, group: int = 128, signed: bool = False, atomic: bool = False, swap: bool = False,
    config=None, mma: bool = False,
):  # fmt: skip
    """The fused kernel's case for M rows: default_config(m) with swap_ab=swap, or `config` as given;
    mma: the words in MMA order (128-column K steps)."""
    from dataclasses import replace

    from overnight.kernels.w4a16_gemm import _block_k, _w4a16_kernel, default_config

    cfg = config or replace(default_config(m), swap_ab=swap)
    half = cfg.unpack == "half"
    cx = dict(
        BITS=bits, GROUP=group, HAS_ZERO=not signed, SIGNED=signed, SCALE_AFTER=cfg.scale_after, SWAP_AB=cfg.swap_ab, ATOMIC=atomic,
        HALF=half, FAST=half and bits == 4 and not signed, MMA_ORDER=mma,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=128 if mma else _block_k(group, cfg.block_k),
        DOT_PRECISION="tf32",
    )  # fmt: skip
    types = dict(TYPES, out_ptr="*fp32") if atomic else TYPES
    return _w4a16_kernel, types, cx, cfg.num_warps, cfg.num_stages


def v1_case(m: int):
    from overnight.kernels.w4a16_baseline import _w4a16_kernel_v1

    bm = 16 if m <= 16 else 64
    cx = dict(BITS=4, GROUP=128, HAS_ZERO=True, BLOCK_M=bm, BLOCK_N=64, BLOCK_K=128, DOT_PRECISION="tf32")
    return _w4a16_kernel_v1, TYPES, cx, 4, 4


def dequant_case(mma: bool = False, k_major: bool = False):
    from overnight.kernels.w4a16_gemm import _dequant_kernel

    cx = dict(
        BITS=4,
        GROUP=128,
        HAS_ZERO=True,
        SIGNED=False,
        MMA_ORDER=mma,
        BLOCK_N=32,
        BLOCK_K=128,
        K_MAJOR=k_major,
    )
    return _dequant_kernel, TYPES, cx, 4, 1


def int8_case(m: int):
    from overnight.kernels.int8_gemm import _int8_gemm_kernel, default_config

    cfg = default_config(m)
    cx = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m)
    return _int8_gemm_kernel, TYPES, cx, cfg.num_warps, cfg.num_stages


def _bench(filename: str):
    import importlib.util

    from tests.bench_scripts import BENCH_DIR

    spec = importlib.util.spec_from_file_location(f"_{filename[:-3]}", BENCH_DIR / filename)
    assert spec and spec.loader
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def _half_tiles() -> dict:
    """bench/w4a16_variants_gpu.py's "half" tiles (the --mid section's candidates, timed on the GPU)."""
    return {
        name: make
        for name, make in _bench("w4a16_variants_gpu.py").MID_VARIANTS.items()
        if name.startswith("half")
    }


def _tier(m: int):
    from overnight.kernels.w4a16_gemm import default_config

    return default_config(m)


HALF_TILES = _half_tiles()
CASES = {
    # column order: every tier it runs fused (to 192 rows), and the large tiles past the MMA-order tiers
    **{f"w4a16-m{m}": (lambda m=m: w4a16_case(m)) for m in (1, 16, 32, 64, 128, 512, 1024)},
    "w4a16-atomic-m16": lambda: w4a16_case(16, atomic=True),
    "w4a16-swap-m16": lambda: w4a16_case(16, swap=True),
    "w4a16-swap-m1024": lambda: w4a16_case(1024, swap=True),
    "w8a16-signed-m16": lambda: w4a16_case(16, bits=8, group=4096, signed=True),
    **{
        f"w4a16-{name}": (lambda make=make: w4a16_case(128, config=make(128)))
        for name, make in HALF_TILES.items()
    },
    # the words in MMA order: every default tier, the half tiles swapped (their weights are wgmma's
    # register operand as unpacked: no ldmatrix)
    **{
        f"w4a16-mma-m{m}": (lambda m=m: w4a16_case(m, config=_tier(m), mma=True))
        for m in (16, 32, 64, 128, 192, 256, 384)
    },
    **{
        f"w4a16-mma-{name}": (lambda make=make: w4a16_case(128, config=make(128), mma=True))
        for name, make in HALF_TILES.items()
        if "swap" in name
    },
    **{  # bench/w4a16_mma_gpu.py's fused tiles
        f"w4a16-{name}-swap": (lambda make=make: w4a16_case(256, config=make(256), mma=True))
        for name, make in _bench("w4a16_mma_gpu.py").TILES.items()
    },
    "w4a16-v1-m16": lambda: v1_case(16),
    "dequant-v2": dequant_case,
    "dequant-v2-mma-k-major": lambda: dequant_case(mma=True, k_major=True),  # bench/w4a16_dequant_gpu.py's
    **{f"int8-m{m}": (lambda m=m: int8_case(m)) for m in (32, 64, 1024)},
}


def report() -> None:
    """The child process: each case's (shared, registers, stack, 16-byte copies, wgmma) or its error."""
    out: dict[str, object] = {}
    for name, case in CASES.items():
        try:
            kernel, types, cx, warps, stages = case()
            shared, regs, stack = compile_sm90(kernel, types, cx, warps, stages, SIZES)
            options = dict(num_warps=warps, num_stages=stages)
            ptx = compile_for_sm90(kernel, types, cx, options, SIZES).asm["ptx"]
            wide = len(re.findall(r"cp\.async\.cg\.shared\.global[^;]*, 0x10", ptx))
            out[name] = [shared, regs, stack, wide, ptx.count("wgmma.mma_async"), ptx.count("ldmatrix")]
        except Exception as e:  # reported per case, so one failure does not hide the others
            out[name] = f"{type(e).__name__}: {str(e)[-600:]}"
    print(json.dumps(out))


@pytest.fixture(scope="module")
def usage() -> dict[str, object]:
    return child_report("tests.test_kernels_w4a16_sm90")


# Tiers chosen on the GPU with a small spill, at the stack they had there (none since session W's
# 128-row tier, the "half" unpack's tile, replaced session V's, which spilled 216 bytes).
MEASURED_SPILLS: dict[str, int] = {}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_compiles_and_fits_sm90(usage: dict[str, object], name: str) -> None:
    result = usage[name]
    assert isinstance(result, list), f"{name} does not compile for sm_90: {result}"
    shared, regs, stack, wide, wgmma, ldmatrix = result
    assert shared <= SHARED_LIMIT, f"{name}: {shared} bytes of shared memory"
    if name in MEASURED_SPILLS:
        assert stack <= MEASURED_SPILLS[name], f"{name}: {stack} bytes of stack, more than when measured"
    else:
        assert stack == 0, f"{name}: spills, {stack} bytes of stack ({regs} registers)"
    if name.startswith(("w4a16-m", "w4a16-swap", "w8a16", "int8")):
        assert wide > 0, f"{name}: no 16-byte global-to-shared copies (scalar loads)"
    if name in ("w4a16-m512", "w4a16-m1024", "w4a16-swap-m16", "w4a16-swap-m1024", "int8-m1024"):
        assert wgmma > 0, f"{name}: the large-M tile does not use wgmma"
    if name.startswith("w4a16-half"):
        assert wgmma > 0, f"{name}: the half tile does not use wgmma"
    if name.startswith("w4a16-mma-") and ("swap" in name or name.startswith("w4a16-mma-m")):
        assert wgmma > 0 and ldmatrix == 0, f"{name}: MMA-ordered weights go through shared memory"
