"""The Gated DeltaNet kernels' defaults (kernels/gated_delta_decode.py) compile for the H200 (sm_90) and
fit it without register spills: Triton lowers them to a cubin with its bundled ptxas, no GPU needed, so
code the interpreter accepts but the compiler rejects (or a tile that spills) fails here. The
compilations run in a child process without TRITON_INTERPRET (tests/sm90.py)."""

from __future__ import annotations

import json

import pytest

from tests.sm90 import child_report, compile_sm90

pytestmark = pytest.mark.slow  # a few seconds of compilation per kernel

BF16_DELTA = dict(
    q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", a_ptr="*bf16", b_ptr="*bf16", A_log_ptr="*fp32",
    dt_bias_ptr="*bf16", pool_ptr="*fp32", slot_ptr="*i64", has_ptr="*fp32", cu_ptr="*i64", o_ptr="*bf16",
    scale="fp32", eps="fp32",
)  # fmt: skip
BF16_CONV = dict(
    x_ptr="*bf16", w_ptr="*bf16", bias_ptr="*bf16", pool_ptr="*fp32", slot_ptr="*i64", has_ptr="*fp32",
    out_ptr="*bf16",
)  # fmt: skip


def delta_case(varlen: bool):
    """Qwen3.5-9B's heads (dk = dv = 128, 2 value heads per key head) at delta_step's defaults."""
    from overnight.kernels.gated_delta_decode import _delta_rule_kernel

    cx = dict(R=2, DK=128, DV=128, BLOCK_K=128, BLOCK_V=32, VARLEN=varlen)
    return _delta_rule_kernel, BF16_DELTA, cx, 4, 3


def conv_case(channels: int = 8192, k: int = 4, silu: bool = True):
    from overnight.kernels.gated_delta_decode import _conv_step_kernel

    cx = dict(C=channels, K=k, BLOCK_C=256, HAS_BIAS=False, SILU=silu)
    return _conv_step_kernel, BF16_CONV, cx, 4, 3


CASES = {
    "delta-decode": lambda: delta_case(False),
    "delta-varlen": lambda: delta_case(True),
    "conv": conv_case,
    "conv-lfm2": lambda: conv_case(2048, 3, silu=False),  # LFM2's short conv: 3 taps, no activation
}


def report() -> None:
    """The child process: compile every case, print their usage as one JSON object."""
    print(json.dumps({name: compile_sm90(*case()) for name, case in CASES.items()}))


@pytest.fixture(scope="module")
def usage() -> dict[str, list[int]]:
    return child_report("tests.test_kernels_gated_delta_sm90")


@pytest.mark.parametrize("name", list(CASES))
def test_defaults_compile_for_sm90_without_spills(usage: dict[str, list[int]], name: str) -> None:
    shared, regs, stack = usage[name]
    assert stack == 0, f"{name}: spills, {stack} bytes of stack ({regs} registers)"
    assert regs <= 255 and shared < 48 * 1024, (name, regs, shared)
