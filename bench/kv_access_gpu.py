"""How fast can a decode kernel read the KV cache at all? A read-only probe, for the question of why
the FP8 decode kernel streams ~3.2 TB/s of FP8 bytes while the bf16 one streams ~4.3 (the copy rate).

Each program reads one (request, KV head)'s K over its whole context through the block table, in tiles
of BLOCK_T tokens, exactly as the decode kernels address it, converts to fp32 and sums (so nothing is
optimized away) — no dots, no softmax. Only the addressing differs between rows:

    nhd   the cache's layout today: a page is [slot, head, dim], so one head's 16 tokens of a page are 16
          runs of D bytes (fp8: 128 B, bf16: 256 B) at a stride of H x D bytes
    hnd   [head, slot, dim]: one head's page is one contiguous run (fp8: 2 KB, bf16: 4 KB)

with requests or heads as the grid's fastest dimension, for an fp8 and a bf16 cache, block tables in
order and shuffled (a pool after churn). If fp8 `nhd` reads well below fp8 `hnd` (and below bf16 `nhd`),
the 128-byte runs cap the FP8 kernel and a head-major page layout is the lever; if every row reads near
the copy rate, the cap is in the kernel's own work per tile.

    PYTHONPATH=. python bench/kv_access_gpu.py            # H200: a few seconds
    TRITON_INTERPRET=1 PYTHONPATH=. python bench/kv_access_gpu.py --smoke   # the CPU check of the sums
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial

import torch
import triton
import triton.language as tl

sys.path.insert(0, ".")

PAGE, HEADS, D = 16, 8, 128  # Qwen3-8B's KV heads and head_dim, pages of 16 tokens


@triton.jit
def _read_k_kernel(
    cache_ptr,
    block_tables_ptr,
    out_ptr,
    num_reqs,
    pages_per_req,
    stride_blk,
    stride_slot,
    stride_head,
    BLOCK_T: tl.constexpr,
    PAGE: tl.constexpr,
    D: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    HEADS_FIRST: tl.constexpr,
):
    pid = tl.program_id(0)
    if HEADS_FIRST:
        req, head = pid // NUM_HEADS, pid % NUM_HEADS
    else:
        req, head = pid % num_reqs, pid // num_reqs
    offs_t = tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, D)
    acc = tl.zeros([BLOCK_T, D], dtype=tl.float32)
    for t0 in range(0, pages_per_req * PAGE, BLOCK_T):
        tok = t0 + offs_t
        page = tl.load(block_tables_ptr + req * pages_per_req + tok // PAGE)
        row = page.to(tl.int64) * stride_blk + (tok % PAGE) * stride_slot + head * stride_head
        acc += tl.load(cache_ptr + row[:, None] + offs_d[None, :]).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(tl.sum(acc, 1), 0))


def make_case(num_reqs: int, ctx: int, dtype: torch.dtype, layout: str, shuffled: bool, device: torch.device):
    """(cache, block tables [num_reqs, pages], strides (blk, slot, head)) with every page used once."""
    pages = ctx // PAGE
    num_blocks = num_reqs * pages
    gen = torch.Generator().manual_seed(0)
    data = torch.randn(num_blocks, PAGE, HEADS, D, generator=gen).to(device)
    if layout == "hnd":
        data = data.transpose(1, 2).contiguous()  # [blocks, head, slot, dim]
    cache = data.to(dtype)
    order = torch.randperm(num_blocks, generator=gen) if shuffled else torch.arange(num_blocks)
    tables = order.view(num_reqs, pages).to(torch.int32).to(device)
    if layout == "nhd":
        strides = (cache.stride(0), cache.stride(1), cache.stride(2))
    else:
        strides = (cache.stride(0), cache.stride(2), cache.stride(1))
    return cache, tables, strides


def run_case(cache, tables, strides, heads_first: bool, block_t: int) -> torch.Tensor:
    num_reqs, pages = tables.shape
    out = torch.empty(num_reqs * HEADS, dtype=torch.float32, device=cache.device)
    _read_k_kernel[(num_reqs * HEADS,)](
        cache, tables, out, num_reqs, pages, *strides,
        BLOCK_T=block_t, PAGE=PAGE, D=D, NUM_HEADS=HEADS, HEADS_FIRST=heads_first,
        num_warps=8,  # the fp32 tile accumulator: 4 warps would spill at 256 tokens
    )  # fmt: skip
    return out


def reference(cache, tables, layout: str, heads_first: bool) -> torch.Tensor:
    """The same sums in torch: per (request, head), over every token of its pages."""
    nhd = cache.float() if layout == "nhd" else cache.float().transpose(1, 2)  # [blocks, slot, head, dim]
    per_req = nhd[tables.long()].sum(dim=(1, 2, 4))  # [reqs, heads]
    return (per_req if heads_first else per_req.t()).reshape(-1)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, sums checked (the interpreter)")
    ap.add_argument("--reqs", type=int, default=512)
    ap.add_argument("--ctx", type=int, default=2048)
    args = ap.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    num_reqs, ctx = (3, 128) if args.smoke else (args.reqs, args.ctx)
    fp8 = torch.float8_e4m3fn
    dtypes = [torch.float16] if args.smoke else [fp8, torch.bfloat16]  # the interpreter: fp32/fp16 only
    rows = []
    for dtype in dtypes:
        for layout in ("nhd", "hnd"):
            for shuffled in (False, True):
                cache, tables, strides = make_case(num_reqs, ctx, dtype, layout, shuffled, device)
                nbytes = cache.numel() * cache.element_size()
                for heads_first in (False, True):
                    for block_t in (128, 256) if dtype == fp8 else (64, 128):
                        if args.smoke and block_t > ctx:
                            continue
                        out = run_case(cache, tables, strides, heads_first, block_t)
                        ref = reference(cache, tables, layout, heads_first)
                        ok = torch.allclose(out, ref, rtol=1e-3, atol=1e-2 * ctx)
                        us = None
                        if not args.smoke:
                            ms = triton.testing.do_bench(
                                partial(run_case, cache, tables, strides, heads_first, block_t),
                                warmup=25,
                                rep=100,
                                return_mode="median",
                            )
                            us = ms * 1e3
                        rows.append(
                            {
                                "dtype": str(dtype).removeprefix("torch."),
                                "layout": layout,
                                "tables": "shuffled" if shuffled else "in order",
                                "grid": "heads first" if heads_first else "requests first",
                                "block_t": block_t,
                                "ok": ok,
                                "us": None if us is None else round(us, 1),
                                "gb_s": None if us is None else round(nbytes / us / 1e3),
                            }
                        )
    if not args.smoke:
        x = torch.empty(2**30, dtype=torch.uint8, device=device)
        y = torch.empty_like(x)
        ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=10, rep=50, return_mode="median")
        print(f"copy: {2 * x.numel() / ms / 1e6:.0f} GB/s (read + write)")
    print(
        f"{'dtype':<14} {'layout':<6} {'tables':<9} {'grid':<15} {'tile':>4} {'ok':>3} {'us':>8} {'GB/s':>6}"
    )
    for r in rows:
        print(
            f"{r['dtype']:<14} {r['layout']:<6} {r['tables']:<9} {r['grid']:<15} {r['block_t']:>4} "
            f"{'yes' if r['ok'] else 'NO':>3} {r['us']!s:>8} {r['gb_s']!s:>6}"
        )
    print(json.dumps({"kv_access": rows}))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
