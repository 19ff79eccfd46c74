"""GPU check and benchmark of the Mamba2 mixer ops (Granite 4.0 hybrids): the torch reference path
(layers/mamba2_ops.py TorchMamba2Ops: chunked SSD prefill, recurrent decode) against the Triton path
(conv_step with the conv bias, then kernels/mamba2_scan.py's decode step and chunked varlen prefill;
"tok-seq" rows: the token-by-token varlen prefill kernel instead).

Run on the GPU machine from the repository root:  PYTHONPATH=. python bench/mamba2_gpu.py
(--smoke: tiny shapes on the CPU through the Triton interpreter, to check the script itself.)
Fixed seed; well under a minute. granite-4.0-h-small's Mamba2 layer (loader/presets/granite-4.0-h-small.json):
128 heads of 64, d_state 128, one B/C group, conv kernel 4 over 8,448 channels; one layer. --nano-v2:
NVIDIA-Nemotron-Nano-9B-v2's instead (loader/presets/nemotron-nano-9b-v2.json): 128 heads of 80,
d_state 128, 8 B/C groups, conv kernel 4 over 12,288 channels.

1. Correctness (PASS/FAIL lines): the Triton path against the torch path on the same inputs, relative
   error ||out - ref|| / ||ref|| in float64, for bf16 and fp32 inputs: requests at slots that are not
   0..n-1, some starting from zeros over NaN-poisoned slots; a prompt prefilled in two chunks, then three
   decode steps (states carried); the decode ops captured in a CUDA graph and replayed with new inputs.
2. Timing: decode at batch 1/64/256 (CUDA-graph replays, as the engine runs decode steps), prefill of
   16 x 512 and 4 x 2048 tokens (eager); SSM state bytes read and written per second against ~4.3 TB/s
   for decode. A table, then one line of JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402

from overnight.attention.linear_state import LinearStateBatch  # noqa: E402
from overnight.layers.gated_delta_ops import PrefillRows  # noqa: E402
from overnight.layers.mamba2_ops import Mamba2Layer, TorchMamba2Ops, TritonMamba2Ops  # noqa: E402

NANO_V2 = "--nano-v2" in sys.argv
if SMOKE:
    H, P, N, G, KW = (4, 20, 8, 2, 4) if NANO_V2 else (4, 16, 8, 1, 4)
else:
    H, P, N, G, KW = (128, 80, 128, 8, 4) if NANO_V2 else (128, 64, 128, 1, 4)
CONV_DIM = H * P + 2 * G * N
HBM_GBPS = 4300.0
DEV = torch.device("cpu" if SMOKE else "cuda")
DECODE_BATCHES = [1, 4] if SMOKE else [1, 64, 256]
PREFILLS = [(2, 16)] if SMOKE else [(16, 512), (4, 2048)]
NUM_SLOTS = 8 if SMOKE else 300
TORCH, TRITON = TorchMamba2Ops(), TritonMamba2Ops()


SEQUENTIAL = TritonMamba2Ops(chunked_prefill=False)  # the token-by-token varlen kernel
checks: list[tuple[str, bool]] = []
rows: list[dict] = []


def make_layer(dtype: torch.dtype, gen: torch.Generator) -> Mamba2Layer:
    return Mamba2Layer(
        H,
        P,
        G,
        N,
        (0.5 * torch.randn(CONV_DIM, KW, generator=gen)).to(DEV, dtype),
        (0.1 * torch.randn(CONV_DIM, generator=gen)).to(DEV, dtype),
        torch.arange(1, H + 1, dtype=torch.float32).log().to(DEV),  # as transformers initialises A
        torch.rand(H, generator=gen).to(DEV, dtype),
        torch.ones(H, device=DEV, dtype=dtype),
        (0.0, float("inf")),
    )


def make_rows(n: int, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """x|B|C [n, conv_dim] and dt [n, H]: views of one projection, as the mixer hands them over."""
    proj = torch.randn(n, CONV_DIM + H, generator=gen).to(DEV, dtype)
    xbc, dt = proj.split([CONV_DIM, H], dim=-1)
    return xbc, dt


def make_pools(gen: torch.Generator, ssm_dtype: torch.dtype = torch.float32):
    conv = torch.randn(NUM_SLOTS + 1, KW - 1, CONV_DIM, generator=gen).to(DEV)
    ssm = (0.1 * torch.randn(NUM_SLOTS + 1, H, P, N, generator=gen)).to(DEV, ssm_dtype)
    return conv, ssm


def state_batch(slots: list[int], has: list[bool]) -> LinearStateBatch:
    return LinearStateBatch(
        [],
        [],
        torch.tensor(slots, device=DEV),
        torch.tensor([1.0 if h else 0.0 for h in has], device=DEV),
        slots,
        has,
    )


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def record(name: str, err: float, tol: float) -> None:
    ok = err <= tol and err == err  # NaN fails
    checks.append((name, ok))
    print(f"{'PASS' if ok else 'FAIL'}  {name}: rel err {err:.2e} (tol {tol:.0e})", flush=True)


def check_chunks_then_decode(dtype: torch.dtype, tol: float) -> None:
    gen = torch.Generator().manual_seed(1)
    layer = make_layer(dtype, gen)
    conv, ssm = make_pools(gen)
    conv[[0, 3]], ssm[[0, 3]] = float("nan"), float("nan")  # fresh requests' slots: never read
    ref_conv, ref_ssm = conv.clone(), ssm.clone()
    slots = [3, 5, 0]
    lens = [[7, 33, 1], [40, 2, 17]] if not SMOKE else [[3, 5, 1], [4, 2, 6]]
    for i, chunk in enumerate(lens):  # two prefill chunks: the second continues every request
        has = [i > 0 or s == 5 for s in slots]
        rows = PrefillRows.of(chunk, slots, has, DEV)
        xbc, dt = make_rows(sum(chunk), dtype, gen)
        seq_conv, seq_ssm = conv.clone(), ssm.clone()
        y = TRITON.prefill(layer, xbc, dt, conv, ssm, rows)
        y_ref = TORCH.prefill(layer, xbc, dt, ref_conv, ref_ssm, rows)
        record(f"{dtype} prefill chunk {i + 1}", rel_err(y, y_ref), tol)
        y_seq = SEQUENTIAL.prefill(layer, xbc, dt, seq_conv, seq_ssm, rows)
        record(f"{dtype} prefill chunk {i + 1}, token-by-token kernel", rel_err(y_seq, y_ref), tol)
    st = state_batch(slots, [True] * 3)
    for step in range(3):
        xbc, dt = make_rows(3, dtype, gen)
        y = TRITON.decode(layer, xbc, dt, conv, ssm, st)
        y_ref = TORCH.decode(layer, xbc, dt, ref_conv, ref_ssm, st)
        record(f"{dtype} decode step {step + 1}", rel_err(y, y_ref), tol)
    record(f"{dtype} final states", rel_err(ssm[slots], ref_ssm[slots]), tol)
    untouched = [s for s in range(NUM_SLOTS + 1) if s not in slots]
    checks.append((f"{dtype} other slots untouched", bool(torch.equal(ssm[untouched], ref_ssm[untouched]))))


def check_graph() -> None:
    gen = torch.Generator().manual_seed(2)
    layer = make_layer(torch.bfloat16, gen)
    conv, ssm = make_pools(gen)
    st = state_batch([4, 1], [True, True])
    xbc, dt = make_rows(2, torch.bfloat16, gen)
    conv0, ssm0 = conv.clone(), ssm.clone()
    eager = TRITON.decode(layer, xbc, dt, conv, ssm, st).clone()
    eager_ssm = ssm.clone()
    conv.copy_(conv0), ssm.copy_(ssm0)
    static_xbc, static_dt = make_rows(2, torch.bfloat16, gen)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = TRITON.decode(layer, static_xbc, static_dt, conv, ssm, st)
    conv.copy_(conv0), ssm.copy_(ssm0)
    static_xbc.copy_(xbc), static_dt.copy_(dt)
    graph.replay()
    same = bool(torch.equal(out, eager)) and bool(torch.equal(ssm, eager_ssm))
    checks.append(("cuda graph replay", same))
    print(f"{'PASS' if same else 'FAIL'}  decode ops in a CUDA graph: replay == eager", flush=True)


def time_us(fn, reps: int, graph: bool) -> float:
    fn()  # compile / warm up
    run = fn
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    if DEV.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(reps):
            run()
        return (time.perf_counter() - t0) / reps * 1e6
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1e3


def bench(ssm_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    layer = make_layer(torch.bfloat16 if not SMOKE else torch.float16, gen)
    conv, ssm = make_pools(gen, ssm_dtype)
    reps = 2 if SMOKE else 50
    for b in DECODE_BATCHES:
        slots = list(range(0, 2 * b, 2))[:b] if 2 * b <= NUM_SLOTS else list(range(b))
        st = state_batch(slots, [True] * b)
        xbc, dt = make_rows(b, layer.conv_weight.dtype, gen)
        for name, ops in (("torch", TORCH), ("triton", TRITON)):
            us = time_us(
                lambda ops=ops, xbc=xbc, dt=dt, st=st: ops.decode(layer, xbc, dt, conv, ssm, st),
                reps,
                DEV.type == "cuda",
            )
            state_bytes = 2 * b * H * P * N * ssm.element_size()
            gbps = state_bytes / us / 1e3
            rows.append(
                dict(
                    kind="decode",
                    batch=b,
                    path=name,
                    ssm=str(ssm_dtype)[6:],
                    us=round(us, 1),
                    gbps=round(gbps),
                )
            )
    for n, length in PREFILLS:
        rws = PrefillRows.of([length] * n, list(range(n)), [False] * n, DEV)
        xbc, dt = make_rows(n * length, layer.conv_weight.dtype, gen)
        for name, ops in (("torch", TORCH), ("triton", TRITON), ("tok-seq", SEQUENTIAL)):
            us = time_us(
                lambda ops=ops, xbc=xbc, dt=dt, rws=rws: ops.prefill(layer, xbc, dt, conv, ssm, rws),
                max(1, reps // 10),
                False,
            )
            rows.append(
                dict(
                    kind="prefill",
                    batch=f"{n}x{length}",
                    path=name,
                    ssm=str(ssm_dtype)[6:],
                    us=round(us, 1),
                    gbps=0,
                )
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (Triton interpreter)")
    parser.add_argument(
        "--nano-v2", action="store_true", help="NVIDIA-Nemotron-Nano-9B-v2's layer (head size 80, 8 groups)"
    )
    parser.parse_args()
    torch.manual_seed(0)
    check_chunks_then_decode(torch.float32, 1e-4)
    check_chunks_then_decode(torch.float16 if SMOKE else torch.bfloat16, 2e-2)
    if DEV.type == "cuda":
        check_graph()
    bench(torch.float32)
    bench(torch.bfloat16 if not SMOKE else torch.float16)
    print(f"\n{'kind':8} {'batch':>8} {'path':>7} {'ssm':>9} {'us':>10} {'state GB/s':>11}")
    for r in rows:
        print(f"{r['kind']:8} {r['batch']!s:>8} {r['path']:>7} {r['ssm']:>9} {r['us']:>10} {r['gbps']:>11}")
    failed = [name for name, ok in checks if not ok]
    shape = dict(heads=H, head_dim=P, d_state=N, groups=G)
    print(json.dumps(dict(bench="mamba2_gpu", shape=shape, failed=failed, rows=rows, hbm_gbps=HBM_GBPS)))
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
