"""GPU check, tile tuning and benchmark of the fused MoE path at Qwen3-30B-A3B's shapes.

Run on the GPU machine from the repository root:

    PYTHONPATH=. python bench/moe_gpu.py            # check, tune, print the configs to commit
    PYTHONPATH=. python bench/moe_gpu.py --install  # the same, and write them into
                                                    # overnight/kernels/moe_configs.json
    PYTHONPATH=. python bench/moe_gpu.py --fp8 --install   # tune FP8 experts' tiles (their own key;
                                                           # W8A8, as the GPU runs them: layers/moe.py)
    ... --buckets 256,512,1024 --deadline 60              # fewer token counts, a shorter sweep

Needs torch + triton; about 3 minutes, most of it compiling tile configurations (a deadline cuts the
sweep short rather than overrun). Fixed seed. Shapes: hidden 2048, expert intermediate 768, 128
experts, top-8 (one H200, no tensor parallelism), bf16.

1. Correctness, bf16: router top-k (a valid top-k even where bf16 logits tie; weights), the alignment
   (each variant: the stable one exact, the atomic one the same runs), each grouped GEMM against an fp32 reference, the fused layer against the HF-style PyTorch
   loop, FP8 experts (e4m3, a scale per expert and row) against the PyTorch path on the same weights and
   against the bf16 experts, a CUDA-graph capture and replay of the layer at a decode batch, and a
   2-layer Qwen3-MoE of these shapes through the engine (dummy weights, CUDA graphs on).
2. Tuning: per token count in BUCKETS, each BLOCK_M candidate with a few tile shapes per GEMM, median
   of triton's do_bench (L2 flushed); the best per bucket is checked against the reference, printed as
   the JSON for overnight/kernels/moe_configs.json, and written to $OUT/moe_configs.json (OUT set).
3. The whole MoE layer (router GEMM, top-k, alignment, two GEMMs, sum) with the tuned configs, timed
   from CUDA graphs, against the PyTorch loop over experts (and vLLM's fused_experts when it imports;
   both timed eagerly: the loop reads counts back to the host), as TFLOP/s and GB/s (GB:
   the weights of the experts actually hit, what a decode step must read), and the same layer with FP8
   experts ("fp8 us": W8A8, e4m3 activations too, as the GPU runs them; "fp8 w-only": the weight-only
   form that converts every weight tile to bf16; their own tuned tiles when installed, else bf16's),
   and vLLM's W8A8 fused_experts ("vllm fp8", from CUDA graphs as ours: its experts alone, without the
   router GEMM and top-k that "fp8 us" includes, ~10 us; e4m3 weights a scale an expert and projection
   and activations a scale a tensor, as its online FP8 holds and runs them; its error against the bf16
   PyTorch layer in the JSON, vllm_fp8_err, so a wrong call cannot pass for a fast one).
4. The routing at decode sizes: the router and each alignment variant (moe_align.py's ALIGN_VARIANTS)
   in microseconds a call, from CUDA graphs as the engine runs them; where they cross is
   moe_align.ATOMIC_DEFAULT_PAIRS.
Tables, then one line of JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import tempfile
import time
import traceback
from typing import Any

import torch
import torch.nn.functional as F
import triton

from bench.gpu_timing import graph_time
from overnight.bench.gpu_info import sm_clock_now
from overnight.kernels import moe_configs
from overnight.kernels.fused_moe import fused_experts, gemm_operand
from overnight.kernels.moe_align import ALIGN_VARIANTS, ExpertRuns, moe_align, moe_align_ref
from overnight.kernels.moe_configs import MoeConfig, default_config, device_name, get_config, shape_key
from overnight.kernels.moe_gemm import GemmTiles, moe_gemm, moe_gemm_ref
from overnight.kernels.moe_router import router_topk
from overnight.layers.moe import fused_experts_ref, router_topk_ref

H, I, E, TOP_K = 2048, 768, 128, 8  # noqa: E741 (I: the expert intermediate size)
DT = torch.bfloat16
DEV = torch.device("cuda")
HBM_GBPS = 4300.0
BUCKETS = [1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
LAYER_SIZES = [1, 64, 256, 1024, 4096, 16384]
ROUTING_SIZES = [1, 64, 256, 512, 1024, 2048]  # decode steps' token counts (the atomic alignment's range)
SWEEP_DEADLINE_S = 120.0  # from the start of the sweep; the rest of the run needs ~60 s
# (block_n, block_k, num_warps, num_stages) tried for both GEMMs, per BLOCK_M
TILES = {
    16: [(32, 128, 4, 4), (64, 128, 4, 4), (64, 64, 4, 5), (128, 128, 4, 3), (64, 256, 4, 3)],
    32: [(64, 128, 4, 4), (64, 64, 4, 4), (128, 64, 4, 4), (128, 128, 4, 3)],
    64: [(64, 128, 4, 4), (128, 64, 4, 4), (128, 128, 4, 3), (64, 64, 4, 4), (128, 128, 8, 3)],
    128: [(128, 64, 8, 4), (128, 128, 8, 3), (64, 128, 4, 3), (256, 64, 8, 3)],
}
# W8A8 (e4m3 operands, half the bytes a stage): deeper pipelines and K tiles that bf16 cannot fit, for
# the memory-bound decode buckets (session R: the H100's decode-sized expert GEMMs read at ~75% of its
# bandwidth with the tiles above); swept after TILES, so a short deadline tries those first.
FP8_EXTRA_TILES = {
    16: [(64, 256, 4, 4), (64, 128, 4, 6), (128, 128, 4, 4)],
    32: [(64, 256, 4, 4), (64, 128, 4, 6), (128, 128, 4, 4)],
    64: [(64, 256, 4, 4), (64, 128, 4, 6), (128, 128, 4, 4)],
    128: [(128, 128, 8, 4)],
}
SMEM_LIMIT = 220 * 1024

checks: list[tuple[str, bool, str]] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    checks.append((name, bool(ok), detail))
    print(f"  {'ok  ' if ok else 'FAIL'} {name:<52} {detail}", flush=True)


def bench(fn, warmup: int = 5, rep: int = 20) -> float:
    """Median milliseconds (L2 flushed between runs)."""
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest error relative to the reference's largest magnitude."""
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


