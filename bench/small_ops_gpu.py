"""GPU check and benchmark of the small-op Triton kernels against the unfused PyTorch ops they replace.

Run on the GPU machine from the repository root:  PYTHONPATH=. python bench/small_ops_gpu.py
Needs only torch + triton; under a minute. Fixed seed. Qwen3-8B shapes (hidden 4096, 32 query / 8 KV
heads of 128, intermediate 12288) at decode-like (512 rows) and prefill-like (16384 rows) batches.

1. Correctness: bf16 kernel output against the PyTorch reference run in bf16 (same rounding points:
   nearly every element should be equal, the rest an ulp or two off), both against an fp32 reference;
   fp32 inputs within 2e-6; q/k are strided views of a fused qkv tensor; a CUDA graph replay.
2. Timing: median of triton's do_bench (L2 flushed between runs), bytes that must move / time as GB/s
   against ~4.3 TB/s, for the kernel (a few num_warps) and the PyTorch ops; then one line of JSON.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import torch
import triton

from overnight.bench.gpu_info import sm_clock_now
from overnight.kernels.activation import silu_and_mul
from overnight.kernels.rmsnorm import add_rms_norm, rms_norm
from overnight.kernels.rotary import qk_norm_rotary_inplace, rotary_inplace
from overnight.layers.activation import silu_and_mul_ref
from overnight.layers.norm import add_rms_norm_ref, rms_norm_ref
from overnight.layers.rotary import RotaryEmbedding, rotary_ref

HBM_GBPS = 4300.0
HIDDEN, HQ, HKV, D, INTER = 4096, 32, 8, 128, 12288
MAX_POS, THETA, EPS = 40960, 1e6, 1e-6
SIZES = {"decode": 512, "prefill": 16384}
WARPS = {"rms_norm": [4, 8, 16], "add_rms_norm": [4, 8, 16], "rope": [2, 4, 8], "qk_norm_rope": [2, 4, 8]}
SILU_CONFIGS = [(1024, 4), (2048, 8), (512, 2)]  # (block, num_warps)
DT = torch.bfloat16
DEV = torch.device("cuda")

checks: list[tuple[str, bool, str]] = []
rows: list[dict] = []


def make_inputs(num_tokens: int, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=DEV).manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=gen, device=DEV)).to(dtype)

    def weight(n: int) -> torch.Tensor:
        return (1.0 + 0.4 * (torch.rand(n, generator=gen, device=DEV) - 0.5)).to(dtype)

    return dict(
        x=randn(num_tokens, HIDDEN),
        residual=randn(num_tokens, HIDDEN, scale=4.0),
        w=weight(HIDDEN),
        qkv=randn(num_tokens, (HQ + 2 * HKV) * D, scale=2.0),
        wq=weight(D),
        wk=weight(D),
        gate_up=randn(num_tokens, 2 * INTER, scale=3.0),
        positions=torch.randint(0, MAX_POS, (num_tokens,), generator=gen, device=DEV),
    )


def split(qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = qkv.shape[0]
    return qkv[:, : HQ * D].view(n, HQ, D), qkv[:, HQ * D : (HQ + HKV) * D].view(n, HKV, D)


def ops(cache: torch.Tensor) -> dict[str, tuple[Callable, Callable]]:
    """name -> (kernel(inputs) -> outputs, reference(inputs) -> outputs); the rotary kernels work in place
    on a copy of qkv, so both sides return q and k."""

    def rope_kernel(a: dict, norm: bool, **kw) -> tuple[torch.Tensor, ...]:
        q, k = split(a["qkv"].clone())
        if norm:
            qk_norm_rotary_inplace(a["positions"], q, k, cache, a["wq"], a["wk"], EPS, **kw)
        else:
            rotary_inplace(a["positions"], q, k, cache, **kw)
        return q, k

    def rope_ref(a: dict, norm: bool) -> tuple[torch.Tensor, ...]:
        q, k = split(a["qkv"])
        if norm:
            q, k = rms_norm_ref(q, a["wq"], EPS), rms_norm_ref(k, a["wk"], EPS)
        return rotary_ref(a["positions"], q, k, cache)

    return {
        "rms_norm": (
            lambda a: (rms_norm(a["x"], a["w"], EPS),),
            lambda a: (rms_norm_ref(a["x"], a["w"], EPS),),
        ),
        "add_rms_norm": (
            lambda a: add_rms_norm(a["x"], a["residual"], a["w"], EPS),
            lambda a: add_rms_norm_ref(a["x"], a["residual"], a["w"], EPS),
        ),
        "rope": (lambda a: rope_kernel(a, False), lambda a: rope_ref(a, False)),
        "qk_norm_rope": (lambda a: rope_kernel(a, True), lambda a: rope_ref(a, True)),
        "silu_and_mul": (
            lambda a: (silu_and_mul(a["gate_up"]),),
            lambda a: (silu_and_mul_ref(a["gate_up"]),),
        ),
    }


def moved_bytes(name: str, num_tokens: int) -> int:
    """Bytes that must cross HBM (bf16 activations; weights and table rows counted where per-token)."""
    e = 2
    if name == "rms_norm":
        return 2 * num_tokens * HIDDEN * e
    if name == "add_rms_norm":
        return 4 * num_tokens * HIDDEN * e
    if name in ("rope", "qk_norm_rope"):
        return num_tokens * (2 * (HQ + HKV) * D * e + D * 4 + 8)  # q/k read + written, cos/sin row, position
    return 3 * num_tokens * INTER * e  # silu_and_mul: [T, 2I] read, [T, I] written


def record_check(name: str, ok: bool, detail: str) -> None:
    checks.append((name, ok, detail))
    print(f"  {'ok  ' if ok else 'FAIL'} {name:<44} {detail}")


def compare(name: str, outs: tuple, refs: tuple, exact_refs: tuple | None) -> None:
    """bf16: equal to the bf16 reference but for a few flips of an ulp or two; fp32: a few fp32 ulps."""
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        label = f"{name}[{i}] {str(out.dtype).removeprefix('torch.')}"
        diff = (out.float() - ref.float()).abs()
        if out.dtype == torch.float32:  # allclose(rtol=2e-6, atol=2e-6) on O(1) values
            worst = (diff / (2e-6 * ref.abs() + 2e-6)).max().item()
            record_check(
                label, worst <= 1.0, f"max |diff| {diff.max().item():.1e} ({worst:.2f} of tolerance)"
            )
            continue
        # A flip in an intermediate rounding moves a result by about an ulp of its inputs, which is more
        # ulps of the result where the rotation cancels: measure against |ref| + the mean magnitude.
        equal = (out == ref).float().mean().item()
        ulps = (
            (diff / ((ref.float().abs() + ref.float().abs().mean()) * torch.finfo(out.dtype).eps))
            .max()
            .item()
        )
        detail = f"equal {100 * equal:.3f}%, max diff {ulps:.2f} ulp"
        if exact_refs is not None:  # both against the fp32 reference: the kernel is no less accurate
            exact = exact_refs[i].float()
            err_k = ((out.float() - exact).abs().max() / exact.abs().max()).item()
            err_t = ((ref.float() - exact).abs().max() / exact.abs().max()).item()
            detail += f"; vs fp32 ref: kernel {err_k:.1e}, torch {err_t:.1e}"
        record_check(label, equal >= 0.99 and ulps <= 2.0, detail)


def check_correctness(table: dict[str, tuple[Callable, Callable]], cache: torch.Tensor) -> None:
    for dtype in (DT, torch.float32):
        a = make_inputs(SIZES["decode"] + 77, dtype, seed=1)  # odd row count
        a32 = {k: (v.float() if v.is_floating_point() else v) for k, v in a.items()}
        for name, (kernel, ref) in table.items():
            exact = ref(a32) if dtype != torch.float32 else None
            compare(name, kernel(a), ref(a), exact)
        if dtype == DT:  # the qkv tensor outside q and k (v) must be untouched by the in-place rotation
            qkv = a["qkv"].clone()
            q, k = split(qkv)
            qk_norm_rotary_inplace(a["positions"], q, k, cache, a["wq"], a["wk"], EPS)
            record_check(
                "qk_norm_rope leaves v untouched",
                torch.equal(qkv[:, (HQ + HKV) * D :], a["qkv"][:, (HQ + HKV) * D :]),
                "",
            )


def check_cuda_graph(cache: torch.Tensor) -> None:
    """Capture add_rms_norm -> qk_norm_rope -> silu_and_mul, replay on new values, compare with eager."""
    a = make_inputs(256, DT, seed=2)
    qkv = a["qkv"].clone()
    q, k = split(qkv)

    def step() -> tuple[torch.Tensor, ...]:
        normed, res = add_rms_norm(a["x"], a["residual"], a["w"], EPS)
        qk_norm_rotary_inplace(a["positions"], q, k, cache, a["wq"], a["wk"], EPS)
        return normed, res, silu_and_mul(a["gate_up"])

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    fresh = make_inputs(256, DT, seed=3)
    for key in ("x", "residual", "gate_up", "positions"):
        a[key].copy_(fresh[key])
    qkv.copy_(fresh["qkv"])
    graph.replay()
    torch.cuda.synchronize()
    expected_q, expected_k = split(fresh["qkv"].clone())
    qk_norm_rotary_inplace(fresh["positions"], expected_q, expected_k, cache, a["wq"], a["wk"], EPS)
    expected = (*add_rms_norm(fresh["x"], fresh["residual"], a["w"], EPS), silu_and_mul(fresh["gate_up"]))
    same = all(torch.equal(o, e) for o, e in zip(outs, expected, strict=True))
    same = same and torch.equal(q, expected_q) and torch.equal(k, expected_k)
    record_check("CUDA graph replay on new inputs (bitwise)", same, "")


def time_us(fn: Callable[[], object]) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3


def bench(table: dict[str, tuple[Callable, Callable]], cache: torch.Tensor) -> None:
    print(
        f"{'op':<13} {'size':<8} {'rows':>6} {'config':<12} {'us':>8} {'GB/s':>7} {'% HBM':>6}  {'torch us':>8} {'speedup':>7}"
    )
    for size, num_tokens in SIZES.items():
        a = make_inputs(num_tokens, DT, seed=4)
        for name, (_, ref) in table.items():
            gb = moved_bytes(name, num_tokens) / 1e9
            torch_us = time_us(lambda ref=ref, a=a: ref(a))
            configs = [f"w{w}" for w in WARPS.get(name, [])] or [f"b{b} w{w}" for b, w in SILU_CONFIGS]
            for config in configs:
                fn = kernel_with(name, config, a, cache)
                us = time_us(fn)
                gbps = gb / us * 1e6
                rows.append(
                    dict(
                        op=name,
                        size=size,
                        rows=num_tokens,
                        config=config,
                        us=us,
                        gbps=gbps,
                        torch_us=torch_us,
                    )
                )
                print(
                    f"{name:<13} {size:<8} {num_tokens:>6} {config:<12} {us:8.1f} {gbps:7.0f} {100 * gbps / HBM_GBPS:5.1f}%"
                    f"  {torch_us:8.1f} {torch_us / us:6.2f}x"
                )


def kernel_with(name: str, config: str, a: dict, cache: torch.Tensor) -> Callable[[], object]:
    """The kernel call alone (in place on a's qkv for the rotary ops: repeated rotation is fine for timing)."""
    warps = int(config.rsplit("w", 1)[1])
    q, k = split(a["qkv"])
    if name == "rms_norm":
        return lambda: rms_norm(a["x"], a["w"], EPS, num_warps=warps)
    if name == "add_rms_norm":
        return lambda: add_rms_norm(a["x"], a["residual"], a["w"], EPS, num_warps=warps)
    if name == "rope":
        return lambda: rotary_inplace(a["positions"], q, k, cache, num_warps=warps)
    if name == "qk_norm_rope":
        return lambda: qk_norm_rotary_inplace(
            a["positions"], q, k, cache, a["wq"], a["wk"], EPS, num_warps=warps
        )
    block = int(config.split()[0][1:])
    return lambda: silu_and_mul(a["gate_up"], block=block, num_warps=warps)


def main() -> None:
    start = time.time()
    props = torch.cuda.get_device_properties(DEV)
    print(
        f"{props.name}, torch {torch.__version__}, triton {triton.__version__}, SM clock (now, max): {sm_clock_now()}"
    )
    cache = RotaryEmbedding(D, MAX_POS, THETA).cos_sin_cache.to(DEV)
    table = ops(cache)
    print("correctness:")
    check_correctness(table, cache)
    check_cuda_graph(cache)
    print(f"timing (median of do_bench, L2 flushed; HBM peak {HBM_GBPS:.0f} GB/s):")
    bench(table, cache)
    best = {}
    for r in rows:
        key = f"{r['op']} {r['size']}"
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    print("best config per op and size:")
    for key, r in best.items():
        print(
            f"  {key:<22} {r['config']:<10} {r['us']:7.1f} us  {r['gbps']:5.0f} GB/s  {r['torch_us'] / r['us']:.2f}x torch"
        )
    failed = [name for name, ok, _ in checks if not ok]
    print(
        f"checks: {len(checks) - len(failed)}/{len(checks)} passed"
        + (f"; FAILED: {failed}" if failed else "")
    )
    print(f"total {time.time() - start:.0f} s")
    summary = {
        key: dict(
            config=r["config"], us=round(r["us"], 1), gbps=round(r["gbps"]), torch_us=round(r["torch_us"], 1)
        )
        for key, r in best.items()
    }
    print(
        json.dumps(
            dict(
                bench="small_ops",
                device=props.name,
                sm_clock=sm_clock_now(),
                checks_failed=failed,
                best=summary,
            )
        )
    )


if __name__ == "__main__":
    main()
