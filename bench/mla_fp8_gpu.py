"""GPU check and timing of latent attention's decode over an FP8 cache (kernels/mla_decode.py) against the
bf16 cache it halves: DeepSeek-V3's row (512 latent + 64 rope values), 16 heads (V2-Lite, or V3 / R1 /
Kimi-K2 at TP 8) and 128 (V3 on one GPU's share unsplit), pages of 64 tokens.

    PYTHONPATH=. python bench/mla_fp8_gpu.py

Checks first, in bf16 on the GPU: the FP8 write's bytes against the PyTorch reference's (two scales,
saturation), the FP8 decode against mla_decode_ref over the same dequantized cache, and against the
decode over the unquantized rows (e4m3's rounding, relative). Then per case the bf16 cache's decode and
the FP8 cache's under several tiles (BLOCK_N, num_warps, num_stages), a human table, one JSON line.
"""

from __future__ import annotations

import json
from functools import partial

import torch
import triton

from overnight.attention.mla import mla_decode_ref, write_latent_ref
from overnight.kernels import mla_decode as k

RANK, ROPE, PAGE = 512, 64, 64
FP8_TILES = [(32, 8, 2), (16, 4, 2), (32, 8, 3), (64, 8, 2)]
CASES = [(16, 64, 2048), (16, 256, 4096), (128, 32, 2048), (128, 128, 4096)]  # heads, batch, context


def inputs(heads: int, batch: int, ctx: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks = batch * ctx // PAGE
    rows = torch.randn(blocks * PAGE, RANK + ROPE, device="cuda", generator=gen, dtype=torch.bfloat16)
    rows[:, RANK:] *= 8  # the rope part's range differs from the latent's
    tables = torch.randperm(blocks, device="cuda", generator=gen).view(batch, -1).int()
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, RANK + ROPE, device="cuda", generator=gen, dtype=torch.bfloat16)
    scales = torch.stack([rows[:, :RANK].abs().amax(), rows[:, RANK:].abs().amax()]).float() / 448
    return rows, tables, lens, q, scales


def caches(rows: torch.Tensor, scales: torch.Tensor):
    n = rows.shape[0]
    bf16 = rows.view(1, n // PAGE, PAGE, 1, RANK + ROPE).clone()
    fp8 = torch.zeros_like(bf16, dtype=torch.float8_e4m3fn)
    k.latent_write(rows, fp8, torch.arange(n, device="cuda"), scales, RANK)
    return bf16, fp8


def check() -> dict[str, float]:
    rows, tables, lens, q, scales = inputs(16, 8, 640)
    bf16, fp8 = caches(rows, scales)
    ref8 = torch.zeros_like(fp8)
    write_latent_ref(rows, ref8, torch.arange(rows.shape[0], device="cuda"), scales, RANK)
    same_bytes = torch.equal(fp8.view(torch.uint8), ref8.view(torch.uint8))
    lens[3] = 77  # a context ending inside a page
    out = k.mla_decode(q, fp8, tables, lens, 0.07, RANK, 8, scales)
    ref = mla_decode_ref(q, fp8, tables, lens, 0.07, RANK, 8, scales)
    full = k.mla_decode(q, bf16, tables, lens, 0.07, RANK, 8)
    result = {
        "write_bytes_equal": float(same_bytes),
        "vs_reference_max_abs": float((out.float() - ref.float()).abs().max()),
        "vs_bf16_cache_rel": float((out.float() - full.float()).norm() / full.float().norm()),
    }
    assert same_bytes and result["vs_reference_max_abs"] < 2e-2 and result["vs_bf16_cache_rel"] < 2**-4, (
        result
    )
    return result


def main() -> None:
    checks = check()
    print("checks:", checks)
    results = []
    print(f"{'heads':>5} {'batch':>5} {'ctx':>6} {'cache':>5} {'tiles':>10} {'us':>8} {'TB/s':>6}")
    for heads, batch, ctx in CASES:
        rows, tables, lens, q, scales = inputs(heads, batch, ctx)
        bf16, fp8 = caches(rows, scales)
        del rows
        runs = [("bf16", bf16, None, None)] + [("fp8", fp8, scales, t) for t in FP8_TILES]
        for name, cache, sc, tiles in runs:
            rr = torch.arange(batch, dtype=torch.int32, device="cuda")
            step = partial(k.mla_rows, q, cache, tables, rr, lens, 0.07, RANK, sc, tiles)
            us = triton.testing.do_bench(step, warmup=20, rep=200) * 1e3
            tb = batch * ctx * (RANK + ROPE) * cache.element_size() / (us * 1e-6) / 1e12
            label = "default" if tiles is None else "/".join(map(str, tiles))
            print(f"{heads:>5} {batch:>5} {ctx:>6} {name:>5} {label:>10} {us:>8.1f} {tb:>6.2f}")
            results.append(dict(heads=heads, batch=batch, ctx=ctx, cache=name, tiles=label, us=round(us, 1)))
        del bf16, fp8
    print(json.dumps({"device": torch.cuda.get_device_name(), "checks": checks, "results": results}))


if __name__ == "__main__":
    main()