def make_weights(gen: torch.Generator) -> dict[str, torch.Tensor]:
    def randn(*shape: int, scale: float) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=gen, device=DEV)).to(DT)

    return dict(
        gate=randn(E, H, scale=H**-0.5),  # unit-variance router logits
        w13=randn(E, 2 * I, H, scale=H**-0.5),
        w2=randn(E, H, I, scale=I**-0.5),
    )


def make_batch(num_tokens: int, gate: torch.Tensor, gen: torch.Generator):
    x = torch.randn(num_tokens, H, generator=gen, device=DEV).to(DT)
    weights, ids = router_topk(F.linear(x, gate), TOP_K, True)
    return x, weights, ids


def rows_per_expert(num_tokens: int) -> float:
    return num_tokens * TOP_K / E


# -- 1. correctness ------------------------------------------------------------------------------------


def check_router(gen: torch.Generator) -> None:
    logits = torch.randn(4096, E, generator=gen, device=DEV).to(DT)
    weights, ids = router_topk(logits, TOP_K, True)
    ref_w, ref_ids = router_topk_ref(logits, TOP_K, True)
    probs = torch.softmax(logits.float(), -1)
    # Ties among bf16 logits make several top-k sets valid: ours must pick k distinct experts whose
    # probabilities are the k largest (as a multiset), weighted like the reference.
    picked = probs.gather(1, ids.long()).sort(dim=1, descending=True).values
    best = probs.topk(TOP_K, dim=1).values
    distinct = bool((ids.sort(dim=1).values.diff(dim=1) > 0).all())
    check(
        "router top-k: a valid top-k, distinct experts",
        distinct and torch.allclose(picked, best, rtol=0, atol=0),
        f"ids equal to torch.topk in {float((ids == ref_ids).all(1).float().mean()):.1%} of rows",
    )
    err = float((weights.sort(1).values - ref_w.sort(1).values).abs().max())
    check("router top-k: renormalized weights", err < 1e-5, f"max |err| {err:.1e}")


