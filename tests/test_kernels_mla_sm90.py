"""Latent attention's decode kernel (kernels/mla_decode.py) at its default tiles compiles for the H200
(sm_90) and fits it at DeepSeek-V3's widths (a 512-value latent, 64 rope values) and GLM-4.7-Flash's (the
same), over a bf16 and an FP8 cache (and the FP8 write): no register spills, shared memory within the
227 KB a block may use. Compiled in a child process
without TRITON_INTERPRET (tests/sm90.py).
"""

from __future__ import annotations

import json

import pytest
import triton.language as tl

from overnight.kernels import mla_decode as k
from tests.sm90 import SHARED_LIMIT, child_report, compile_sm90

pytestmark = pytest.mark.slow  # a few seconds of compilation per case


def decode_case(rank: int, rope: int, page: int, cache: str = "bf16"):
    fp8 = cache.startswith("fp8")
    block_n, num_warps, num_stages = k.FP8_TILES if fp8 else (k.BLOCK_N, k.NUM_WARPS, k.NUM_STAGES)
    cx = dict(
        RANK=rank, ROPE=rope, BLOCK_H=k.BLOCK_H, PAGE=page, BLOCK_N=block_n, DOT_PRECISION="tf32",
        HAS_SCALE=fp8, DOT_DTYPE=tl.float16,
    )  # fmt: skip
    types = dict(
        q_ptr="*bf16", cache_ptr=f"*{cache}", out_ptr="*bf16", row_req_ptr="*i32", row_lens_ptr="*i32"
    )
    return k._mla_decode_kernel, types, cx, num_warps, num_stages


def write_case(cache: str):
    cx = dict(PAGE=64, RANK=512, WIDTH=576, BLOCK=1024, HAS_SCALE=True, SAT_MAX=448.0)
    types = dict(rows_ptr="*bf16", cache_ptr=f"*{cache}", slot_mapping_ptr="*i64")
    return k._latent_write_kernel, types, cx, 4, 1


# An FP8 cache's decode (tiles converted to fp16 in registers, the two scales on fp32 results) and
# write: DeepSeek-V3's widths on its default pages of 64 tokens (options.FP8_BLOCK_SIZE).
CASES = {
    "decode-512-64-page16": lambda: decode_case(512, 64, 16),
    "decode-512-64-page64": lambda: decode_case(512, 64, 64),
    "decode-512-64-page64-fp8": lambda: decode_case(512, 64, 64, "fp8e4nv"),
    "write-576-fp8": lambda: write_case("fp8e4nv"),
}


def report() -> None:
    """The child process: compile every case, print their usage as one JSON object."""
    print(json.dumps({name: compile_sm90(*case()) for name, case in CASES.items()}))


@pytest.fixture(scope="module")
def usage() -> dict[str, list[int]]:
    return child_report("tests.test_kernels_mla_sm90")


@pytest.mark.parametrize("name", list(CASES))
def test_default_tiles_fit_sm90(usage: dict[str, list[int]], name: str) -> None:
    shared, regs, stack = usage[name]
    assert shared <= SHARED_LIMIT, f"{name}: {shared} bytes of shared memory"
    assert stack == 0, f"{name}: spills, {stack} bytes of stack ({regs} registers)"
