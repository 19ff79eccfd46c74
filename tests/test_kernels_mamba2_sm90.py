"""The Mamba2 SSM kernel's defaults (kernels/mamba2_scan.py) compile for the H200 (sm_90) and fit it without
register spills, at granite-4.0-h-small's sizes (128 heads of 64 on one B/C group, d_state 128) and
NVIDIA-Nemotron-Nano-9B-v2's (head size 80, not a power of two: 16 heads per group of 8); and the gated
output norm's kernel (kernels/mamba2_gated_norm.py) at both models' group sizes. Triton lowers it with its
bundled ptxas, no GPU needed; the compilations run in a child process without TRITON_INTERPRET
(tests/sm90.py)."""

from __future__ import annotations

import json

import pytest

from tests.sm90 import child_report, compile_sm90

pytestmark = pytest.mark.slow  # a few seconds of compilation per kernel

BF16_SSD = dict(
    x_ptr="*bf16", dt_ptr="*bf16", b_ptr="*bf16", c_ptr="*bf16", A_log_ptr="*fp32", dt_bias_ptr="*bf16",
    D_ptr="*bf16", pool_ptr="*fp32", slot_ptr="*i64", has_ptr="*fp32", cu_ptr="*i64", y_ptr="*bf16",
    dt_min="fp32", dt_max="fp32",
)  # fmt: skip


def ssd_case(varlen: bool, r: int = 128, p: int = 64):
    from overnight.kernels.mamba2_scan import _ssd_kernel

    cx = dict(R=r, P=p, N=128, BLOCK_P=16, BLOCK_N=128, VARLEN=varlen, DT_LIMIT=False)
    return _ssd_kernel, BF16_SSD, cx, 4, 3


def chunked_case(r: int = 128, p: int = 64):
    from overnight.kernels.mamba2_chunked import _ssd_chunked_kernel

    cx = dict(R=r, P=p, N=128, L=32, BLOCK_P=32, BLOCK_N=128, DT_LIMIT=False, DOT_PRECISION="tf32")
    return _ssd_chunked_kernel, BF16_SSD, cx, 8, 1  # ssd_varlen_chunked's defaults


def gated_norm_case(d: int):
    from overnight.kernels.mamba2_gated_norm import _gated_norm_kernel

    types = dict(y_ptr="*bf16", z_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", eps="fp32")
    block = 1 << (d - 1).bit_length()
    return _gated_norm_kernel, types, dict(D=d, BLOCK_D=block), max(1, min(16, block // 512)), 1


CASES = {
    "ssd-decode": lambda: ssd_case(False),
    "ssd-varlen": lambda: ssd_case(True),
    "ssd-chunked": chunked_case,
    "nano-v2-decode": lambda: ssd_case(False, 16, 80),
    "nano-v2-varlen": lambda: ssd_case(True, 16, 80),
    "nano-v2-chunked": lambda: chunked_case(16, 80),
    "gated-norm-granite": lambda: gated_norm_case(8192),  # one group over the whole width
    "gated-norm-nano-v2": lambda: gated_norm_case(1280),  # 8 groups of 10,240 / 8
}


def report() -> None:
    """The child process: compile every case, print their usage as one JSON object."""
    print(json.dumps({name: compile_sm90(*case()) for name, case in CASES.items()}))


@pytest.fixture(scope="module")
def usage() -> dict[str, list[int]]:
    return child_report("tests.test_kernels_mamba2_sm90")


@pytest.mark.parametrize("name", list(CASES))
def test_defaults_compile_for_sm90_without_spills(usage: dict[str, list[int]], name: str) -> None:
    shared, regs, stack = usage[name]
    assert stack == 0, f"{name}: spills, {stack} bytes of stack ({regs} registers)"
    assert regs <= 255 and shared < 48 * 1024, (name, regs, shared)