def same_runs(runs: ExpertRuns, ref: ExpertRuns, stable: bool) -> bool:
    """The same padded runs and tile experts; stable: each run's pairs in order too, else as a set."""
    n, block_m = int(ref.num_padded), ref.block_m
    if int(runs.num_padded) != n or not torch.equal(
        runs.expert_ids[: n // block_m], ref.expert_ids[: n // block_m]
    ):
        return False
    got, want = runs.sorted_ids[:n].long(), ref.sorted_ids[:n].long()
    if stable:
        return torch.equal(got, want)
    key = ref.expert_ids[: n // block_m].long().repeat_interleave(block_m) * (ref.num_pairs + 1)
    return torch.equal((key + got).sort().values, (key + want).sort().values)


def check_align(gen: torch.Generator, gate: torch.Tensor) -> None:
    for num_tokens, block_m in [(1, 16), (64, 16), (512, 64), (1024, 64), (16384, 128)]:
        _, _, ids = make_batch(num_tokens, gate, gen)
        ref = moe_align_ref(ids, E, block_m)
        n = int(ref.num_padded)
        for variant in ALIGN_VARIANTS:
            ok = same_runs(moe_align(ids, E, block_m, variant), ref, stable=variant == "stable")
            how = "equals the stable sort" if variant == "stable" else "the same runs"
            check(f"align {variant} T={num_tokens} BLOCK_M={block_m}: {how}", ok, f"{n} padded rows")


def routing_rows(gen: torch.Generator, gate: torch.Tensor) -> list[dict]:
    """The routing's launches at decode sizes, each variant of the alignment beside the router, at the
    BLOCK_M FP8 experts run with (session L's profile: ~19 us a layer for the router and the stable
    alignment, vLLM ~5.5 us)."""
    rows = []
    for num_tokens in ROUTING_SIZES:
        x = torch.randn(num_tokens, H, generator=gen, device=DEV).to(DT)
        logits = F.linear(x, gate)
        _, ids = router_topk(logits, TOP_K, True)
        block_m = get_config(num_tokens, E, I, H, TOP_K, DT, DEV, torch.float8_e4m3fn).block_m
        row: dict[str, object] = dict(tokens=num_tokens, block_m=block_m)
        # 20 calls a graph: do_bench's time of one call would include its Python launches
        row["router_us"] = round(graph_time([lambda lg=logits: router_topk(lg, TOP_K, True)] * 20), 2)
        for variant in ALIGN_VARIANTS:
            us = graph_time([lambda i=ids, b=block_m, v=variant: moe_align(i, E, b, v)] * 20)
            row[f"align_{variant}_us"] = round(us, 2)
        rows.append(row)
        print(f"    routing T={num_tokens}: {row}", flush=True)
    return rows


def check_gemms(gen: torch.Generator, w: dict[str, torch.Tensor]) -> None:
    for num_tokens in (8, 1024, 8192):
        x, weights, ids = make_batch(num_tokens, w["gate"], gen)
        config = default_config(num_tokens, TOP_K, E)
        runs = moe_align(ids, E, config.block_m)
        h = moe_gemm(x, w["w13"], runs, config.gemm1, gated=True)
        e1 = rel_err(h, moe_gemm_ref(x, w["w13"], ids, gated=True))
        check(f"gemm1 (gate/up + SiLU-and-mul) T={num_tokens}", e1 < 1e-2, f"max err / max |ref| {e1:.1e}")
        y = moe_gemm(h, w["w2"], runs, config.gemm2, topk_weights=weights)
        e2 = rel_err(y, moe_gemm_ref(h, w["w2"], ids, topk_weights=weights))
        check(f"gemm2 (down x routing weight) T={num_tokens}", e2 < 1e-2, f"max err / max |ref| {e2:.1e}")


def moe_layer(x: torch.Tensor, w: dict[str, torch.Tensor], config: MoeConfig | None = None) -> torch.Tensor:
    weights, ids = router_topk(F.linear(x, w["gate"]), TOP_K, True)
    return fused_experts(x, w["w13"], w["w2"], weights, ids, config)


def fp8_weights(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The experts as quantization="fp8" stores them (layers/moe.py): e4m3, one scale per expert and row."""
    from overnight.quant.fp8 import quantize_stacked_per_channel

    out = dict(gate=w["gate"])
    for name in ("w13", "w2"):
        out[name], out[name + "_scale"] = quantize_stacked_per_channel(w[name])
    return out


def per_expert_fp8(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The experts as vLLM's online FP8 (`quantization="fp8"`) holds them: e4m3 with one float32 scale
    an expert and projection (per tensor); its kernel quantizes the activations per tensor as they come."""
    out = {}
    for name in ("w13", "w2"):
        t = w[name].float()
        scale = t.abs().amax(dim=(1, 2)).clamp_min(1e-12) / torch.finfo(torch.float8_e4m3fn).max
        out[name] = (t / scale[:, None, None]).to(torch.float8_e4m3fn)
        out[name + "_scale"] = scale
    return out


def vllm_fp8_experts(
    vllm_fused, make_quant_config, x, v: dict[str, torch.Tensor], weights, ids
) -> torch.Tensor:
    """vLLM's fused_experts on per_expert_fp8's weights, W8A8 as its online FP8 layer calls it."""
    config = make_quant_config(w1_scale=v["w13_scale"], w2_scale=v["w2_scale"])
    return vllm_fused(x, v["w13"], v["w2"], weights, ids, quant_config=config)


def moe_layer_fp8(
    x: torch.Tensor, q: dict[str, torch.Tensor], config: MoeConfig | None = None, w8a8: bool = True
) -> torch.Tensor:
    weights, ids = router_topk(F.linear(x, q["gate"]), TOP_K, True)
    return fused_experts(
        x, q["w13"], q["w2"], weights, ids, config, q["w13_scale"], q["w2_scale"], fp8_activations=w8a8
    )


def check_fp8_layer(gen: torch.Generator, w: dict[str, torch.Tensor], q: dict[str, torch.Tensor]) -> None:
    """FP8 experts, W8A8 and weight-only: the fused layer against the PyTorch path's same arithmetic on
    the same e4m3 weights, and against the bf16 experts they came from (e4m3's rounding only)."""
    for num_tokens in (1, 256, 4096):
        x, weights, ids = make_batch(num_tokens, w["gate"], gen)
        exact = fused_experts_ref(x, w["w13"], w["w2"], weights, ids)
        # Against the bf16 experts: e4m3's rounding (3 mantissa bits, ~3.6% RMS an element) of the
        # weights, and for W8A8 of both GEMMs' inputs too: ~6% at these shapes, more for a lone token.
        for w8a8, bound in ((False, 8e-2), (True, 0.12)):
            out = fused_experts(
                x, q["w13"], q["w2"], weights, ids, None, q["w13_scale"], q["w2_scale"], fp8_activations=w8a8
            )
            ref = fused_experts_ref(
                x, q["w13"], q["w2"], weights, ids, q["w13_scale"], q["w2_scale"], fp8_activations=w8a8
            )
            err = float((out.float() - ref.float()).norm() / ref.float().norm())
            form = "w8a8" if w8a8 else "w-only"
            check(f"fp8 {form} vs PyTorch loop T={num_tokens}", err < 2e-2, f"relative L2 error {err:.1e}")
            err = float((out.float() - exact.float()).norm() / exact.float().norm())
            check(f"fp8 {form} vs bf16 experts T={num_tokens}", err < bound, f"relative L2 error {err:.1e}")


def torch_layer(x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    weights, ids = router_topk_ref(F.linear(x, w["gate"]), TOP_K, True)
    return fused_experts_ref(x, w["w13"], w["w2"], weights, ids)


def check_layer(gen: torch.Generator, w: dict[str, torch.Tensor]) -> None:
    # One routing for both: where bf16 logits tie at the k-th place, torch.topk and the kernel may
    # keep different (equally valid) experts; the router is checked on its own above.
    for num_tokens in (1, 256, 4096):
        x, weights, ids = make_batch(num_tokens, w["gate"], gen)
        out = fused_experts(x, w["w13"], w["w2"], weights, ids)
        ref = fused_experts_ref(x, w["w13"], w["w2"], weights, ids)
        err = float((out.float() - ref.float()).norm() / ref.float().norm())
        check(f"fused experts vs PyTorch loop T={num_tokens}", err < 2e-2, f"relative L2 error {err:.1e}")


def check_graph(gen: torch.Generator, w: dict[str, torch.Tensor]) -> None:
    num_tokens = 64
    static_x = torch.randn(num_tokens, H, generator=gen, device=DEV).to(DT)
    moe_layer(static_x, w)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = moe_layer(static_x, w)
    worst = 0.0
    for _ in range(3):
        fresh = torch.randn(num_tokens, H, generator=gen, device=DEV).to(DT)
        static_x.copy_(fresh)
        graph.replay()
        worst = max(worst, rel_err(static_out, moe_layer(fresh, w)))
    # Equal unless cuBLAS picks another router GEMM algorithm inside the capture.
    check(f"CUDA graph capture + replay of the layer, T={num_tokens}", worst < 1e-2, f"vs eager: {worst:.1e}")


def check_engine() -> dict[str, object]:
    """A 2-layer Qwen3-MoE of 30B-A3B's shapes through the engine, dummy weights, CUDA graphs on."""
    from overnight import LLM, SamplingParams
    from overnight.loader.resolve import PRESETS_DIR

    with open(os.path.join(PRESETS_DIR, "qwen3-30b-a3b.json")) as f:
        cfg = json.load(f)
    cfg["num_hidden_layers"] = 2
    folder = tempfile.mkdtemp(prefix="moe2-")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    start = time.perf_counter()
    llm = LLM(
        folder,
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=1024,
        max_num_seqs=64,
        kv_cache_memory_bytes=4 << 30,
    )
    startup = time.perf_counter() - start
    gen = torch.Generator().manual_seed(0)
    prompts = [
        {"prompt_token_ids": torch.randint(10, 150000, (n,), generator=gen).tolist()} for n in range(40, 104)
    ]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    lengths = {len(o.outputs[0].token_ids) for o in outs}
    graphs = getattr(llm.engine.runner, "graphs", None) is not None
    check("engine: 2-layer Qwen3-MoE, 64 prompts x 32 tokens", lengths == {32} and graphs, f"graphs={graphs}")
    result: dict[str, object] = {"startup_s": round(startup, 1), "generate_s": round(elapsed, 2)}
    del llm
    torch.cuda.empty_cache()
    return result


# -- 2. tuning ---------------------------------------------------------------------------------------


def fits(block_m: int, bn: int, bk: int, warps: int, stages: int, gated: bool, elem_bytes: int = 2) -> bool:
    """Whether the tile's pipeline stages fit in shared memory (operands of elem_bytes: 1 for W8A8)
    and its accumulators in registers."""
    b_cols = 2 * bn if gated else bn
    smem = stages * (block_m * bk + bk * b_cols) * elem_bytes
    acc_per_thread = block_m * b_cols / (32 * warps)
    return smem <= SMEM_LIMIT and acc_per_thread <= 128


def candidate_block_ms(num_tokens: int, fp8: bool = False) -> list[int]:
    """fp8 (W8A8): 64 rows too, the least that runs its dots as Hopper's e4m3 warpgroup MMA (below it
    Triton converts both operands to 16 bits: tests/test_kernels_sm90_fit.py)."""
    r = rows_per_expert(num_tokens)
    if fp8 and r <= 64:
        return [16, 32, 64] if r > 4 else [16, 64]
    if r <= 4:
        return [16]
    if r <= 16:
        return [16, 32]
    if r <= 64:
        return [32, 64]
    return [64, 128]


def sweep_bucket(num_tokens: int, w: dict[str, torch.Tensor], gen: torch.Generator, deadline: float):
    """Best (config, times) for one bucket, or None when nothing ran; rows: (BLOCK_M, gemm, tiles, ms).
    w may hold FP8 experts (fp8_weights): their scales go along, and both GEMMs read e4m3 rows with a
    scale each (W8A8, fused_moe.py's fp8_activations), quantized once here: the sweep times the GEMMs."""
    s13, s2 = w.get("w13_scale"), w.get("w2_scale")
    fp8 = s13 is not None
    x, weights, ids = make_batch(num_tokens, w["gate"], gen)
    pairs = num_tokens * TOP_K
    h = torch.empty(pairs, I, dtype=DT, device=DEV)
    y = torch.empty(pairs, H, dtype=DT, device=DEV)
    x_in, x_scale = gemm_operand(x, fp8)
    best = None
    for block_m in candidate_block_ms(num_tokens, fp8):
        runs = moe_align(ids, E, block_m)
        t_align = bench(lambda runs=runs, bm=block_m: moe_align(ids, E, bm))
        tiles0 = default_config(num_tokens, TOP_K, E).gemm1
        moe_gemm(x_in, w["w13"], runs, tiles0, gated=True, out=h, w_scale=s13, a_scale=x_scale)
        h_in, h_scale = gemm_operand(h, fp8)
        per_gemm = {}
        for gemm in ("gemm1", "gemm2"):
            gated = gemm == "gemm1"
            results: list[tuple[float, GemmTiles]] = []
            for bn, bk, warps, stages in TILES[block_m] + (FP8_EXTRA_TILES.get(block_m, []) if fp8 else []):
                if time.perf_counter() > deadline and results:
                    break
                if not fits(block_m, bn, bk, warps, stages, gated, 1 if fp8 else 2):
                    continue
                tiles = GemmTiles(bn, bk, 8, warps, stages)
                if gated:
                    fn = functools.partial(
                        moe_gemm, x_in, w["w13"], runs, tiles, gated=True, out=h, w_scale=s13, a_scale=x_scale
                    )
                else:
                    fn = functools.partial(
                        moe_gemm, h_in, w["w2"], runs, tiles, topk_weights=weights, out=y, w_scale=s2,
                        a_scale=h_scale,
                    )  # fmt: skip
                try:
                    results.append((bench(fn), tiles))
                except Exception as e:  # a tile shape the GPU cannot run (resources): skip it
                    print(f"    skip BLOCK_M={block_m} {gemm} {tiles}: {type(e).__name__}: {str(e)[:100]}")
            if results:
                per_gemm[gemm] = min(results, key=lambda r: r[0])
        if len(per_gemm) == 2:
            total = t_align + per_gemm["gemm1"][0] + per_gemm["gemm2"][0]
            if best is None or total < best[0]:
                config = MoeConfig(block_m, per_gemm["gemm1"][1], per_gemm["gemm2"][1])
                best = (total, config, t_align, per_gemm["gemm1"][0], per_gemm["gemm2"][0])
    if best is None:
        return None
    total, config, t_align, t1, t2 = best
    # GROUP_M on the winners, time permitting (it orders tiles for L2 reuse of an expert's weights).
    runs = moe_align(ids, E, config.block_m)
    moe_gemm(x_in, w["w13"], runs, config.gemm1, gated=True, out=h, w_scale=s13, a_scale=x_scale)
    h_in, h_scale = gemm_operand(h, fp8)
    for group_m in (1, 16):
        if time.perf_counter() > deadline:
            break
        g1 = dataclasses.replace(config.gemm1, group_m=group_m)
        g2 = dataclasses.replace(config.gemm2, group_m=group_m)
        try:
            n1 = bench(
                lambda g=g1: moe_gemm(
                    x_in, w["w13"], runs, g, gated=True, out=h, w_scale=s13, a_scale=x_scale
                )
            )
            n2 = bench(
                lambda g=g2: moe_gemm(
                    h_in, w["w2"], runs, g, topk_weights=weights, out=y, w_scale=s2, a_scale=h_scale
                )
            )
        except Exception:
            continue
        if n1 < t1:
            config, t1 = MoeConfig(config.block_m, g1, config.gemm2), n1
        if n2 < t2:
            config, t2 = MoeConfig(config.block_m, config.gemm1, g2), n2
    # The winner must compute the right thing.
    runs = moe_align(ids, E, config.block_m)
    h_ok = moe_gemm(
        x_in, w["w13"], runs, config.gemm1, gated=True, w_scale=s13, a_scale=x_scale, out_dtype=DT
    )
    h_q, h_scale = gemm_operand(h_ok, fp8)
    y_ok = moe_gemm(
        h_q, w["w2"], runs, config.gemm2, topk_weights=weights, w_scale=s2, a_scale=h_scale, out_dtype=DT
    )
    ref1 = moe_gemm_ref(x_in, w["w13"], ids, gated=True, w_scale=s13, a_scale=x_scale, out_dtype=DT)
    ref2 = moe_gemm_ref(h_q, w["w2"], ids, topk_weights=weights, w_scale=s2, a_scale=h_scale, out_dtype=DT)
    e1, e2 = rel_err(h_ok, ref1), rel_err(y_ok, ref2)
    check(
        f"tuned config T={num_tokens} matches the reference", e1 < 1e-2 and e2 < 1e-2, f"{e1:.1e} / {e2:.1e}"
    )
    if e1 >= 1e-2 or e2 >= 1e-2:
        return None
    return config, t_align, t1, t2


# -- 3. the layer ------------------------------------------------------------------------------------


def layer_rows(
    w: dict[str, torch.Tensor], gen: torch.Generator, vllm_fused, vllm_fp8_config=None
) -> list[dict]:
    """vllm_fused / vllm_fp8_config: vLLM's fused_experts and fp8_w8a8_moe_quant_config where vLLM
    imports (its columns: bf16 timed eagerly, W8A8 from CUDA graphs as ours, with its error against
    the bf16 PyTorch layer so a wrong call shows), else None."""
    rows = []
    q = fp8_weights(w)
    v8 = per_expert_fp8(w) if vllm_fused is not None and vllm_fp8_config is not None else None
    expert_bytes = 3 * H * I * 2
    for num_tokens in LAYER_SIZES:
        x = torch.randn(num_tokens, H, generator=gen, device=DEV).to(DT)
        _, ids = router_topk(F.linear(x, w["gate"]), TOP_K, True)
        hit = int(torch.unique(ids).numel())
        config = get_config(num_tokens, E, I, H, TOP_K, DT, DEV)
        config8 = get_config(num_tokens, E, I, H, TOP_K, DT, DEV, torch.float8_e4m3fn)  # bf16's until tuned
        # ours from CUDA graphs, as the engine runs the layer: timed eagerly, the Python launches of its
        # 7-9 kernels decide the small rows (session N's eager T=1 row had w-only at half bf16's time)
        t_fused = graph_time([lambda x=x, c=config: moe_layer(x, w, c)] * 5) / 1e3
        t_fp8 = graph_time([lambda x=x, c=config8: moe_layer_fp8(x, q, c)] * 5) / 1e3
        t_wonly = graph_time([lambda x=x, c=config8: moe_layer_fp8(x, q, c, w8a8=False)] * 5) / 1e3
        t_torch = bench(lambda x=x: torch_layer(x, w), warmup=2, rep=50)
        t_vllm = t_vllm8 = err_vllm8 = None
        if vllm_fused is not None:  # vLLM's columns route once, with our router (the same picks)
            weights, ids32 = router_topk(F.linear(x, w["gate"]), TOP_K, True)
            try:
                t_vllm = bench(lambda x=x, a=weights, b=ids32: vllm_fused(x, w["w13"], w["w2"], a, b), rep=50)
            except Exception as e:
                print(f"    vLLM fused_experts failed: {type(e).__name__}: {str(e)[:120]}")
        if v8 is not None:
            try:
                call = functools.partial(vllm_fp8_experts, vllm_fused, vllm_fp8_config, x, v8, weights, ids32)
                err_vllm8 = rel_err(call(), torch_layer(x, w))
                t_vllm8 = graph_time([call] * 5) / 1e3
            except Exception as e:
                print(f"    vLLM fp8 fused_experts failed: {type(e).__name__}: {str(e)[:160]}")
        flops = 2.0 * num_tokens * TOP_K * 3 * H * I
        rows.append(
            dict(
                tokens=num_tokens,
                experts_hit=hit,
                block_m=config.block_m,
                fused_us=round(1e3 * t_fused, 1),
                fp8_us=round(1e3 * t_fp8, 1),
                fp8_wonly_us=round(1e3 * t_wonly, 1),
                torch_us=round(1e3 * t_torch, 1),
                vllm_experts_us=None if t_vllm is None else round(1e3 * t_vllm, 1),
                vllm_fp8_us=None if t_vllm8 is None else round(1e3 * t_vllm8, 1),
                vllm_fp8_err=None if err_vllm8 is None else round(err_vllm8, 4),
                speedup_vs_torch=round(t_torch / t_fused, 2),
                tflops=round(flops / (t_fused * 1e-3) / 1e12, 1),
                weight_gbps=round(hit * expert_bytes / (t_fused * 1e-3) / 1e9, 0),
            )
        )
        print(f"    layer T={num_tokens}: {rows[-1]}", flush=True)
    return rows


def merge_tuned(
    table: dict[str, dict[str, dict[str, Any]]], gpu: str, key: str, tuned: dict[str, Any]
) -> dict[str, dict[str, dict[str, Any]]]:
    """The config table with this sweep's buckets in place: a bucket tuned now replaces its old entry,
    the shape's other buckets stay (a --buckets sweep of a few sizes keeps the rest). table is not
    changed."""
    merged = {g: dict(shapes) for g, shapes in table.items()}
    shapes = merged.setdefault(gpu, {})
    shapes[key] = {**shapes.get(key, {}), **tuned}
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--install", action="store_true", help="write the tuned configs into the package")
    parser.add_argument("--skip-engine", action="store_true", help="skip the 2-layer engine run")
    parser.add_argument(
        "--fp8", action="store_true", help="tune (and install) the tiles of FP8 experts instead of bf16 ones"
    )
    parser.add_argument(
        "--buckets", default=None, help="token counts to tune, e.g. 256,512,1024 (default: all)"
    )
    parser.add_argument("--deadline", type=float, default=SWEEP_DEADLINE_S, help="seconds the sweep may take")
    args = parser.parse_args()
    buckets = [int(b) for b in args.buckets.split(",")] if args.buckets else BUCKETS
    start = time.time()
    gpu = device_name(DEV)
    print(
        f"fused MoE on {gpu} (SM clock {sm_clock_now()}), torch {torch.__version__}, triton {triton.__version__}"
    )
    print(f"shapes: H={H} I={I} E={E} top_k={TOP_K} {DT}")
    torch.manual_seed(0)
    gen = torch.Generator(device=DEV).manual_seed(0)
    w = make_weights(gen)

    print("correctness:")
    engine: dict[str, object] = {}
    steps = [
        ("router", lambda: check_router(gen)),
        ("align", lambda: check_align(gen, w["gate"])),
        ("gemms", lambda: check_gemms(gen, w)),
        ("layer", lambda: check_layer(gen, w)),
        ("fp8 layer", lambda: check_fp8_layer(gen, w, fp8_weights(w))),
        ("graph", lambda: check_graph(gen, w)),
    ]
    for name, step in steps:
        try:
            step()
        except Exception as e:
            check(f"{name} check raised", False, f"{type(e).__name__}: {e}")
            traceback.print_exc()

    print(f"tuning (median of do_bench, L2 flushed; deadline {args.deadline:.0f} s):", flush=True)
    sweep_start = time.perf_counter()
    deadline = sweep_start + args.deadline
    tuned: dict[str, dict] = {}
    table = []
    for num_tokens in buckets:
        if time.perf_counter() > deadline:
            print(f"  deadline reached: buckets from T={num_tokens} on keep the defaults")
            break
        try:
            res = sweep_bucket(num_tokens, fp8_weights(w) if args.fp8 else w, gen, deadline)
        except Exception as e:
            check(f"sweep T={num_tokens} raised", False, f"{type(e).__name__}: {e}")
            traceback.print_exc()
            continue
        if res is None:
            continue
        config, t_align, t1, t2 = res
        tuned[str(num_tokens)] = config.to_json()
        table.append((num_tokens, config, t_align, t1, t2))
        print(
            f"  T={num_tokens:>5}: BLOCK_M={config.block_m:<3} gemm1 {config.gemm1} {1e3 * t1:8.1f} us   "
            f"gemm2 {config.gemm2} {1e3 * t2:8.1f} us   align {1e3 * t_align:6.1f} us",
            flush=True,
        )
    print(f"  sweep took {time.perf_counter() - sweep_start:.0f} s")

    key = shape_key(E, I, H, TOP_K, DT, torch.float8_e4m3fn if args.fp8 else None)
    entry = {gpu: {key: tuned}}
    text = json.dumps(entry, indent=1)
    out_dir = os.environ.get("OUT")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "moe_configs.json"), "w") as f:
            f.write(text + "\n")
    if args.install and tuned:
        with open(moe_configs.CONFIG_FILE, "w") as f:
            json.dump(merge_tuned(moe_configs._table(), gpu, key, tuned), f, indent=1, sort_keys=True)
            f.write("\n")
        print(f"  wrote {moe_configs.CONFIG_FILE}")
    moe_configs._table.cache_clear()
    if tuned and not args.install:  # time the layer with the configs just found, package file untouched
        merged = merge_tuned(moe_configs._table(), gpu, key, tuned)
        moe_configs._table = lambda: merged  # type: ignore[assignment]

    vllm_fused = vllm_fp8_config = None
    try:
        from vllm.model_executor.layers.fused_moe import fused_experts as vllm_fused  # type: ignore
        from vllm.model_executor.layers.fused_moe.config import (  # type: ignore
            fp8_w8a8_moe_quant_config as vllm_fp8_config,
        )
    except Exception:
        pass
    print(
        "the MoE layer (router GEMM, top-k, align, GEMMs, sum) vs the PyTorch loop over experts:", flush=True
    )
    layer = []
    try:
        layer = layer_rows(w, gen, vllm_fused, vllm_fp8_config)
    except Exception as e:
        check("layer benchmark raised", False, f"{type(e).__name__}: {e}")
        traceback.print_exc()

    print("routing (the router and each alignment variant, us a call from a CUDA graph):", flush=True)
    routing: list[dict] = []
    try:
        routing = routing_rows(gen, w["gate"])
    except Exception as e:
        check("routing benchmark raised", False, f"{type(e).__name__}: {e}")
        traceback.print_exc()

    if not args.skip_engine:
        print("engine:", flush=True)
        torch.cuda.empty_cache()
        try:
            engine = check_engine()
        except Exception as e:
            check("engine run raised", False, f"{type(e).__name__}: {e}")
            traceback.print_exc()

    print()
    print("=== configs for overnight/kernels/moe_configs.json (merge under the GPU name) ===")
    print(text)
    print()
    print(f"{'tokens':>6} {'BLOCK_M':>7} {'align us':>9} {'gemm1 us':>9} {'gemm2 us':>9}")
    for num_tokens, config, t_align, t1, t2 in table:
        print(f"{num_tokens:>6} {config.block_m:>7} {1e3 * t_align:>9.1f} {1e3 * t1:>9.1f} {1e3 * t2:>9.1f}")
    print()
    print(
        f"{'tokens':>6} {'hit':>4} {'fused us':>9} {'fp8 us':>8} {'fp8 w-only':>10} {'torch us':>9} {'vllm us':>8} {'vllm fp8':>8} {'x torch':>7} {'TFLOP/s':>8} {'GB/s':>6}"
    )
    for r in layer:
        vllm = "n/a" if r["vllm_experts_us"] is None else f"{r['vllm_experts_us']:.1f}"
        vllm8 = "n/a" if r["vllm_fp8_us"] is None else f"{r['vllm_fp8_us']:.1f}"
        print(
            f"{r['tokens']:>6} {r['experts_hit']:>4} {r['fused_us']:>9.1f} {r['fp8_us']:>8.1f} {r['fp8_wonly_us']:>10.1f} {r['torch_us']:>9.1f} {vllm:>8} {vllm8:>8} "
            f"{r['speedup_vs_torch']:>7.2f} {r['tflops']:>8.1f} {r['weight_gbps']:>6.0f}"
        )
    print()
    variants = [f"align_{v}_us" for v in ALIGN_VARIANTS]
    print(f"{'tokens':>6} {'BLOCK_M':>7} {'router us':>9} " + " ".join(f"{v:>17}" for v in variants))
    for r in routing:
        print(
            f"{r['tokens']:>6} {r['block_m']:>7} {r['router_us']:>9.2f} "
            + " ".join(f"{r[v]:>17.2f}" for v in variants)
        )
    failed = [name for name, ok, _ in checks if not ok]
    print(f"\n{len(checks) - len(failed)}/{len(checks)} checks passed; total {time.time() - start:.0f} s")
    print(
        json.dumps(
            {
                "bench": "moe_gpu",
                "gpu": gpu,
                "sm_clock": sm_clock_now(),
                "checks_failed": failed,
                "configs": entry,
                "layer": layer,
                "routing": routing,
                "engine": engine,
                "hbm_gbps_peak": HBM_GBPS,
                "total_s": round(time.time() - start, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
