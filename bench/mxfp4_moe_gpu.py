"""gpt-oss's MXFP4 expert layer, each decoding of kernels/moe_gemm.py (MXFP4_DECODES) against the bf16
fused MoE on the same experts dequantized (what --mxfp4-experts dense runs): one GPU call, under ~2
minutes with Triton's compilation.

Run on a GPU from the repository root:  PYTHONPATH=. python bench/mxfp4_moe_gpu.py

Shapes: gpt-oss-20b (32 experts) and gpt-oss-120b (128 experts), top-4, hidden 2880, expert intermediate
2880, biases on both GEMMs and the clamped SwiGLU (alpha 1.702, limit 7), bf16 activations; x tokens in
TOKENS. Random MXFP4 experts (every code; scales 2^-8 .. 2^-5, so the activations stay in the clamp's
range), random routing per call.

1. Correctness: each decoding's whole layer (fused_experts on the packed experts) against the bf16 fused
   MoE on the dequantized experts (the same weights exactly; only the rounding of the activations
   differs): relative error of the largest output < 2e-2; at 16 tokens also against the PyTorch
   reference (layers/moe.fused_experts_ref, fp32 from the packed experts).
2. Time: the whole layer (alignment, two GEMMs, sum) in a CUDA graph, CALLS calls a replay, each on its
   own routing and one of COPIES weight copies (so no call finds its experts in L2), median of 10
   replays. Prints us and x bf16 (bf16 us / variant us: > 1 is faster than bf16) per (model, tokens,
   variant); then the best decoding per token count and the MXFP4_DECODE line to paste into
   kernels/moe_gemm.py. A deadline (DEADLINE_S) skips what is left rather than overrun.

A table, then one JSON line.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable

import torch

sys.path.insert(0, ".")

from bench.gpu_timing import graph_time  # noqa: E402
from overnight.kernels import moe_gemm  # noqa: E402
from overnight.kernels.fused_moe import fused_experts  # noqa: E402
from overnight.kernels.moe_configs import MoeConfig, default_config  # noqa: E402
from overnight.kernels.moe_gemm import MXFP4_DECODES, mxfp4_to_float  # noqa: E402

MODELS = {"gpt-oss-20b": 32, "gpt-oss-120b": 128}  # experts
HIDDEN, INTER, TOP_K = 2880, 2880, 4
TOKENS = (1, 16, 128, 512, 1024, 4096, 8192)
COPIES, CALLS = 2, 4
DEADLINE_S = 100.0
ACTIVATION = ("swiglu_oai", 1.702, 7.0)
DEVICE, DTYPE = "cuda", torch.bfloat16  # tests/test_bench_mxfp4_moe.py runs it on the CPU, fp32
RESULTS: dict[str, object] = {}


def _tiles(tokens: int, num_experts: int, **change: int) -> MoeConfig:
    """default_config's tiles for this batch (what an untuned shape gets), with `change` in both GEMMs."""
    cfg = default_config(tokens, TOP_K, num_experts)
    return MoeConfig(
        cfg.block_m, dataclasses.replace(cfg.gemm1, **change), dataclasses.replace(cfg.gemm2, **change)
    )


# name -> (decoding, config for (tokens, experts); None: the one fused_experts picks). v2's K step is one
# 32-column scale group whatever block_k says, so its variants try deeper pipelines and wider tiles.
VARIANTS: dict[str, tuple[str, Callable[[int, int], MoeConfig | None]]] = {
    **{d: (d, lambda t, e: None) for d in MXFP4_DECODES},
    "v2-s6": ("v2", lambda t, e: _tiles(t, e, num_stages=6)),
    "v2-n128": ("v2", lambda t, e: _tiles(t, e, block_n=128)),
}


