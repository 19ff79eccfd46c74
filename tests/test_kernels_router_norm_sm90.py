"""The grouped sigmoid router kernel (kernels/moe_router.py: GLM-4.5 / 4.6, MiniMax-M2) and the offset
RMSNorm with its FP8 and dense outputs (kernels/rmsnorm.py: the Qwen3-Next / Qwen3.5 hybrids) compile
for the H200 (sm_90) at the published models' shapes and launch settings, without register spills.
The interpreter runs these kernels in the CPU tests; only the compiler sees what it rejects (ops,
layouts) and what spills. The compilations run in a child process without TRITON_INTERPRET
(tests/sm90.py)."""

from __future__ import annotations

import json

import pytest

from tests.sm90 import child_report, compile_sm90

pytestmark = pytest.mark.slow  # a few seconds of compilation per kernel

ROUTER = dict(
    logits_ptr="*fp32", bias_ptr="*fp32", weights_ptr="*fp32", ids_ptr="*i32", scaling="fp32"
)  # fmt: skip
GROUPED_ROUTER = {**ROUTER, "renorm_eps": "fp32"}  # the grouped kernel's renormalization eps
NORM = dict(
    x_ptr="*bf16", res_ptr="*bf16", w_ptr="*bf16", out_ptr="*fp8e4nv", res_out_ptr="*bf16",
    scale_ptr="*fp32", dense_ptr="*bf16", eps="fp32",
)  # fmt: skip


def router_case(experts: int, top_k: int, n_group: int, topk_group: int):
    """The launch of grouped_router_topk (its constexprs and warps) for one model's router."""
    import triton

    from overnight.kernels.moe_router import ROUTER_BLOCK_T, _grouped_router_kernel, router_warps

    cx = dict(
        E=experts, E_P2=triton.next_power_of_2(experts), TOP_K=top_k, K_P2=triton.next_power_of_2(top_k),
        N_GROUP=n_group, G_P2=triton.next_power_of_2(n_group), GROUP=experts // n_group,
        TOPK_GROUP=topk_group, BLOCK_T=ROUTER_BLOCK_T, RENORMALIZE=True,
    )  # fmt: skip
    return _grouped_router_kernel, GROUPED_ROUTER, cx, router_warps(cx["E_P2"], topk_group < n_group), 3


def softmax_router_case(experts: int, top_k: int):
    """router_topk's launch: the softmax router of Qwen3-MoE, Qwen3-Next, gpt-oss, Mixtral."""
    import triton

    from overnight.kernels.moe_router import ROUTER_BLOCK_T, _router_topk_kernel, router_warps

    cx = dict(
        E=experts, E_P2=triton.next_power_of_2(experts), TOP_K=top_k, K_P2=triton.next_power_of_2(top_k),
        BLOCK_T=ROUTER_BLOCK_T, RENORMALIZE=True,
    )  # fmt: skip
    return _router_topk_kernel, ROUTER, cx, router_warps(cx["E_P2"]), 3


def norm_case(hidden: int, heads: int, residual: bool, fp8: bool, dense: bool):
    """offset_rms_norm's launch: a hidden-state norm (heads 1) or a per-head q/k norm."""
    import triton

    from overnight.kernels.rmsnorm import _num_warps, _rms_norm_kernel

    bh, bd = triton.next_power_of_2(heads), triton.next_power_of_2(hidden)
    cx = dict(
        H=heads, D=hidden, BLOCK_H=bh, BLOCK_D=bd, HAS_RESIDUAL=residual, FP8_OUT=fp8, OFFSET=True,
        DENSE_OUT=dense,
    )  # fmt: skip
    types = NORM if fp8 else {**NORM, "out_ptr": "*bf16"}
    return _rms_norm_kernel, types, cx, _num_warps(bh * bd), 3


CASES = {
    # GLM-4.5 (160 experts) / GLM-4.5-Air (128), one group, top 8
    "router-glm-4.5": lambda: router_case(160, 8, 1, 1),
    "router-glm-4.5-air": lambda: router_case(128, 8, 1, 1),
    # MiniMax-M2: 256 experts, top 8, one group
    "router-minimax-m2": lambda: router_case(256, 8, 1, 1),
    # LFM2-8B-A1B: 32 experts, top 4, one group
    "router-lfm2-8b-a1b": lambda: router_case(32, 4, 1, 1),
    # the grouped choice (DeepSeek-V3's shape: 8 groups, the best 4 kept)
    "router-grouped": lambda: router_case(256, 8, 8, 4),
    # the softmax router: Qwen3-Next-80B-A3B / Qwen3.5-MoE (512 experts, top 10), Qwen3-235B-A22B (128)
    "softmax-512": lambda: softmax_router_case(512, 10),
    "softmax-128": lambda: softmax_router_case(128, 8),
    "softmax-160": lambda: softmax_router_case(160, 8),  # Qwen3-Coder-480B-A35B (padded to 256)
    # Qwen3-Next-80B's hidden 2048: the input norm with both outputs, the final norm, q/k per head
    "norm-fp8-dense-residual": lambda: norm_case(2048, 1, True, True, True),
    "norm-fp8-residual": lambda: norm_case(2048, 1, True, True, False),
    "norm-bf16-residual": lambda: norm_case(2048, 1, True, False, False),
    "norm-qk-heads": lambda: norm_case(256, 16, False, False, False),
    # Qwen3.5-397B-A17B's hidden 4096
    "norm-fp8-dense-4096": lambda: norm_case(4096, 1, True, True, True),
}


def report() -> None:
    """The child process: compile every case, print their usage as one JSON object."""
    print(json.dumps({name: compile_sm90(*case()) for name, case in CASES.items()}))


@pytest.fixture(scope="module")
def usage() -> dict[str, list[int]]:
    return child_report("tests.test_kernels_router_norm_sm90")


@pytest.mark.parametrize("name", list(CASES))
def test_compiles_for_sm90_without_spills(usage: dict[str, list[int]], name: str) -> None:
    shared, regs, stack = usage[name]
    assert stack == 0, f"{name}: spills, {stack} bytes of stack ({regs} registers)"
    assert regs <= 255 and shared < 48 * 1024, (name, regs, shared)
