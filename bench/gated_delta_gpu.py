"""GPU check and benchmark of the Gated DeltaNet ops: the torch reference path against our Triton kernels
(kernels/gated_delta_decode.py: decode, and the token-by-token varlen form for prefill) and fla-core
(its chunked prefill; its fused_recurrent for decode).

Run on the GPU machine from the repository root:  PYTHONPATH=. python bench/gated_delta_gpu.py
Needs torch + triton; fla-core (the `gpu` extra) for its rows, which are skipped with a line without it.
Fixed seed; about a minute (most of it fla's first compilations). Qwen3.5-9B's linear layer
(loader/presets/qwen3.5-9b.json): 16 key heads, 32 value heads of 128, conv kernel 4; one layer.

1. Correctness (each a PASS/FAIL line): every GPU path against TorchDeltaRuleOps (float32 math) on the
   same inputs, relative error ||out - ref|| / ||ref|| in float64, outputs allocated over NaN-poisoned
   memory (an unwritten element fails); bf16 and fp32 inputs; requests at slots that are
   not 0..n-1, some starting from zeros over NaN-poisoned slots, the other slots checked untouched; a
   prompt prefilled in two chunks then decoded three steps (states carried across chunks and steps);
   the decode kernels captured in a CUDA graph and replayed with new slots and inputs.
2. Timing: decode at batch 1/64/256 (graph replays: decode steps run captured), prefill of 16 x 512
   and 4 x 2048 tokens (eager, as the engine runs prefill); state bytes moved / time as GB/s against
   ~4.3 TB/s for decode; the rows marked "bf16 state" keep the delta-rule state in bfloat16
   (--mamba-ssm-cache-dtype bfloat16: half its bytes). A table, then one line of JSON.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from functools import partial

import torch

from overnight.attention.linear_state import LinearStateBatch
from overnight.layers.gated_delta import gdn_gates
from overnight.layers.gated_delta_ops import (
    DeltaLayer,
    PrefillRows,
    TorchDeltaRuleOps,
    TritonDeltaRuleOps,
    conv_step_split,
    fla_importable,
)

HK, HV, DK, DV, KW = 16, 32, 128, 128, 4
CONV_DIM = 2 * HK * DK + HV * DV
HBM_GBPS = 4300.0
DEV = torch.device("cuda")
DECODE_BATCHES = [1, 64, 256]
PREFILLS = [(16, 512), (4, 2048)]
DECODE_CONFIGS = [(8, 1), (16, 2), (32, 8), (64, 4), (64, 8)]  # (32, 4) is the default
NUM_SLOTS = 300  # more slots than the largest batch: requests sit at scattered slots

checks: list[tuple[str, bool, str]] = []
rows: list[dict] = []
TORCH = TorchDeltaRuleOps()
TRITON = TritonDeltaRuleOps(fla_prefill=False)
FLA = TritonDeltaRuleOps(fla_prefill=True)


def make_layer(dtype: torch.dtype, gen: torch.Generator) -> DeltaLayer:
    return DeltaLayer(
        HK,
        HV,
        DK,
        DV,
        (0.5 * torch.randn(CONV_DIM, KW, generator=gen, device=DEV)).to(dtype),
        torch.empty(HV, device=DEV).uniform_(1, 16, generator=gen).log(),  # as Qwen initialises A
        torch.rand(HV, generator=gen, device=DEV).to(dtype),
    )


def make_rows(n: int, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """mixed [n, conv_dim], a, b [n, Hv]: inputs of the conv and the gates."""
    mixed = torch.randn(n, CONV_DIM, generator=gen, device=DEV).to(dtype)
    a = torch.randn(n, HV, generator=gen, device=DEV).to(dtype)
    b = torch.randn(n, HV, generator=gen, device=DEV).to(dtype)
    return mixed, a, b


def make_pools(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    conv = torch.randn(NUM_SLOTS + 1, KW - 1, CONV_DIM, generator=gen, device=DEV)
    ssm = 0.1 * torch.randn(NUM_SLOTS + 1, HV, DK, DV, generator=gen, device=DEV)
    return conv, ssm


def state_batch(slots: torch.Tensor, has: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor):
    return LinearStateBatch([conv], [ssm], slots, has, slots.tolist(), [bool(h) for h in has.tolist()])


def prefill_rows(lens: list[int], slots: list[int], has: list[bool]) -> PrefillRows:
    return PrefillRows.of(lens, slots, has, DEV)


def poison_allocator() -> None:
    """Fill blocks of the caching allocator with NaN and free them: outputs allocated uninitialized next
    (torch.empty in the ops) start as NaN, so an element a kernel fails to write fails its check."""
    junk = [torch.full((1 << e,), float("nan"), device=DEV) for e in range(10, 27, 2) for _ in range(4)]
    del junk


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def record(name: str, errs: dict[str, float], tol: float, extra_ok: bool = True, note: str = "") -> None:
    ok = extra_ok and all(e == e and e <= tol for e in errs.values())  # e == e: not NaN
    detail = ", ".join(f"{k} {v:.2e}" for k, v in errs.items()) + f" (tol {tol:.0e}){note}"
    checks.append((name, ok, detail))
    print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)


def check_decode(ops: TritonDeltaRuleOps | None, name: str, dtype: torch.dtype, tol: float) -> None:
    """Three decode steps of 8 requests at scattered slots, two of them fresh over NaN slots."""
    gen = torch.Generator(device=DEV).manual_seed(1)
    layer = make_layer(dtype, gen)
    conv, ssm = make_pools(gen)
    slots = torch.randperm(NUM_SLOTS, generator=gen, device=DEV)[:8]
    has = torch.tensor([1, 0, 1, 1, 0, 1, 1, 1], dtype=torch.float32, device=DEV)
    fresh = slots[has == 0]
    conv[fresh], ssm[fresh] = float("nan"), float("nan")
    ref_conv, ref_ssm = conv.clone(), ssm.clone()
    ref_conv[fresh], ref_ssm[fresh] = 0.0, 0.0
    errs: dict[str, float] = {}
    for step in range(3):
        mixed, a, b = make_rows(len(slots), dtype, gen)
        st = state_batch(slots, has, conv, ssm)
        poison_allocator()
        if ops is None:
            o = fla_decode(layer, mixed, a, b, conv, ssm, st)
        else:
            o = ops.decode(layer, mixed, a, b, conv, ssm, st)
        o_ref = TORCH.decode(
            layer, mixed, a, b, ref_conv, ref_ssm, state_batch(slots, has, ref_conv, ref_ssm)
        )
        errs[f"o{step}"] = rel_err(o, o_ref)
        has = torch.ones_like(has)
    errs["ssm"] = rel_err(ssm[slots], ref_ssm[slots])
    errs["conv"] = rel_err(conv[slots], ref_conv[slots])
    others = torch.ones(NUM_SLOTS + 1, dtype=torch.bool, device=DEV)
    others[slots] = False
    untouched = torch.equal(ssm[others], ref_ssm[others]) and torch.equal(conv[others], ref_conv[others])
    record(
        f"decode {name} {str(dtype)[6:]}", errs, tol, untouched, "" if untouched else "; OTHER SLOTS CHANGED"
    )


def check_prefill_then_decode(prefill: TritonDeltaRuleOps, dtype: torch.dtype, tol: float) -> None:
    """Four prompts in one varlen call (two continue from their slots), then the longest one's second
    chunk, then three decode steps of all four: the prefill ops + Triton decode against torch."""
    gen = torch.Generator(device=DEV).manual_seed(2)
    layer = make_layer(dtype, gen)
    conv, ssm = make_pools(gen)
    slots, has = [12, NUM_SLOTS - 100, 5, 77], [True, False, False, True]
    for fresh in slots[1:3]:
        conv[fresh], ssm[fresh] = float("nan"), float("nan")
    ref_conv, ref_ssm = conv.clone(), ssm.clone()
    errs: dict[str, float] = {}
    for i, (lens, has_now) in enumerate([([1, 63, 200, 517], has), ([130], [True])]):
        use = slots if i == 0 else [77]
        rows = prefill_rows(lens, use, has_now)
        mixed, a, b = make_rows(sum(lens), dtype, gen)
        poison_allocator()
        o = prefill.prefill(layer, mixed, a, b, conv, ssm, rows)
        o_ref = TORCH.prefill(layer, mixed, a, b, ref_conv, ref_ssm, rows)
        errs[f"prefill{i}"] = rel_err(o, o_ref)
    slot_t, ones = torch.tensor(slots, device=DEV), torch.ones(4, device=DEV)
    for step in range(3):
        mixed, a, b = make_rows(4, dtype, gen)
        poison_allocator()
        o = TRITON.decode(layer, mixed, a, b, conv, ssm, state_batch(slot_t, ones, conv, ssm))
        o_ref = TORCH.decode(
            layer, mixed, a, b, ref_conv, ref_ssm, state_batch(slot_t, ones, ref_conv, ref_ssm)
        )
        errs[f"decode{step}"] = rel_err(o, o_ref)
    errs["ssm"] = rel_err(ssm[slot_t], ref_ssm[slot_t])
    errs["conv"] = rel_err(conv[slot_t], ref_conv[slot_t])
    record(f"{prefill.name} prefill (2 chunks) + triton decode {str(dtype)[6:]}", errs, tol)


def check_graph(dtype: torch.dtype) -> None:
    """The decode kernels captured at batch 64, replayed with other slots and inputs, against eager."""
    gen = torch.Generator(device=DEV).manual_seed(3)
    layer = make_layer(dtype, gen)
    conv, ssm = make_pools(gen)
    n = 64
    mixed, a, b = make_rows(n, dtype, gen)
    slots = torch.randperm(NUM_SLOTS, generator=gen, device=DEV)[:n]
    has = torch.ones(n, device=DEV)
    st = state_batch(slots, has, conv, ssm)
    TRITON.decode(layer, mixed, a, b, conv.clone(), ssm.clone(), st)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = TRITON.decode(layer, mixed, a, b, conv, ssm, st)
    new_mixed, new_a, new_b = make_rows(n, dtype, gen)
    new_slots = torch.randperm(NUM_SLOTS, generator=gen, device=DEV)[:n]
    new_has = (torch.rand(n, generator=gen, device=DEV) > 0.3).float()
    ref_conv, ref_ssm = conv.clone(), ssm.clone()
    o_ref = TRITON.decode(
        layer, new_mixed, new_a, new_b, ref_conv, ref_ssm, state_batch(new_slots, new_has, ref_conv, ref_ssm)
    )
    for src, dst in [(new_mixed, mixed), (new_a, a), (new_b, b), (new_slots, slots), (new_has, has)]:
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    same = torch.equal(out, o_ref) and torch.equal(ssm, ref_ssm) and torch.equal(conv, ref_conv)
    checks.append(("cuda graph replay", same, "bitwise equal to eager" if same else "DIFFERS"))
    print(
        f"{'PASS' if same else 'FAIL'}  decode kernels in a CUDA graph: replay == eager: {same}", flush=True
    )


def fla_decode(layer, mixed, a, b, conv, ssm, st):  # type: ignore[no-untyped-def]
    """fla's fused_recurrent for the rule (states gathered by slot and scattered back: it has no slot
    indices), our conv step kernel before it."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    q, k, v, idx, keep = conv_step_split(layer, mixed, conv, st)
    g, beta = gdn_gates(a, b, layer.A_log, layer.dt_bias)
    h0 = torch.where(keep[:, None, None, None] != 0, ssm[idx], 0.0)
    o, s = fused_recurrent_gated_delta_rule(
        q[:, None],
        k[:, None],
        v[:, None],
        g=g[:, None],
        beta=beta[:, None],
        scale=DK**-0.5,
        initial_state=h0,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    ssm.index_copy_(0, idx, s.float())
    return o[:, 0]


def triton_decode(block_v, num_warps, layer, mixed, a, b, conv, ssm, st):  # type: ignore[no-untyped-def]
    """TritonDeltaRuleOps.decode with another tile for the delta step (the tuning sweep)."""
    from overnight.kernels.gated_delta_decode import delta_step

    q, k, v, idx, keep = conv_step_split(layer, mixed, conv, st)
    return delta_step(q, k, v, a, b, layer.A_log, layer.dt_bias, ssm, idx, keep, block_v, num_warps)


def triton_prefill(block_v, num_warps, layer, mixed, a, b, conv, ssm, rows):  # type: ignore[no-untyped-def]
    """TritonDeltaRuleOps.prefill without fla, with another tile for the varlen kernel."""
    from overnight.kernels.gated_delta_decode import delta_rule_varlen
    from overnight.layers.gated_delta_ops import varlen_causal_conv1d

    y = varlen_causal_conv1d(mixed, layer.conv_weight, conv, rows.starts, rows.slots, rows.has_state)
    q, k, v = layer.split(y)
    return delta_rule_varlen(
        q,
        k,
        v,
        a,
        b,
        layer.A_log,
        layer.dt_bias,
        ssm,
        rows.slot_ids,
        rows.has_state_dev,
        rows.cu_seqlens,
        block_v,
        num_warps,
    )


def guarded(name: str, fn: Callable[..., None], *args: object) -> None:
    """Run one check or timing; an exception is a FAIL line, and the rest still runs."""
    try:
        fn(*args)
    except Exception as e:
        checks.append((name, False, f"{type(e).__name__}: {e}"))
        print(f"FAIL  {name}: raised {type(e).__name__}: {str(e)[:300]}", flush=True)
        torch.cuda.synchronize()


def graph_time_us(fn: Callable[[], object], reps: int = 50) -> tuple[float, str]:
    """Median of `reps` replays of fn captured in a CUDA graph (eager if capture fails)."""
    fn()
    torch.cuda.synchronize()
    mode = "graph"
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run: Callable[[], object] = graph.replay
    except Exception as e:  # the torch path or fla may not capture
        print(f"  (capture failed: {type(e).__name__}: {str(e)[:80]}; timing eager)", flush=True)
        torch.cuda.synchronize()
        run, mode = fn, "eager"
    return events_time_us(run, reps), mode


def events_time_us(fn: Callable[[], object], reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return sorted(times)[len(times) // 2]


def bench_decode(fla_ok: bool) -> None:
    gen = torch.Generator(device=DEV).manual_seed(4)
    layer = make_layer(torch.bfloat16, gen)
    conv, ssm = make_pools(gen)
    ssm16 = ssm.to(torch.bfloat16)
    conv_bytes = (KW - 1) * CONV_DIM * 4 * 2  # read + write per request
    state_bytes = {4: HV * DK * DV * 4 * 2 + conv_bytes, 2: HV * DK * DV * 2 * 2 + conv_bytes}
    for n in DECODE_BATCHES:
        mixed, a, b = make_rows(n, torch.bfloat16, gen)
        slots = torch.randperm(NUM_SLOTS, generator=gen, device=DEV)[:n]
        st = state_batch(slots, torch.ones(n, device=DEV), conv, ssm)
        st16 = state_batch(slots, torch.ones(n, device=DEV), conv, ssm16)
        impls: dict[str, Callable[[], object]] = {
            "torch": partial(TORCH.decode, layer, mixed, a, b, conv, ssm, st),
            "triton": partial(TRITON.decode, layer, mixed, a, b, conv, ssm, st),
            "triton, bf16 state": partial(TRITON.decode, layer, mixed, a, b, conv, ssm16, st16),
        }
        for bv, warps in DECODE_CONFIGS:  # the delta step's tile (dk x bv) and warps; default (32, 4)
            impls[f"triton bv{bv} w{warps}"] = partial(
                triton_decode, bv, warps, layer, mixed, a, b, conv, ssm, st
            )
        if fla_ok:
            impls["fla fused_recurrent"] = partial(fla_decode, layer, mixed, a, b, conv, ssm, st)
        base = None
        for impl, fn in impls.items():
            try:
                us, mode = graph_time_us(fn)
            except Exception as e:
                print(f"  {impl} at batch {n} raised {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            base = base or us
            gbps = n * state_bytes[2 if "bf16 state" in impl else 4] / us / 1e3
            rows.append(
                dict(
                    op="decode", shape=f"batch {n}", impl=impl, mode=mode, us=us, gbps=gbps, speedup=base / us
                )
            )


def bench_prefill(fla_ok: bool) -> None:
    gen = torch.Generator(device=DEV).manual_seed(5)
    layer = make_layer(torch.bfloat16, gen)
    conv, ssm = make_pools(gen)
    ssm16 = ssm.to(torch.bfloat16)
    for nseq, length in PREFILLS:
        rows_ = prefill_rows([length] * nseq, list(range(3, 3 + 2 * nseq, 2)), [False] * nseq)
        mixed, a, b = make_rows(nseq * length, torch.bfloat16, gen)
        impls: dict[str, Callable[[], object]] = {
            "torch": partial(TORCH.prefill, layer, mixed, a, b, conv, ssm, rows_),
            "triton recurrent (varlen)": partial(TRITON.prefill, layer, mixed, a, b, conv, ssm, rows_),
            "triton recurrent bv8 w1": partial(triton_prefill, 8, 1, layer, mixed, a, b, conv, ssm, rows_),
        }
        if fla_ok:
            impls["fla chunk (varlen)"] = partial(FLA.prefill, layer, mixed, a, b, conv, ssm, rows_)
            impls["fla chunk (varlen), bf16 state"] = partial(
                FLA.prefill, layer, mixed, a, b, conv, ssm16, rows_
            )
        base = None
        for impl, fn in impls.items():
            try:
                fn()
                us = events_time_us(fn, 10)
            except Exception as e:
                print(f"  {impl} at {nseq} x {length} raised {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            base = base or us
            rows.append(
                dict(
                    op="prefill",
                    shape=f"{nseq} x {length}",
                    impl=impl,
                    mode="eager",
                    us=us,
                    gbps=0.0,
                    speedup=base / us,
                )
            )


def main() -> None:
    t0 = time.time()
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}", flush=True)
    fla_ok = fla_importable()
    if fla_ok:
        import fla

        print(f"fla-core {fla.__version__}", flush=True)
    else:
        print(
            "fla-core is not importable: its rows (fla prefill, fla fused_recurrent) are skipped", flush=True
        )

    for dtype, tol in [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)]:
        guarded(f"decode triton {dtype}", check_decode, TRITON, "triton", dtype, tol)
        guarded(f"triton prefill + decode {dtype}", check_prefill_then_decode, TRITON, dtype, tol)
        if fla_ok:
            guarded(f"decode fla {dtype}", check_decode, None, "fla fused_recurrent", dtype, tol)
            # fla's chunk kernels run their dots in tf32 on fp32 inputs
            prefill_tol = tol if dtype == torch.bfloat16 else 2e-3
            guarded(
                f"fla prefill + triton decode {dtype}", check_prefill_then_decode, FLA, dtype, prefill_tol
            )
    guarded("cuda graph replay", check_graph, torch.bfloat16)
    print(f"checks done in {time.time() - t0:.0f} s", flush=True)

    guarded("decode timings", bench_decode, fla_ok)
    guarded("prefill timings", bench_prefill, fla_ok)

    print(
        f"\n{'op':8} {'shape':12} {'impl':26} {'mode':6} {'time us':>10} {'state GB/s':>11} {'vs torch':>9}"
    )
    for r in rows:
        gbps = f"{r['gbps']:.0f}" if r["gbps"] else "-"
        print(
            f"{r['op']:8} {r['shape']:12} {r['impl']:26} {r['mode']:6} {r['us']:10.1f} {gbps:>11} {r['speedup']:8.1f}x"
        )
    print(f"(decode state traffic against ~{HBM_GBPS:.0f} GB/s HBM; {time.time() - t0:.0f} s in all)")
    failed = [name for name, ok, _ in checks if not ok]
    print(f"checks: {len(checks) - len(failed)} passed, {len(failed)} failed {failed if failed else ''}")
    print(json.dumps(dict(bench="gated_delta_gpu", fla=fla_ok, checks_failed=failed, rows=rows)))


if __name__ == "__main__":
    main()