def experts(num_experts: int, seed: int) -> dict[str, torch.Tensor]:
    """One copy of a layer's experts, drawn on the device: MXFP4 blocks and scales, biases, and the
    dequantized bf16 stacks (decoded an expert at a time: the fp32 of a whole stack would not fit)."""
    gen = torch.Generator(DEVICE).manual_seed(seed)

    def packed(rows: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        shape = (num_experts, rows, k // 2)
        w = torch.randint(0, 256, shape, generator=gen, device=DEVICE, dtype=torch.uint8)
        s = torch.randint(
            119, 123, (num_experts, rows, k // 32), generator=gen, device=DEVICE, dtype=torch.uint8
        )
        dense = torch.empty(num_experts, rows, k, device=DEVICE, dtype=DTYPE)
        for e in range(num_experts):
            dense[e] = mxfp4_to_float(w[e], s[e]).to(DTYPE)
        return w, s, dense

    w13, s13, d13 = packed(2 * INTER, HIDDEN)
    w2, s2, d2 = packed(HIDDEN, INTER)
    b13 = 0.1 * torch.randn(num_experts, 2 * INTER, generator=gen, device=DEVICE)
    b2 = 0.1 * torch.randn(num_experts, HIDDEN, generator=gen, device=DEVICE)
    return dict(w13=w13, s13=s13, w2=w2, s2=s2, b13=b13.to(DTYPE), b2=b2.to(DTYPE), d13=d13, d2=d2)


def routing(tokens: int, num_experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + seed)
    logits = torch.randn(tokens, num_experts, generator=gen)
    weights, ids = torch.topk(logits.softmax(-1), TOP_K)
    return weights.to(DEVICE), ids.int().to(DEVICE)


def layer(
    x: torch.Tensor, w: dict[str, torch.Tensor], route, decode: str | None, config: MoeConfig | None = None
) -> torch.Tensor:
    """The MoE layer on packed experts with `decode`, or (None) the bf16 fused MoE on the dequantized."""
    biases = dict(gate_up_bias=w["b13"], down_bias=w["b2"], activation=ACTIVATION)
    if decode is None:
        return fused_experts(x, w["d13"], w["d2"], *route, **biases)
    moe_gemm.MXFP4_DECODE = decode  # read when the GEMMs launch (and at capture)
    return fused_experts(x, w["w13"], w["w2"], *route, config, w["s13"], w["s2"], **biases)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def run_point(
    model: str, num_experts: int, stacks: list[dict[str, torch.Tensor]], tokens: int, table: list, bad: list
) -> None:
    """Every variant and bf16 at one (model, token count): checked, then timed; rows appended to table."""
    from overnight.layers.moe import ExpertActivation, fused_experts_ref

    default = moe_gemm.MXFP4_DECODE
    xs = [torch.randn(tokens, HIDDEN, device=DEVICE).to(DTYPE) for _ in range(CALLS)]
    routes = [routing(tokens, num_experts, i) for i in range(CALLS)]
    bf16 = layer(xs[0], stacks[0], routes[0], None)
    if tokens == 16:
        w = stacks[0]
        act = ExpertActivation(*ACTIVATION)
        args = (w["w13"], w["w2"], *routes[0], w["s13"], w["s2"])
        ref = fused_experts_ref(xs[0], *args, gate_up_bias=w["b13"], down_bias=w["b2"], activation=act)
    rows = []
    for name, (decode, make) in {"bf16": (None, lambda t, e: None), **VARIANTS}.items():
        cfg = make(tokens, num_experts)
        rec: dict[str, object] = {"model": model, "tokens": tokens, "variant": name}
        if cfg is not None:
            rec["config"] = repr(cfg)
        try:
            y = layer(xs[0], stacks[0], routes[0], decode, cfg)
            if decode is not None:
                rec["err"] = err = rel_err(y, bf16)
                if tokens == 16:
                    rec["err_ref"] = err = max(err, rel_err(y, ref))
                if not err < 2e-2:
                    bad.append((model, tokens, name, err))
            calls = [
                lambda i=i, x=x, r=r, d=decode, c=cfg: layer(x, stacks[i % COPIES], r, d, c)
                for i, (x, r) in enumerate(zip(xs, routes, strict=True))
            ]
            rec["us"] = graph_time(calls)
        except Exception as exc:
            rec["failed"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        finally:
            moe_gemm.MXFP4_DECODE = default
        rows.append(rec)
    base = rows[0]
    for r in rows:
        if "us" in base and "us" in r:
            r["x_bf16"] = base["us"] / r["us"]  # type: ignore[operator]
        cells = (
            f"{r['us']:9.1f} us  x{r.get('x_bf16', 0):5.2f}  err {r.get('err', 0):.0e}"
            if "us" in r
            else f"failed: {r['failed']}"
        )
        print(f"{model:13s} tokens {tokens:5d}  {r['variant']:8s} {cells}", flush=True)
    table.extend(rows)


def summary(table: list[dict]) -> None:
    """Per token count: each variant's geometric mean over the models of x bf16, the best variant with
    its tiles (rows per expert as the bound, for a tier table), and the decoding to make the default."""
    print("\n== best MXFP4 variant per token count (geometric mean over the models of x bf16) ==")
    best: dict[int, str] = {}
    for tokens in TOKENS:
        scores = {}
        for name in VARIANTS:
            xs = [
                r["x_bf16"] for r in table if r["tokens"] == tokens and r["variant"] == name and "x_bf16" in r
            ]
            if len(xs) == len({r["model"] for r in table}):  # measured on every model
                scores[name] = statistics.geometric_mean(xs)
        if not scores:
            continue
        top = max(scores, key=lambda d: scores[d])
        best[tokens] = top
        print(
            f"tokens {tokens:5d}: " + "  ".join(f"{d} x{v:5.2f}" for d, v in scores.items()) + f"  -> {top}"
        )
        config = next((r.get("config") for r in table if r["tokens"] == tokens and r["variant"] == top), None)
        rows = {m: tokens * TOP_K / e for m, e in MODELS.items()}
        print(f"    rows per expert {rows}: {config or 'the default tiles'}")
    RESULTS["best"] = best
    if best:
        wins: dict[str, int] = {}
        for name in best.values():
            wins[VARIANTS[name][0]] = wins.get(VARIANTS[name][0], 0) + 1
        print(
            f'\nfor kernels/moe_gemm.py:  MXFP4_DECODE = "{max(wins, key=lambda d: wins[d])}"  (wins: {wins})'
        )


def main() -> None:
    t0 = time.time()
    print(torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE, torch.__version__, flush=True)
    table: list[dict] = []
    bad: list = []
    deadline = t0 + DEADLINE_S
    # Token counts outer, so a deadline cuts the largest counts of both models rather than one model.
    stacks = {model: [experts(e, seed) for seed in range(COPIES)] for model, e in MODELS.items()}
    for tokens in TOKENS:
        for model, num_experts in MODELS.items():
            if time.time() > deadline:
                print(f"{model} tokens {tokens}: skipped (deadline)", flush=True)
                continue
            try:
                run_point(model, num_experts, stacks[model], tokens, table, bad)
            except Exception:
                traceback.print_exc()
                RESULTS[f"{model}-{tokens}"] = "failed"
    RESULTS["correctness"] = "ok" if not bad else bad
    RESULTS["times"] = table
    print(f"correctness failures: {bad or 'none'}")
    summary(table)
    print(f"total {time.time() - t0:.0f} s")
    print(json.dumps(RESULTS))


if __name__ == "__main__":
    main()
