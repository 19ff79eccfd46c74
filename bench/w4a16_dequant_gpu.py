"""W4A16 past the fused tiers: what the dequantize + cuBLAS path costs at a decode step's rows, and three
ways it could cost less (~15 s on an H100).

Run on a GPU from the repository root:  PYTHONPATH=. python3 bench/w4a16_dequant_gpu.py [--m 530]; \
                                        nvidia-smi --query-gpu=clocks.sm --format=csv

From MMA_DEQUANT_GEMM_MIN_M rows (385) kernels/w4a16_gemm.py dequantizes each layer's whole int4 weight
into a bf16 buffer and hands it to cuBLAS. Qwen3-32B-AWQ with an FP8 KV cache decodes ~530 requests a
step on an H100, and there that pass is a third of the step (docs/performance.md, session AB). At
Qwen3-32B's shapes (bench/w4a16_variants_gpu.py's MID_SHAPES, int4 groups of 128, words in MMA order):

1. the dequantization alone (and its bandwidth beside a bf16 copy of the same size), cuBLAS on its
   output, the two together (the module's path), and the fused kernel's 128 x 128 and 128 x 256 tiles;
2. the dequantization's tile (BLOCK_N x warps) and program order (the grid walking K first, as the
   module does by default since session AC, or N first), each output checked bit-equal to the module's;
3. LAYERS layers one after the other, the next layer's weight dequantized on a second stream while
   cuBLAS multiplies this one (two buffers, events), against the same serially.

Times: CUDA events around REPS back-to-back calls (the gate_up weight's 131 MB of words miss L2), after
one warm-up call that compiles.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import replace

import torch
import triton

sys.path.insert(0, ".")

from bench.w4a16_variants_gpu import MID_SHAPES, int4_weight  # noqa: E402
from overnight.kernels import w4a16_gemm as wg  # noqa: E402

GROUP = 128
REPS = 20
LAYERS = 8
FUSED_TILES = ((128, 128), (128, 256))
DEQUANT_TILES = tuple((bn, warps, km) for km in (False, True) for bn in (32, 64, 128) for warps in (2, 4, 8))


def event_us(fn: Callable[[], object], reps: int = REPS) -> float:
    """Microseconds a call: one warm-up call, then reps calls between two CUDA events."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def dequant_into(
    w: torch.Tensor, words: torch.Tensor, scale: torch.Tensor, bn: int, warps: int, k_major: bool = False
) -> None:
    """The module's dequantization (symmetric codes, MMA order) with another tile and program order
    (k_major: the grid walks K first), into w."""
    wg.dequantize_into(w, words, scale, None, 4, GROUP, True, block_n=bn, num_warps=warps, k_major=k_major)


def weights(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    words, scale, _ = int4_weight(n, k, zeros=False, seed=seed)
    return wg.to_mma_order(words), scale


def paths(m: int) -> None:
    print(f"\n== 1. per layer at {m} rows, us ==")
    for name, (n, k) in MID_SHAPES.items():
        print(path_row(name, n, k, m), flush=True)


def path_row(name: str, n: int, k: int, m: int) -> str:
    words, scale = weights(n, k)
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")

    def dequantize() -> torch.Tensor:
        return wg.dequantize_int_weight(words, scale, None, 4, GROUP, torch.bfloat16, mma_order=True)

    dense = dequantize()
    src, dst = torch.empty_like(dense), torch.empty_like(dense)
    dq, copy = event_us(dequantize), event_us(lambda: dst.copy_(src))
    gemm = event_us(lambda: x @ dense.t())
    both = event_us(lambda: wg.w4a16_linear(x, words, scale, None, 4, GROUP, mma_order=True))
    nbytes = words.numel() * 4 + dense.numel() * 2
    line = (
        f"{name} {n}x{k}: dequantize {dq:.0f} ({nbytes / dq / 1e6:.2f} TB/s; a bf16 copy "
        f"{2 * dense.numel() * 2 / copy / 1e6:.2f}), cuBLAS {gemm:.0f}, both (the module) {both:.0f}"
    )
    for bm, bn in FUSED_TILES:
        cfg = replace(wg.default_config(300, True), block_m=bm, block_n=bn, swap_ab=False)
        try:
            line += f", fused {bm}x{bn} {fused_us(x, words, scale, cfg):.0f}"
        except triton.runtime.errors.OutOfResources:
            line += f", fused {bm}x{bn} out of shared memory"
    return line


def fused_us(x: torch.Tensor, words: torch.Tensor, scale: torch.Tensor, cfg: wg.W4A16Config) -> float:
    return event_us(lambda: wg.w4a16_gemm(x, words, scale, None, 4, GROUP, config=cfg, mma_order=True))


def dequant_tiles() -> None:
    print("\n== 2. the dequantization's tile, us ==")
    for name in ("gate_up", "down"):
        n, k = MID_SHAPES[name]
        words, scale = weights(n, k)
        ref = wg.dequantize_int_weight(words, scale, None, 4, GROUP, torch.bfloat16, mma_order=True)
        cells = []
        for bn, warps, km in DEQUANT_TILES:
            w = torch.empty_like(ref)
            us = tile_us(w, words, scale, bn, warps, km)
            cells.append(
                f"{'K' if km else 'N'}-first {bn}x{warps}w {us:.0f}{'' if torch.equal(w, ref) else ' MISMATCH'}"
            )
        print(f"{name}: " + ", ".join(cells), flush=True)


def tile_us(
    w: torch.Tensor, words: torch.Tensor, scale: torch.Tensor, bn: int, warps: int, km: bool
) -> float:
    return event_us(lambda: dequant_into(w, words, scale, bn, warps, km))


def two_streams(m: int) -> None:
    print(f"\n== 3. {LAYERS} layers, the next one's dequantization on a second stream, us a layer ==")
    for name in ("gate_up", "down"):
        print(streams_row(name, m), flush=True)


def streams_row(name: str, m: int) -> str:
    n, k = MID_SHAPES[name]
    layers = [weights(n, k, seed=i) for i in range(LAYERS)]
    bufs = [torch.empty(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()

    def serial() -> None:
        for words, scale in layers:
            dequant_into(bufs[0], words, scale, 32, 4)
            torch.matmul(x, bufs[0].t(), out=out)

    def overlapped() -> None:
        main = torch.cuda.current_stream()
        ready = [torch.cuda.Event() for _ in layers]
        done = [torch.cuda.Event() for _ in layers]
        side.wait_stream(main)
        for i in range(-1, LAYERS):
            if i + 1 < LAYERS:  # dequantize layer i + 1 once layer i - 1 has released its buffer
                with torch.cuda.stream(side):
                    if i >= 1:
                        side.wait_event(done[i - 1])
                    dequant_into(bufs[(i + 1) % 2], *layers[i + 1], 32, 4)
                    ready[i + 1].record(side)
            if i >= 0:
                main.wait_event(ready[i])
                torch.matmul(x, bufs[i % 2].t(), out=out)
                done[i].record(main)
        main.wait_stream(side)

    s, o = event_us(serial, 5) / LAYERS, event_us(overlapped, 5) / LAYERS
    return f"{name}: serial {s:.0f}, two streams {o:.0f} ({s / o:.3f}x)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--m", type=int, default=530, help="rows (a decode step's requests)")
    args = ap.parse_args()
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "(the SM clock: nvidia-smi beside the command)")
    paths(args.m)
    dequant_tiles()
    two_streams(args.m)


if __name__ == "__main__":
    main()
