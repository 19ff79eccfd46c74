"""The attention kernels' wide-head defaults compile for the H200 (sm_90) and fit it: no register spills,
shared memory within the 227 KB a block may use. Triton compiles down to a cubin with its bundled ptxas,
no GPU needed, so a tile choice that would only fail at the first launch on a GPU fails here. Each
compilation runs in a child process without TRITON_INTERPRET (under it the kernels' helpers are the
interpreter's functions, which Triton's compiler cannot read): tests/sm90.py.

The layer variants are on (window, softcap, sinks, Llama 4's attention chunk): the heaviest code each
kernel has.
"""

from __future__ import annotations

import json

import pytest
import torch
import triton.language as tl

from overnight.kernels.paged_decode import _decode_kernel, default_decode_config
from overnight.kernels.paged_decode_fp8 import PRECISE_ACC_STEP, _decode_fp8_mma_kernel
from overnight.kernels.paged_prefill import _prefill_kernel, default_prefill_config
from tests.sm90 import SHARED_LIMIT, child_report, compile_for_sm90, compile_sm90

pytestmark = pytest.mark.slow  # a few seconds of compilation per kernel

LAYER = dict(WINDOW=1024, SOFTCAP=50.0 * 1.4426950408889634, HAS_SINKS=True, CHUNK=8192)
# Llama 4's chunked layers: the chunk alone (the window's branches compiled out)
CHUNKED = dict(WINDOW=0, SOFTCAP=0.0, HAS_SINKS=False, CHUNK=8192)


def prefill_case(fp8: bool, d: int, key_limit: bool = False, layer: dict | None = None):
    page = 64 if fp8 else 16
    cfg = default_prefill_config(torch.float8_e4m3fn if fp8 else torch.bfloat16, d)
    cx = dict(
        GROUP=2, HEAD_DIM=d, BLOCK_D=d, PAGE=page, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        DOT_PRECISION="tf32", DOT_DTYPE=tl.float16 if fp8 else tl.bfloat16, HAS_SCALE=fp8, V_TOKEN_MAJOR=fp8,
        V_RUN=min(page, cfg.block_n), PREFETCH_PAGES=cfg.prefetch_pages, FP8_MMA=cfg.fp8_mma, EXACT_CAST=False,
        Q_MAX=448.0, P_SHIFT=8.0, HAS_KEY_LIMIT=key_limit, **(layer or LAYER),
    )  # fmt: skip
    types = dict(cache_ptr="*fp8e4nv" if fp8 else "*bf16")
    return _prefill_kernel, types, cx, cfg.num_warps, cfg.num_stages


def decode_case(d: int, layer: dict | None = None):
    cfg = default_decode_config(torch.bfloat16, 16, d)
    cx = dict(
        GROUP=4, BLOCK_G=16, HEAD_DIM=d, BLOCK_D=d, PAGE=16, BLOCK_N=cfg.block_n, SPLIT=True,
        DOT_PRECISION="tf32", DOT_DTYPE=tl.bfloat16, FP8_BITS=0, HAS_SCALE=False, V_TOKEN_MAJOR=False,
        V_RUN=min(16, cfg.block_n), PREFETCH_PAGES=cfg.prefetch_pages, HEADS_FIRST=cfg.heads_first,
        **(layer or LAYER),
    )  # fmt: skip
    return _decode_kernel, dict(cache_ptr="*bf16"), cx, cfg.num_warps, cfg.num_stages


def fp8_decode_case(d: int, max_imprecise_acc: int | None = None):
    """On 64-token pages: TMA copies at 256 (a box side may be 256), pointer gathers at 512."""
    cfg = default_decode_config(torch.float8_e4m3fn, 64, d)
    tma = d <= 256
    types = dict(cache_ptr="*fp8e4nv")
    cx = dict(
        GROUP=4, BLOCK_G=16, HEAD_DIM=d, BLOCK_D=d, PAGE=64, BLOCK_N=cfg.block_n, SPLIT=False, HAS_SCALE=True,
        V_RUN=min(64, cfg.block_n), Q_MAX=448.0, P_SHIFT=8.0, EXACT_CAST=False, HEADS_FIRST=cfg.heads_first,
        TMA=tma, MAX_IMPRECISE_ACC=max_imprecise_acc, **LAYER,
    )  # fmt: skip
    if tma:
        types["k_desc"] = f"tensordesc<fp8e4nv[{cfg.block_n}, {d}]>"
        types["v_desc"] = f"tensordesc<fp8e4nv[{d}, {cfg.block_n}]>"
    else:
        cx.update(k_desc=None, v_desc=None)
    return _decode_fp8_mma_kernel, types, cx, cfg.num_warps, cfg.num_stages


CASES = {
    "prefill-bf16-512": lambda: prefill_case(False, 512),
    "prefill-e4m3-256": lambda: prefill_case(True, 256),
    "prefill-bf16-256-key-limit": lambda: prefill_case(False, 256, key_limit=True),  # Gemma 3 with images
    "prefill-e4m3-512": lambda: prefill_case(True, 512),
    "decode-bf16-512": lambda: decode_case(512),
    "decode-e4m3-256-tma": lambda: fp8_decode_case(256),
    "decode-e4m3-512": lambda: fp8_decode_case(512),
    "prefill-bf16-128-chunk": lambda: prefill_case(False, 128, layer=CHUNKED),
    "decode-bf16-128-chunk": lambda: decode_case(128, layer=CHUNKED),
}


def mma_counts(max_imprecise_acc: int | None) -> list[int]:
    """(8-bit wgmma, wgmma waits, fp32 adds) in the PTX of the FP8 decode kernel at head_dim 128."""
    kernel, types, cx, num_warps, num_stages = fp8_decode_case(128, max_imprecise_acc)
    options = dict(num_warps=num_warps, num_stages=num_stages)
    ptx = compile_for_sm90(kernel, types, cx, options).asm["ptx"]
    return [ptx.count("wgmma.mma_async"), ptx.count("wgmma.wait_group"), ptx.count("add.f32")]


def report() -> None:
    """The child process: compile every case, print their usage as one JSON object."""
    usage = {name: compile_sm90(*case()) for name, case in CASES.items()}
    usage["mma-default"] = mma_counts(None)
    usage["mma-precise"] = mma_counts(PRECISE_ACC_STEP)
    print(json.dumps(usage))


@pytest.fixture(scope="module")
def usage() -> dict[str, list[int]]:
    """Every case compiled by one child process (one start of torch and Triton)."""
    return child_report("tests.test_kernels_attention_sm90")


@pytest.mark.parametrize("name", list(CASES))
def test_wide_head_defaults_fit_sm90(usage: dict[str, list[int]], name: str) -> None:
    shared, regs, stack = usage[name]
    assert shared <= SHARED_LIMIT, f"{name}: {shared} bytes of shared memory"
    assert stack == 0, f"{name}: spills, {stack} bytes of stack ({regs} registers)"


def test_fp8_decode_precise_accumulation_keeps_the_8bit_mma(usage: dict[str, list[int]]) -> None:
    """DecodeConfig.precise_acc must add fp32 sums between the MMA's K steps, not trade the 8-bit
    warpgroup MMA for converted operands (what max_num_imprecise_acc=0 does) or wait after each step."""
    (mma, waits, adds), (p_mma, p_waits, p_adds) = usage["mma-default"], usage["mma-precise"]
    assert mma > 0 and (p_mma, p_waits) == (mma, waits), (usage["mma-default"], usage["mma-precise"])
    assert p_adds > adds
