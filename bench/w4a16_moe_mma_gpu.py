"""The packed int4 MoE experts on words in MMA order against column order, in one call (~2 minutes).

Run on a GPU from the repository root:  PYTHONPATH=. python3 bench/w4a16_moe_mma_gpu.py

kernels/w4a16_moe.py's MMA_ORDER puts each expert's words in MMA order at load (with MMA_TIERS), as
the dense W4A16 layers do. This bench decided it (an H100, 2026-12-07: docs/performance.md's session
Z) and checks it again on a new card or after a change to the kernel, at Qwen3-30B-A3B's shapes
(bench/w4a16_variants_gpu.py's MOE_SHAPE: 128 experts, top-8, hidden 2048, expert intermediate 768,
int4 groups of 128):

1. Correctness, bf16 and fp16: every variant below on its words against w4a16_fused_experts_ref on
   the same experts in column order (relative error < 1e-2 of the largest output), at 1, 100 and 600
   tokens.
2. Times at MOE_TOKENS, as that bench's --moe section times them (the whole layer in a CUDA graph over
   weight copies that miss L2, zero points and symmetric): the bf16 fused MoE; "column" (TIERS on
   column-order words: what runs where MMA order does not fit); "mma" (MMA_TIERS on MMA-ordered words:
   what runs with MMA_ORDER on); "mma-column-tiers" (TIERS on MMA-ordered words: what MMA_TIERS' own
   tiers add); and MMA_TILES, other 64-row tiles on MMA-ordered words.
3. The verdict: MMA_ORDER on when "mma" is at least as fast as "column" (geometric mean of zero and
   symmetric x bf16) at every token count, and the token counts where an MMA tile beats both.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import replace

import torch

sys.path.insert(0, ".")

import bench.w4a16_variants_gpu as vb  # noqa: E402
from bench.gpu_timing import graph_time  # noqa: E402
from overnight.kernels.fused_moe import fused_experts  # noqa: E402
from overnight.kernels.w4a16_moe import (  # noqa: E402
    MMA_ORDER,
    MMA_TIERS,
    W4A16MoeConfig,
    default_config,
    dequantize_experts_ref,
    experts_to_mma_order,
    w4a16_fused_experts,
    w4a16_fused_experts_ref,
)

CHECK_TOKENS = (1, 100, 600)
CHECK_DTYPES = (torch.bfloat16, torch.float16)


def _column(tokens: int) -> W4A16MoeConfig:
    return default_config(tokens, vb.MOE_SHAPE[3], vb.MOE_SHAPE[0])


def _mma(tokens: int) -> W4A16MoeConfig:
    return default_config(tokens, vb.MOE_SHAPE[3], vb.MOE_SHAPE[0], mma_order=True)


def _tier64_swapped_half(tokens: int) -> W4A16MoeConfig | None:
    """MMA_TIERS' 64-row tier (both GEMMs swapped) with the "half" unpack."""
    cfg = next(c for _, c in MMA_TIERS if c.block_m == 64)
    gemm1, gemm2 = (replace(t, unpack="half") for t in (cfg.gemm1, cfg.gemm2))
    return replace(cfg, gemm1=gemm1, gemm2=gemm2) if 8 <= vb._rows(tokens) <= 64 else None


MMA_TILES: dict[str, Callable[[int], W4A16MoeConfig | None]] = {"mma-m64-swap-half": _tier64_swapped_half}
# name -> (config for a token count or None, words in MMA order)
VARIANTS: dict[str, tuple[Callable[[int], W4A16MoeConfig | None], bool]] = {
    "column": (_column, False),
    "mma": (_mma, True),
    "mma-column-tiers": (_column, True),
    **{name: (make, True) for name, make in MMA_TILES.items()},
}


def _stacks(copies: int, zeros: bool, mma: bool) -> list:
    e, hidden, inter, _ = vb.MOE_SHAPE
    out = []
    for i in range(copies):
        pair = (vb.moe_stack(2 * inter, hidden, zeros, 2 * i), vb.moe_stack(hidden, inter, zeros, 2 * i + 1))
        if mma:
            pair = tuple((experts_to_mma_order(q), s, z) for q, s, z in pair)
        out.append(pair)
    return out


