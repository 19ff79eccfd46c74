"""Latent attention's prefill kernels (kernels/mla_prefill.py) at their default tiles compile for the H200
(sm_90) and fit it: the attention at DeepSeek's widths (128 + 64 key values, 128 value values) and
GLM-4.7-Flash's (192 + 64, 256), the gather of 512 + 64-value rows from a bf16 and an FP8 cache. No
register spills, shared memory within the 227 KB a block may use. Compiled in a child process without
TRITON_INTERPRET (tests/sm90.py).
"""

from __future__ import annotations

import json

import pytest
import triton

from overnight.kernels import latent_gather as g
from overnight.kernels import mla_prefill as k
from tests.sm90 import SHARED_LIMIT, child_report, compile_sm90

pytestmark = pytest.mark.slow  # a few seconds of compilation per case

TENSORS = ("q_nope_ptr", "q_pe_ptr", "k_nope_ptr", "k_pe_ptr", "v_ptr", "out_ptr")


def attention_case(nope: int, rope: int, v_dim: int):
    cfg = k.default_mla_prefill_config(nope, rope, v_dim)
    cx = dict(
        NOPE=nope, ROPE=rope, V_DIM=v_dim, BLOCK_NOPE=triton.next_power_of_2(nope), BLOCK_ROPE=rope,
        BLOCK_V=v_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, DOT_PRECISION="tf32",
    )  # fmt: skip
    types = {name: "*bf16" for name in TENSORS} | {"kv_loc_ptr": "*i32"}
    return k._mla_prefill_kernel, types, cx, cfg.num_warps, cfg.num_stages


def gather_case(cache: str):
    cx = dict(
        RANK=512,
        ROPE=64,
        BLOCK_R=512,
        BLOCK_P=64,
        PAGE=64,
        BLOCK_T=g.GATHER_TOKENS,
        HAS_SCALE=cache != "bf16",
    )
    types = dict(cache_ptr=f"*{cache}", out_ptr="*bf16", kv_loc_ptr="*i32")
    return g._latent_gather_kernel, types, cx, 4, 1


CASES = {
    "attention-128-64-128": lambda: attention_case(128, 64, 128),
    "attention-192-64-256": lambda: attention_case(192, 64, 256),
    "gather-576-bf16": lambda: gather_case("bf16"),
    "gather-576-fp8": lambda: gather_case("fp8e4nv"),
}


def report() -> None:
    """The child process: compile every case, print their usage as one JSON object."""
    print(json.dumps({name: compile_sm90(*case()) for name, case in CASES.items()}))


@pytest.fixture(scope="module")
def usage() -> dict[str, list[int]]:
    return child_report("tests.test_kernels_mla_prefill_sm90")


@pytest.mark.parametrize("name", list(CASES))
def test_default_tiles_fit_sm90(usage: dict[str, list[int]], name: str) -> None:
    shared, regs, stack = usage[name]
    assert shared <= SHARED_LIMIT, f"{name}: {shared} bytes of shared memory"
    assert stack == 0, f"{name}: spills, {stack} bytes of stack ({regs} registers)"
