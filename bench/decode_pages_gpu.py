"""H200 check and timing of the FP8-cache decode kernel by page size: today's pointer-gather kernels on
pages of 16 tokens against the TMA kernel (DecodeConfig.tma, kernels/paged_decode_fp8.py), which needs
pages of a multiple of its tile (64 or 128 tokens) and fetches each K and V tile with one copy.

    PYTHONPATH=. python bench/decode_pages_gpu.py [--budget-s 150] [--moe]

(--moe: the timings at Qwen3-30B-A3B's heads, attention_gpu.py's MOE_CASES, instead of CASES.)

Why: the e4m3-dot kernel reads ~3.2 TB/s at 1980 MHz and less at the engine's power-capped clock
(~2.7 TB/s at ~1650 MHz in bench/profile_gpu.py's whole-run profile), while a read-only probe of the same gather managed
3.4-3.8 TB/s and the bf16 kernel 4.4: the per-element address work of the gather, not the bytes, sets
its pace. Expected: the TMA kernel at 3.8-4.2 TB/s on the large cases (b512 ctx2048 from ~655 us to
~520-560 us); if so, long-1024-1024 with an FP8 cache should gain ~5-10% end to end (decode attention
is ~47% of its run).

Checks first (every variant against the emulation of its roundings, RMS, and against the exact answer;
a CUDA-graph replay of the TMA kernel on new tables), then timings per case, then one JSON line.
Reuses bench/attention_gpu.py's inputs and measures (its PAGE is set per page size).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attention_gpu as ag  # noqa: E402

from overnight.attention.torch_backend import paged_attention_ref  # noqa: E402
from overnight.kernels.attention_fp8_ref import decode_fp8_mma_ref  # noqa: E402
from overnight.kernels.paged_decode import (  # noqa: E402
    BF16_DECODE_CONFIG,
    FP8_SMALL_PAGE_DECODE_CONFIG,
    DecodeConfig,
    DecodeWorkspace,
    choose_num_splits,
)

D = ag.D
# (page size, label, config, cache dtype)
VARIANTS = [
    (16, "base mma n128 w4 s3 (p16)", FP8_SMALL_PAGE_DECODE_CONFIG, ag.E4M3),
    (16, "mma n64 w4 s3 (p16)", DecodeConfig(64, 4, 3, fp8_mma=True), ag.E4M3),
    (16, "bf16 base (p16)", BF16_DECODE_CONFIG, ag.BF16),
    (64, "mma n64 w4 s3 (p64)", DecodeConfig(64, 4, 3, fp8_mma=True), ag.E4M3),
    (64, "mma n128 w4 s3 (p64)", DecodeConfig(128, 4, 3, fp8_mma=True), ag.E4M3),
    (64, "tma n64 w4 s3 (p64)", DecodeConfig(64, 4, 3, fp8_mma=True, tma=True), ag.E4M3),
    (64, "tma n64 w4 s4 (p64)", DecodeConfig(64, 4, 4, fp8_mma=True, tma=True), ag.E4M3),
    (64, "tma n64 w4 s2 (p64)", DecodeConfig(64, 4, 2, fp8_mma=True, tma=True), ag.E4M3),
    (64, "tma n64 w4 s3 hf (p64)", DecodeConfig(64, 4, 3, fp8_mma=True, tma=True, heads_first=True), ag.E4M3),
    (128, "tma n128 w4 s3 (p128)", DecodeConfig(128, 4, 3, fp8_mma=True, tma=True), ag.E4M3),
    (128, "tma n128 w8 s3 (p128)", DecodeConfig(128, 8, 3, fp8_mma=True, tma=True), ag.E4M3),
    (128, "tma n64 w4 s3 (p128)", DecodeConfig(64, 4, 3, fp8_mma=True, tma=True), ag.E4M3),
]
CASES = [
    ("qwen3-8b", 512, 2048),
    ("qwen3-8b", 512, 1536),  # long-1024-1024 halfway: 512 requests, ~1.5k tokens of context
    ("qwen3-8b", 1024, 640),
    ("qwen3-8b", 256, 768),
    ("qwen3-8b", 8, 32768),
    ("qwen3-0.6b", 1024, 640),
]


def make(page: int, model: str, query_lens, seq_lens, nd: int, seed: int, dtype):
    ag.PAGE = page  # make_case reads the module's page size
    return ag.make_case(*ag.MODELS[model], query_lens, seq_lens, nd, seed, dtype)


def check_variants(fp8: torch.dtype) -> None:
    """Every FP8 variant on a cache of that format (e5m2 too: e4m3 q against e5m2 K and V)."""
    gen = torch.Generator().manual_seed(2)
    seq_lens = torch.randint(1, 3000, (24,), generator=gen).tolist() + [1, 63, 64, 65, 127, 129, 4096]
    n = len(seq_lens)
    for page in sorted({v[0] for v in VARIANTS}):
        meta, q, cache, kv_scale = make(page, "qwen3-8b", [1] * n, seq_lens, n, 3, fp8)
        exact = paged_attention_ref(q.float(), cache, meta, D**-0.5, kv_scale)
        for p, name, cfg, dtype in VARIANTS:
            if p != page or dtype != ag.E4M3:
                continue
            for ns in (1, choose_num_splits(n, 8, ag.MAX_MODEL_LEN)):
                tag = f"decode {str(fp8)[6:]} p{page} {name} splits={ns}"
                out = ag.run_decode(meta, q, cache, kv_scale, cfg, ns)
                emu = decode_fp8_mma_ref(
                    q, cache, meta.block_tables, meta.seq_lens, n, D**-0.5, kv_scale, cfg.block_n, ns
                )
                ag.check(tag + " vs its rounding ref (RMS)", ag.rms_rel_err(out, emu), 1e-2)
                ag.check(tag + " vs exact", ag.rel_err(out, exact), 8e-2)


def bench_case(model: str, batch: int, ctx: int) -> None:
    hq, hkv = ag.MODELS[model]
    ns = choose_num_splits(batch, hkv, ag.MAX_MODEL_LEN)
    case = f"{model} b{batch} ctx{ctx}"
    for page in sorted({v[0] for v in VARIANTS}):
        for dtype in (ag.BF16, ag.E4M3):
            mine = [v for v in VARIANTS if v[0] == page and v[3] == dtype]
            if not mine:
                continue
            meta, q, cache, kv_scale = make(page, model, [1] * batch, [ctx] * batch, batch, 11, dtype)
            nbytes = ag.decode_bytes(batch, ctx, hq, hkv, cache.element_size())
            ws = DecodeWorkspace(batch * ns, hq, D, ag.DEV)
            kernel = "decode fp8" if dtype == ag.E4M3 else "decode bf16"
            for _, name, cfg, _ in mine:
                label = name + (f" x{ns}" if ns > 1 else "")
                args = (case, kernel, label, nbytes, meta, q, cache, kv_scale, cfg, ns, ws)
                ag.try_run(f"time {case} {label}", partial(ag.time_decode, *args))
            del cache
            torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=150.0)
    parser.add_argument("--checks-only", action="store_true", help="the correctness checks, no timings")
    parser.add_argument("--moe", action="store_true", help="time attention_gpu.py's MOE_CASES instead")
    parser.add_argument(
        "--formats", default="e4m3", help="cache formats to check: e4m3, e5m2 or both (comma)"
    )
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}", flush=True)
    print("checks:", flush=True)
    for fmt in args.formats.split(","):
        ag.try_run(f"checks {fmt}", partial(check_variants, {"e4m3": ag.E4M3, "e5m2": ag.E5M2}[fmt]))
    for page, cfg in ((64, DecodeConfig(64, 4, 3, fp8_mma=True, tma=True)),
                      (128, DecodeConfig(128, 4, 3, fp8_mma=True, tma=True))):  # fmt: skip
        ag.try_run(f"graph p{page}", partial(ag.check_fp8_mma_graph, cfg, page))
    print("timings:", flush=True)
    for model, batch, ctx in [] if args.checks_only else ag.MOE_CASES if args.moe else CASES:
        if not ag.over_budget(args.budget_s, f"{model} b{batch} ctx{ctx}"):
            bench_case(model, batch, ctx)
    base = {r["case"]: r["us"] for r in ag.rows if r["variant"].startswith("base")}
    print("\ncase | variant | us | GB/s | x base")
    for r in ag.rows:
        b = base.get(r["case"])
        print(
            f"{r['case']} | {r['variant']} | {r['us']:.1f} | {r['gbps']:.0f} | {b / r['us'] if b else 0:.3f}"
        )
    failed = [c for c in ag.checks if not c[2]]
    print(f"\nchecks: {len(ag.checks) - len(failed)}/{len(ag.checks)} passed; {time.time() - ag.START:.0f} s")
    print("DECODE_PAGES " + json.dumps({"rows": ag.rows, "failed": [c[0] for c in failed]}))


if __name__ == "__main__":
    main()
