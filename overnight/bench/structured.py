"""`overnight bench throughput --json-schema FILE`: constrained against unconstrained generation, one
engine, one run, the same prompts and the same number of output tokens per request.

    probe         constrained, untimed: compiles the grammar, warms up, and records how many tokens each
                  request produces before its grammar (or max_tokens) ends it
    unconstrained greedy, ignore_eos, max_tokens = the probe's length of each request
    constrained   greedy, one JSON schema on every request (timed)

So both timed runs generate the same tokens in the same batch shapes, and the difference is the cost of
structured outputs: the host's mask work (advancing matchers, filling the bitmask) and the device's
masking. Token counts are reported as generated, never assumed. Without the probe (probe=False, for a
model whose outputs never end early, e.g. random weights) the unconstrained run uses max_tokens.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from overnight.bench.gpu_info import ClockSampler


@dataclass
class VariantResult:
    name: str
    requests: int
    output_tokens: int
    ended_early: int  # requests that produced fewer tokens than max_tokens allowed
    elapsed_s: float
    output_tok_s: float
    clocks: dict
    host_per_step: dict  # engine.timings.summary(): schedule/launch/wait/update/mask_wait/mask (ms)


def run_variant(
    llm, name: str, prompts: list[list[int]], params: list, max_tokens: list[int]
) -> tuple[VariantResult, list[int]]:
    """One timed generate; the result and each request's output length."""
    engine = llm.engine
    device = torch.device(engine.config.runner.device)
    from overnight.engine.engine import StepTimings

    timed = isinstance(getattr(engine, "timings", None), StepTimings)  # one engine (not data parallel)
    # Every timed run starts from a cold prefix cache: the variants run the same prompts one after the
    # other, and a run whose prompts the previous one left cached would skip its prefill.
    kv = getattr(engine, "kv", None)
    if kv is not None:
        kv.pool.reset_prefix_cache()
    if timed:
        engine.timings = StepTimings()
    with ClockSampler(device.index or 0) as clocks:
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    n_out = sum(lengths)
    return VariantResult(
        name=name,
        requests=len(prompts),
        output_tokens=n_out,
        ended_early=sum(n < m for n, m in zip(lengths, max_tokens)),
        elapsed_s=round(elapsed, 3),
        output_tok_s=round(n_out / elapsed, 1),
        clocks=clocks.samples.summary(),
        host_per_step=engine.timings.summary() if timed else StepTimings().summary(),
    ), lengths


def compare(
    llm, reqs: list[tuple[list[int], int]], schema: dict[str, Any], probe: bool = True, repeats: int = 1
) -> tuple[list[VariantResult], dict[str, Any]]:
    """Timed results of both variants (`repeats` pairs, the order alternating from pair to pair, so a
    machine that slows down or speeds up does not favour one) and a summary: the overhead from each
    variant's median tok/s, and whether every constrained run generated the probe's lengths."""
    from overnight import SamplingParams, StructuredOutputsParams

    prompts = [ids for ids, _ in reqs]
    caps = [n for _, n in reqs]
    so = StructuredOutputsParams(json=schema)
    bound_params = [SamplingParams(max_tokens=n, temperature=0.0, structured_outputs=so) for n in caps]

    # Warm every path once outside the timed runs (kernels, the grammar compile, CUDA graphs).
    warm = min(8, len(prompts))
    llm.generate(
        [{"prompt_token_ids": p} for p in prompts[:warm]],
        [SamplingParams(max_tokens=4, temperature=0.0, structured_outputs=so)] * warm,
        use_tqdm=False,
    )
    lengths = caps
    if probe:
        probed = llm.generate([{"prompt_token_ids": p} for p in prompts], bound_params, use_tqdm=False)
        lengths = [len(o.outputs[0].token_ids) for o in probed]
    plain = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for n in lengths]
    results: list[VariantResult] = []
    same_lengths = True
    for r in range(repeats):
        pair = [("unconstrained", plain, lengths), ("json schema", bound_params, caps)]
        for name, params, caps_ in pair if r % 2 == 0 else pair[::-1]:
            label = name if repeats == 1 else f"{name} #{r + 1}"
            result, got = run_variant(llm, label, prompts, params, caps_)
            results.append(result)
            if name == "json schema" and probe:
                same_lengths &= got == lengths

    def median(prefix: str) -> float:
        return statistics.median(x.output_tok_s for x in results if x.name.startswith(prefix))

    summary = {
        "overhead_pct": round(100.0 * (median("unconstrained") / median("json schema") - 1.0), 2),
        "median_out_tok_s": {"unconstrained": median("unconstrained"), "json schema": median("json schema")},
        "same_lengths_as_probe": same_lengths if probe else None,
        "schema": schema,
    }
    return results, summary


def print_table(results: list[VariantResult], summary: dict[str, Any]) -> None:
    header = (
        f"{'variant':<14} {'req':>5} {'out tok':>8} {'early':>6} {'elapsed s':>10} {'out tok/s':>10} "
        f"{'SM MHz':>7} | per step ms: {'sched':>6} {'launch':>7} {'(mask wait':>10} {'mask)':>6} "
        f"{'wait':>6} {'update':>7}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        h = r.host_per_step
        sm = r.clocks.get("sm_clock_mhz_median", "n/a")
        print(
            f"{r.name:<14} {r.requests:>5} {r.output_tokens:>8} {r.ended_early:>6} {r.elapsed_s:>10.2f} "
            f"{r.output_tok_s:>10.1f} {sm!s:>7} | {'':12} {h['schedule_ms']:>6.2f} {h['launch_ms']:>7.2f} "
            f"{h['mask_wait_ms']:>10.2f} {h['mask_ms']:>6.2f} {h['wait_ms']:>6.2f} {h['update_ms']:>7.2f}"
        )
    print(
        "structured-output overhead (unconstrained / constrained median tok/s - 1): "
        f"{summary['overhead_pct']:.2f}%"
    )


def to_json(workload, results: list[VariantResult], summary: dict[str, Any]) -> str:
    return json.dumps(
        {"workload": asdict(workload), "results": [asdict(r) for r in results], "structured": summary}
    )


def run(
    opts, workload, schema_path: str, probe: bool = True, repeats: int = 1
) -> tuple[list[VariantResult], dict[str, Any]]:
    """The CLI's entry: an engine from opts, the workload's prompts and lengths, the schema file."""
    from overnight import LLM

    try:
        with open(schema_path) as f:
            schema = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"overnight bench: cannot read the JSON schema {schema_path}: {e}") from None
    llm = LLM(**opts.__dict__)
    reqs = workload.requests(llm.engine.config.model.arch.vocab_size)
    return compare(llm, reqs, schema, probe=probe, repeats=repeats)
