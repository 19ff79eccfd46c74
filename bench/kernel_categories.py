"""GPU kernel names to categories, shared by bench/profile_gpu.py (ours) and bench/profile_vllm.py (vLLM),
so both engines' step time is split the same way. First match wins; the patterns cover our kernels and
the names vLLM 0.26 launches (FlashAttention-3, its fused MoE, cuBLAS / CUTLASS GEMMs, Inductor's fused
Triton kernels)."""

from __future__ import annotations

import re

CATEGORIES = [
    ("moe gemm", re.compile(r"_moe_gemm|fused_moe_kernel", re.I)),  # grouped expert GEMMs
    ("moe routing", re.compile(r"_router_topk|_moe_align|moe_align|topk_softmax|topk_sigmoid", re.I)),
    ("attention", re.compile(r"_decode|_prefill|kv_write|flash|attn|reshape_and_cache", re.I)),
    ("fp8 quant", re.compile(r"quant", re.I)),
    ("gemm", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|matmul|sm90_", re.I)),
    ("norm/rope/silu", re.compile(r"rms|norm|rotary|rope|silu|rsqrt|_add_", re.I)),
    ("sampling", re.compile(r"argmax|max|softmax|topk|sort|gather|index", re.I)),
]


def category(name: str) -> str:
    for cat, rx in CATEGORIES:
        if rx.search(name):
            return cat
    return "other"


def kernel_times(prof) -> tuple[dict[str, float], dict[str, float]]:
    """(ms by category, ms by kernel name) of the CUDA kernels a torch.profiler run recorded."""
    import torch

    by_cat: dict[str, float] = {}
    top: dict[str, float] = {}
    for evt in prof.key_averages():
        t = getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0)
        if t <= 0 or evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        c = category(evt.key)
        by_cat[c] = by_cat.get(c, 0.0) + t / 1e3
        top[evt.key] = top.get(evt.key, 0.0) + t / 1e3
    return by_cat, top


# Enough rows that a small category's kernels show one by one (session L's MoE routing: 985 ms over
# four kernels, which the category total alone cannot split).
TOP_KERNELS = 30


def print_breakdown(title: str, wall_s: float, by_cat: dict[str, float], top: dict[str, float]) -> None:
    gpu_ms = sum(by_cat.values())
    print(f"\n{title}")
    print(f"wall {wall_s * 1e3:.1f} ms, GPU kernel time {gpu_ms:.1f} ms ({gpu_ms / (wall_s * 1e3):.0%} busy)")
    for cat, ms in sorted(by_cat.items(), key=lambda kv: -kv[1]):
        print(f"  {cat:<16} {ms:9.1f} ms  {ms / gpu_ms:6.1%}")
    print("top kernels:")
    for name, ms in sorted(top.items(), key=lambda kv: -kv[1])[:TOP_KERNELS]:
        print(f"  {ms:9.1f} ms  {category(name):<15} {name[:90]}")