def correctness() -> list:
    bad = []
    (natural,) = _stacks(1, True, False)
    (ordered,) = _stacks(1, True, True)
    for dtype in CHECK_DTYPES:
        for tokens in CHECK_TOKENS:
            x = torch.randn(tokens, vb.MOE_SHAPE[1], device=vb.DEVICE, dtype=dtype)
            r = vb.routing(tokens, 0)
            ref = w4a16_fused_experts_ref(x, *natural, 4, (vb.GROUP, vb.GROUP), *r)
            for name, (make, mma) in VARIANTS.items():
                cfg = make(tokens)
                if cfg is None:
                    continue
                words = ordered if mma else natural
                y = w4a16_fused_experts(x, *words, 4, (vb.GROUP, vb.GROUP), *r, config=cfg, mma_order=mma)
                err = vb.rel_err(y, ref)
                if not err < 1e-2:
                    bad.append((str(dtype), tokens, name, err))
    print(f"correctness failures: {bad or 'none'}", flush=True)
    return bad


def times() -> list[dict]:
    table: list[dict] = []
    hidden = vb.MOE_SHAPE[1]
    stacks = {
        (zeros, mma): _stacks(vb.MOE_COPIES, zeros, mma) for zeros in (True, False) for mma in (False, True)
    }
    bf16 = [
        tuple(dequantize_experts_ref(*p, 4, vb.GROUP, vb.DTYPE) for p in pair) for pair in stacks[True, False]
    ]
    for tokens in vb.MOE_TOKENS:
        xs = [torch.randn(tokens, hidden, device=vb.DEVICE, dtype=vb.DTYPE) for _ in range(vb.MOE_CALLS)]
        routes = [vb.routing(tokens, i) for i in range(vb.MOE_CALLS)]
        calls = [lambda i=i, x=x, r=r: fused_experts(x, *bf16[i % vb.MOE_COPIES], *r) for i, (x, r) in enumerate(zip(xs, routes))]  # fmt: skip
        t_bf16 = graph_time(calls)
        table.append({"tokens": tokens, "variant": "bf16", "us": t_bf16})
        for name, (make, mma) in VARIANTS.items():
            cfg = make(tokens)
            if cfg is None:
                continue
            rec: dict = {"tokens": tokens, "variant": name, "config": repr(cfg)}
            for zeros in (True, False):
                tag = "zero" if zeros else "sym"
                packed = stacks[zeros, mma]
                calls = [
                    lambda i=i, x=x, r=r, p=packed, c=cfg, o=mma: w4a16_fused_experts(
                        x, *p[i % vb.MOE_COPIES], 4, (vb.GROUP, vb.GROUP), *r, config=c, mma_order=o
                    )
                    for i, (x, r) in enumerate(zip(xs, routes))
                ]
                rec[f"us_{tag}"] = graph_time(calls)
                rec[f"x_{tag}"] = t_bf16 / rec[f"us_{tag}"]
            table.append(rec)
            print(
                f"tokens {tokens:5d}  {name:18s} zero {rec['us_zero']:8.1f} us x{rec['x_zero']:5.2f}  "
                f"sym {rec['us_sym']:8.1f} us x{rec['x_sym']:5.2f}",
                flush=True,
            )
    return table


def means(table: list[dict], tokens: int) -> dict[str, float]:
    """variant -> geometric mean of its zero-point and symmetric x bf16 at that token count."""
    rows = [r for r in table if r["tokens"] == tokens and "x_zero" in r]
    return {r["variant"]: math.sqrt(r["x_zero"] * r["x_sym"]) for r in rows}


def verdict(table: list[dict]) -> tuple[bool, dict[int, str]]:
    """(MMA_ORDER, {tokens: an MMA tile that beats both "column" and "mma" there})."""
    by_tokens = {t: means(table, t) for t in vb.MOE_TOKENS}
    timed = [t for t, m in by_tokens.items() if {"column", "mma"} <= set(m)]
    mma = bool(timed) and all(by_tokens[t]["mma"] >= by_tokens[t]["column"] for t in timed)
    tiles = {}
    for t, m in by_tokens.items():
        best = max((n for n in MMA_TILES if n in m), key=lambda n: m[n], default=None)
        if best is not None and m[best] > max(m.get("column", 0.0), m.get("mma", 0.0)):
            tiles[t] = best
    return mma, tiles


def main() -> None:
    print(torch.cuda.get_device_name(), flush=True)
    if correctness():
        return
    table = times()
    print("\n== geometric mean of zero / sym x bf16 ==")
    print("tokens " + "".join(f"{n:>20s}" for n in VARIANTS))
    for t in vb.MOE_TOKENS:
        m = means(table, t)
        print(f"{t:6d} " + "".join(f"{m[n]:20.2f}" if n in m else f"{'-':>20s}" for n in VARIANTS))
    mma, tiles = verdict(table)
    print(
        f"\nMMA_ORDER (kernels/w4a16_moe.py, now {MMA_ORDER}): {mma}; MMA tiles that win: {tiles or 'none'}"
    )


if __name__ == "__main__":
    main()
