"""GPU check and benchmark of Nemotron 3's MoE block (models/nemotron_h_mlp.py NemotronHMoE) at
NVIDIA-Nemotron-3-Nano-30B-A3B's shapes (loader/presets/nemotron-3-nano-30b-a3b.json): hidden 2688, 128
ungated relu^2 experts of 1856 (6 a token) behind the grouped sigmoid router, a shared expert of 3712.

Run on the GPU machine from the repository root:  PYTHONPATH=. python bench/nemotron3_moe_gpu.py
(--smoke: tiny shapes on the CPU through the Triton interpreter, to check the script itself.)
Fixed seed; about a minute, most of it compiling.

1. Correctness (PASS/FAIL lines), bf16 weights and inputs: the block on its GPU path (router kernel,
   fused experts with the relu^2 epilogue, shared expert) against the same block on the torch path
   (layers/moe.py's per-expert loop, the router's reference) in float32, relative error ||out - ref|| /
   ||ref|| over the rows both route to the same experts (near-ties may go either way in bf16: rows
   whose expert sets differ are counted and must be few). FP8 experts (e4m3, a scale per expert and row)
   against the torch path dequantizing the same e4m3 weights. The block captured in a CUDA graph at a
   decode batch and replayed on new inputs equals an eager run.
2. Timing: the block at 1 / 16 / 64 / 256 / 1024 / 4096 tokens (CUDA-graph replays, as the engine runs
   decode steps), bf16 and FP8 experts, with the bytes of the experts actually hit per call against
   ~4.3 TB/s (what a decode step must read). A table, then one line of JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import replace

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402

from overnight.kernels import dispatch  # noqa: E402
from overnight.loader.resolve import resolve_source  # noqa: E402
from overnight.models.nemotron_h_mlp import NemotronHMoE  # noqa: E402

DEV = torch.device("cpu" if SMOKE else "cuda")
HBM_GBPS = 4300.0
SIZES = [1, 4] if SMOKE else [1, 16, 64, 256, 1024, 4096]
DECODE_BATCH = 4 if SMOKE else 64


def make_block(dtype: torch.dtype, seed: int = 0) -> NemotronHMoE:
    arch = resolve_source("nemotron-3-nano-30b-a3b", load_format="dummy").arch
    if SMOKE:
        arch = replace(
            arch, hidden_size=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
        )  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    block = NemotronHMoE(arch)
    with torch.no_grad():
        for name, p in block.named_parameters():
            if name.endswith("e_score_correction_bias"):
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
            else:  # unit-variance outputs for unit-variance inputs
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    block.gate.to(DEV)  # the router stays float32
    block.experts.to(DEV, dtype)
    block.shared_experts.to(DEV, dtype)
    return block.eval()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


@contextlib.contextmanager
def path(kernels: bool) -> Iterator[None]:
    """Every layer on the Triton path (kernels) or the torch one, whatever the device."""
    before, dispatch.FORCE_KERNELS = dispatch.FORCE_KERNELS, kernels
    try:
        with torch.no_grad():
            yield
    finally:
        dispatch.FORCE_KERNELS = before


def run(block: NemotronHMoE, x: torch.Tensor, kernels: bool) -> torch.Tensor:
    with path(kernels):
        return block(x)


def check(results: dict[str, object]) -> bool:
    ok = True
    dtype = torch.float16 if SMOKE else torch.bfloat16
    block = make_block(dtype)
    reference = make_block(torch.float32)
    gen = torch.Generator().manual_seed(1)
    for t in SIZES[:3]:
        x = torch.randn(t, block.gate.weight.shape[1], generator=gen).to(DEV, dtype)
        with path(True):
            _, ids = block.gate(x)
        with path(False):
            _, ref_ids = reference.gate(x.float())
        same = (ids.sort(-1).values == ref_ids.sort(-1).values).all(-1)
        differ = int((~same).sum())
        # over the rows routed alike: a near-tie routed elsewhere is bf16's, not an error
        err = rel_err(run(block, x, True)[same], run(reference, x.float(), False)[same])
        passed = err < 2e-2 and differ <= max(1, t // 50)
        ok &= passed
        print(
            f"{'PASS' if passed else 'FAIL'} {str(dtype)[6:]} block T={t}: rel err {err:.2e}, {differ} rows route elsewhere"
        )
        results[f"bf16_err_T{t}"] = err
    fp8 = make_block(dtype)
    fp8.experts.quantize_fp8_()
    x = torch.randn(SIZES[-1] if SMOKE else 64, fp8.gate.weight.shape[1], generator=gen).to(DEV, dtype)
    err = rel_err(run(fp8, x, True), run(fp8, x, False).float())
    passed = err < 2e-2
    ok &= passed
    print(f"{'PASS' if passed else 'FAIL'} fp8 experts: fused vs torch path rel err {err:.2e}")
    results["fp8_err"] = err
    if not SMOKE:  # CUDA-graph capture and replay at a decode batch
        static = torch.randn(DECODE_BATCH, block.gate.weight.shape[1], device=DEV, dtype=dtype)
        with path(True):
            block(static)  # compile outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = block(static)
            fresh = torch.randn_like(static)
            static.copy_(fresh)
            graph.replay()
            same = torch.equal(out, block(fresh))
        ok &= same
        print(f"{'PASS' if same else 'FAIL'} CUDA graph replay at {DECODE_BATCH} tokens equals eager")
    return ok


def bench(results: dict[str, object]) -> None:
    if SMOKE:
        return
    sys.path.insert(0, "bench")
    from gpu_timing import graph_time

    print(f"\n{'tokens':>7} {'bf16 us':>9} {'fp8 us':>9} {'hit GB':>8} {'bf16 GB/s':>10} {'fp8 GB/s':>9}")
    blocks = {"bf16": make_block(torch.bfloat16), "fp8": make_block(torch.bfloat16)}
    blocks["fp8"].experts.quantize_fp8_()
    rows = []
    with path(True):
        for t in SIZES:
            x = torch.randn(t, 2688, device=DEV, dtype=torch.bfloat16)
            times = {name: graph_time([lambda b=block, x=x: b(x)]) for name, block in blocks.items()}
            _, ids = blocks["bf16"].gate(x)
            hit = int(torch.unique(ids).numel())
            experts = blocks["bf16"].experts
            per_expert = experts.gate_up_proj[0].numel() + experts.down_proj[0].numel()
            gb = {"bf16": hit * per_expert * 2 / 1e9, "fp8": hit * per_expert / 1e9}
            rate = {k: gb[k] / (times[k] * 1e-6) for k in times}
            print(
                f"{t:>7} {times['bf16']:>9.1f} {times['fp8']:>9.1f} {gb['bf16']:>8.3f} {rate['bf16']:>10.0f} "
                f"{rate['fp8']:>9.0f}"
            )
            rows.append({"tokens": t, "us": times, "experts_hit": hit, "gbps": rate})
    results["timing"] = rows
    results["hbm_gbps"] = HBM_GBPS


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (Triton interpreter)")
    parser.parse_args()
    torch.manual_seed(0)
    t0 = time.time()
    results: dict[str, object] = {"device": "cpu" if SMOKE else torch.cuda.get_device_name()}
    ok = check(results)
    bench(results)
    results["ok"], results["seconds"] = ok, round(time.time() - t0, 1)
    print(json.dumps(results))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
