"""The fused-MoE GEMM, the atomic alignment and the LoRA kernels compile for the H200 (sm_90) and fit it, as
tests/test_kernels_attention_sm90.py checks the attention kernels: Triton's bundled compiler builds the
cubin on the CPU, so what only a GPU's first launch used to refuse fails here. Two faults of that kind
were first seen on an H200: the SGMV kernels' `slot` changing type inside an `if` (a compile error the
interpreter does not raise) and the largest gated MoE tile in fp32 needing 240 KB of shared memory.
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from tests.sm90 import SHARED_LIMIT, child_report, compile_sm90, ptx_sm90

pytestmark = pytest.mark.slow  # a few seconds of compilation per kernel

MOE_POINTERS = (
    "a_ptr", "w_ptr", "w_scale_ptr", "a_scale_ptr", "bias_ptr", "out_ptr", "topk_weights_ptr", "sorted_ids_ptr",
    "expert_ids_ptr", "num_padded_ptr",
)  # fmt: skip


def moe_case(
    dtype: str, rows_per_expert: int, mxfp4: bool = False, w8a8: bool = False, block_k: int | None = None
):
    """A default tile (by rows per expert), gated with bias and gpt-oss's activation. w8a8: e4m3 rows
    and weights with their scales, a bf16 output (the GPU's FP8 experts, fused_moe.py). block_k: the
    tile's K step before moe_gemm fits it to the operands (the kernel tests' shallow 16)."""
    from overnight.kernels.moe_configs import W8A8_MIN_BLOCK_M, default_config
    from overnight.kernels.moe_gemm import _moe_gemm_kernel, fit_operand_size

    cfg = default_config(num_tokens=rows_per_expert * 8, top_k=8, num_experts=64)
    if w8a8:  # as get_config gives FP8 experts
        cfg = dataclasses.replace(cfg, block_m=max(cfg.block_m, W8A8_MIN_BLOCK_M))
    gemm1 = cfg.gemm1 if block_k is None else dataclasses.replace(cfg.gemm1, block_k=block_k)
    operand = torch.float8_e4m3fn if w8a8 else {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    tiles = fit_operand_size(gemm1, operand)  # as moe_gemm fits them, by its a's dtype
    types = {name: f"*{dtype}" for name in MOE_POINTERS}
    types.update(
        sorted_ids_ptr="*i32", expert_ids_ptr="*i32", num_padded_ptr="*i32", alpha="fp32", limit="fp32",
        w_ptr="*u8" if mxfp4 else f"*{dtype}", w_scale_ptr="*u8" if mxfp4 else "*fp32", a_scale_ptr="*fp32",
    )  # fmt: skip
    if w8a8:
        types.update(a_ptr="*fp8e4nv", w_ptr="*fp8e4nv")
    cx = dict(
        A_DIV=1, GATED=True, HAS_BIAS=True, ACTIVATION=1, MUL_WEIGHT=False, W_FP8=w8a8, A_FP8=w8a8,
        W_MXFP4=mxfp4, MXFP4_BITS=False,
        EVEN_K=True, DOT_PRECISION="ieee" if dtype == "fp32" else "tf32", BLOCK_M=cfg.block_m,
        BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m,
    )  # fmt: skip
    return _moe_gemm_kernel, types, cx, tiles.num_warps, tiles.num_stages


def lora_case(kind: str, block_r: int = 16, prefill: bool = False):
    from overnight.kernels import lora

    types = dict(x_ptr="*bf16", a_ptr="*bf16", h_ptr="*fp32", y_ptr="*bf16", b_ptr="*bf16")
    block_m = lora.PREFILL_BLOCK_M if prefill else lora.BLOCK_M  # a prefill step's tiles, or a decode step's
    if kind == "shrink":  # block_r 64: a q/k/v layer's three rank-16 slices in one dot
        cx = dict(PRECISION="tf32", BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=64)
        return lora._shrink_kernel, types, cx, 4, 3
    cx = dict(NUM_SLICES=3, PRECISION="tf32", BLOCK_M=block_m, BLOCK_R=16, BLOCK_N=lora.EXPAND_BLOCK_N)
    return lora._expand_kernel, types, cx, 4, 3


def align_case(kind: str, experts: int = 128, block_m: int = 64):
    """The atomic alignment's two kernels, as moe_align launches them (moe_align.py)."""
    from overnight.kernels import moe_align as m

    if kind == "count":
        return m._moe_align_atomic_count_kernel, {}, dict(BLOCK=m.ATOMIC_BLOCK), 4, 1
    e_p2 = 1 << (experts - 1).bit_length()
    cx = dict(
        E=experts, E_P2=e_p2, BLOCK_M=block_m, BLOCK=m.ATOMIC_BLOCK, TILES=max(16, m.TILE_ELEMENTS // e_p2),
        SLOTS=min(block_m, max(1, m.TILE_ELEMENTS // e_p2)),
    )  # fmt: skip
    return m._moe_align_atomic_finish_kernel, {}, cx, 8, 1


# The default configs' tiers (moe_configs.default_config): up to 8, 24, 96 rows per expert, and more.
TIERS = (4, 16, 64, 1000)
CASES = {
    **{f"moe-gated-fp32-{r}": (lambda r=r: moe_case("fp32", r)) for r in TIERS},
    **{f"moe-gated-bf16-{r}": (lambda r=r: moe_case("bf16", r)) for r in TIERS},
    "moe-gated-mxfp4-bf16": lambda: moe_case("bf16", 1000, mxfp4=True),
    **{f"moe-gated-w8a8-{r}": (lambda r=r: moe_case("bf16", r, w8a8=True)) for r in TIERS},
    # The kernel tests' 16-deep K steps: an FP8 dot needs 32 (fit_operand_size deepens them; an H100
    # refused the shallow tile before it did)
    "moe-gated-w8a8-k16": lambda: moe_case("bf16", 16, w8a8=True, block_k=16),
    "align-atomic-count": lambda: align_case("count"),
    "align-atomic-finish-128-64": lambda: align_case("finish", 128, 64),  # Qwen3-30B-A3B, a W8A8 tile
    "align-atomic-finish-512-16": lambda: align_case("finish", 512, 16),  # Qwen3.5-MoE's 512 experts
    "lora-shrink": lambda: lora_case("shrink"),
    "lora-shrink-qkv": lambda: lora_case("shrink", 64),
    "lora-expand": lambda: lora_case("expand"),
    "lora-shrink-qkv-prefill": lambda: lora_case("shrink", 64, prefill=True),
    "lora-expand-prefill": lambda: lora_case("expand", prefill=True),
}


def with_int_pointers(kernel, types: dict[str, str]) -> dict[str, str]:
    """Pointers not named in `types` are int32 (ids, offsets, lengths)."""
    return {p.name: "*i32" for p in kernel.params if p.name.endswith("_ptr")} | types


def report() -> None:
    """The child process: compile every case, print its usage (or its error) as one JSON object."""
    out: dict[str, object] = {}
    for name, case in CASES.items():
        try:
            kernel, types, cx, warps, stages = case()
            sizes = ("N", "K", "up_offset", "R")  # model sizes: multiples of 16, as Triton sees them
            out[name] = compile_sm90(kernel, with_int_pointers(kernel, types), cx, warps, stages, sizes)
        except Exception as e:  # reported per case, so one failure does not hide the others
            out[name] = f"{type(e).__name__}: {str(e)[-600:]}"
    # What the W8A8 tiles' dots run as: Hopper's e4m3 warpgroup MMA, with no e4m3 -> bf16 conversion
    # of a weight tile on the way (the weight-only path's cost).
    for r in (16, 1000):
        kernel, types, cx, warps, stages = moe_case("bf16", r, w8a8=True)
        ptx = ptx_sm90(kernel, with_int_pointers(kernel, types), cx, num_stages=stages)
        out[f"ptx-w8a8-{r}"] = dict(
            wgmma_e4m3=bool(re.search(r"wgmma\.mma_async\S*\.e4m3\.e4m3", ptx)),
            e4m3_to_16bit=len(re.findall(r"cvt\.rn\.(?:f16x2|bf16x2)\.e4m3x2", ptx)),
        )
    print(json.dumps(out))


@pytest.fixture(scope="module")
def usage() -> dict[str, object]:
    return child_report("tests.test_kernels_sm90_fit")


@pytest.mark.parametrize("rows", [16, 1000])
def test_w8a8_experts_multiply_e4m3_on_tensor_cores(usage: dict[str, object], rows: int) -> None:
    assert usage[f"ptx-w8a8-{rows}"] == {"wgmma_e4m3": True, "e4m3_to_16bit": 0}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_compiles_and_fits_sm90(usage: dict[str, object], name: str) -> None:
    result = usage[name]
    assert isinstance(result, list), f"{name} does not compile for sm_90: {result}"
    shared, regs, stack = result
    assert shared <= SHARED_LIMIT, f"{name}: {shared} bytes of shared memory"
    # The gated MoE GEMM's two [BLOCK_M, BLOCK_N] accumulators spill at the larger tiers (hundreds of
    # bytes at 255 registers, compiled here); whether that costs time is a GPU measurement, so only the
    # LoRA kernels are held to no spills.
    if name.startswith("lora"):
        assert stack == 0, f"{name}: spills, {stack} bytes of stack ({regs} registers)"
