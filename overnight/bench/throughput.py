"""`overnight bench throughput`: offline throughput on a fixed workload, with clocks and the roofline,
optionally beside transformers' static-batch generate on the same prompts in the same process."""

from __future__ import annotations

import gc
import json
import time
from dataclasses import asdict, dataclass

import torch

from overnight.bench.gpu_info import ClockSampler
from overnight.bench.roofline import estimate, loaded_weight_bytes
from overnight.bench.workloads import Workload, output_spread
from overnight.engine import kv_groups
from overnight.engine.interfaces import StepTimings
from overnight.kernels.jit_watch import watch_compiles
from overnight.options import EngineOptions


def process_age_s() -> float:
    """Seconds since this process started (start-up time is measured from here)."""
    try:
        import psutil

        return time.time() - psutil.Process().create_time()
    except Exception:
        return float("nan")


@dataclass
class RunResult:
    engine: str
    requests: int
    input_tokens: int
    output_tokens: int
    elapsed_s: float
    output_tok_s: float
    total_tok_s: float
    startup_s: float | None = None
    clocks: dict | None = None
    limit_fraction_overlapped: float | None = None
    limit_fraction_serial: float | None = None
    extra: dict | None = None
    images: int = 0  # an image workload's images (one per request)
    images_s: float | None = None


def run_ours(
    opts: EngineOptions, workload: Workload, warmup: bool = True, lora_requests: list | None = None
) -> tuple[RunResult, list[list[int]]]:
    """lora_requests: one LoRARequest (or None) per request of the workload (bench/lora.py).

    When this returns the engine is gone and its GPU memory is back with the driver: a second engine in
    the same process (--lora-adapters runs the base model, then the adapters) sizes its weights check and
    KV pool from the free memory. So the engine lives only inside _measure, and the collection and the
    allocator's release run after it has returned (inside it, its locals still held the engine)."""
    result, tokens = _measure(opts, workload, warmup, lora_requests)
    gc.collect()  # the engine's reference cycles (a step handle and its runner)
    release_gpu_cache()
    return result, tokens


def release_gpu_cache() -> None:
    """The allocator's cached blocks (a freed engine's pool, graphs and weights) back to the driver."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _measure(
    opts: EngineOptions, workload: Workload, warmup: bool, lora_requests: list | None
) -> tuple[RunResult, list[list[int]]]:
    from overnight import LLM, SamplingParams

    llm = LLM(**opts.__dict__)
    arch = llm.engine.config.model.arch
    # One tiny request first: the time to the first finished step is the start-up users feel.
    llm.generate([[101, 102, 103]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    startup = process_age_s()
    reqs = workload.prompts(arch)
    prompts = [p for p, _ in reqs]
    params = [SamplingParams(max_tokens=n_out, ignore_eos=True, temperature=0.0) for _, n_out in reqs]
    engine = llm.engine  # an Engine, or the data-parallel front: use what both have
    device = torch.device(engine.config.runner.device)
    device_index = device.index or 0
    if warmup and device.type == "cuda":
        # Warm every kernel shape class once (prefill tiles, mixed steps, the vision tower) outside
        # the timed run.
        warm_prompts = workload.warmup_prompts(arch)
        warm = (
            [lora_requests[i % len(lora_requests)] for i in range(len(warm_prompts))]
            if lora_requests
            else None
        )
        llm.generate(
            warm_prompts,
            [SamplingParams(max_tokens=4, ignore_eos=True)] * len(warm_prompts),
            use_tqdm=False,
            lora_request=warm,
        )
    if engine.timings is not None:
        engine.timings = StepTimings()  # the timed run's steps only
    with ClockSampler(device_index) as clocks, watch_compiles() as compiled:
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_requests)
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    # Prompt tokens as the engine ran them: an image's placeholder expanded to its tokens.
    lengths = [(len(o.prompt_token_ids), n) for o, (_, n) in zip(outs, reqs)]
    n_in = sum(n for n, _ in lengths)
    n_out = sum(len(t) for t in tokens)
    expected = sum(n for _, n in reqs)
    if n_out != expected:
        raise RuntimeError(f"generated {n_out} tokens, expected {expected}: lengths were not honoured")
    images = sum(1 for p in prompts if "multi_modal_data" in p)
    sched = engine.config.scheduler
    kv_dtype = engine.config.cache.kv_cache_dtype
    kv_elem = 1 if kv_dtype.startswith("fp8") else engine.config.model.dtype.itemsize
    pool_tokens = kv_groups.pool_tokens(engine.pool_plan.num_blocks, engine.kv.group_block_sizes)
    # The weights as loaded (FP8, int4) where this process holds the model; else bf16's count.
    model = getattr(engine.runner, "model", None)
    roof = estimate(
        arch,
        lengths,
        sched.max_num_seqs,
        kv_elem,
        weights=loaded_weight_bytes(model, arch) if isinstance(model, torch.nn.Module) else None,
        pool_tokens=pool_tokens,
    )
    # The roofline counts the decoder only: with images its fractions would leave the tower out.
    has_roof = device.type == "cuda" and not images
    result = RunResult(
        engine="overnight",
        requests=len(reqs),
        input_tokens=n_in,
        output_tokens=n_out,
        elapsed_s=round(elapsed, 3),
        output_tok_s=round(n_out / elapsed, 1),
        total_tok_s=round((n_in + n_out) / elapsed, 1),
        startup_s=round(startup, 1),
        clocks=clocks.samples.summary(),
        # The roofline's ceilings are an H200's: meaningless on a CPU.
        limit_fraction_overlapped=round(roof.t_overlapped / elapsed, 3) if has_roof else None,
        limit_fraction_serial=round(roof.t_serial / elapsed, 3) if has_roof else None,
        images=images,
        images_s=round(images / elapsed, 2) if images else None,
        extra={
            "model": engine.source.served_name,
            "max_num_seqs": sched.max_num_seqs,
            "max_num_batched_tokens": sched.max_num_batched_tokens,
            "kv_cache_dtype": kv_dtype,
            # hybrids' delta-rule state storage (float32 unless --mamba-ssm-cache-dtype says otherwise)
            "mamba_ssm_cache_dtype": engine.config.cache.mamba_ssm_cache_dtype,
            "quantization": engine.config.model.quantization,
            # Tokens of context the pool holds with every layer kind keeping all of them (each KV cache
            # group takes a block per block of its size: kv_groups.py); windows give back more past them.
            "kv_pool_tokens": pool_tokens,
            "steps": engine.num_steps,
            "preemptions": engine.stats().num_preemptions_total,
            "lora_swaps": engine.stats().lora_swaps_total,
            "roofline_s": [round(roof.t_compute, 2), round(roof.t_memory, 2)],
            "host_per_step": engine.timings.summary() if engine.timings is not None else None,
            # Triton variants compiled inside the timed run (each ~1 s of host time, the GPU idle).
            "jit_compiles": [c[:600] for c in compiled],
            # distinct tokens across requests at a few output positions (the work dummy weights do)
            "distinct_tokens": output_spread(tokens),
        },
    )
    return result, tokens


def run_transformers(
    opts: EngineOptions, workload: Workload, batch_size: int, max_requests: int | None = None
) -> RunResult:
    """transformers' generate with static batches (left padding), greedy, fixed lengths. Output
    tokens counted are the ones each request asked for (a static batch runs to its longest)."""
    from overnight.bench.hf_reference import build_hf_model
    from overnight.build import resolve_model
    from overnight.runner.device import pick_device

    device = pick_device(opts.device)
    source = resolve_model(opts).source
    model = build_hf_model(source, device, opts.load_format == "dummy")
    reqs = workload.requests(source.arch.vocab_size)
    if max_requests:
        reqs = reqs[:max_requests]
    pad = 0
    n_in = n_out = 0
    device_index = device.index or 0
    with ClockSampler(device_index) as clocks:
        start = time.perf_counter()
        for b in range(0, len(reqs), batch_size):
            chunk = reqs[b : b + batch_size]
            width = max(len(ids) for ids, _ in chunk)
            new = max(n for _, n in chunk)
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for i, (p, _) in enumerate(chunk):
                ids[i, width - len(p) :] = torch.tensor(p)
                mask[i, width - len(p) :] = 1
            with torch.inference_mode():
                model.generate(
                    input_ids=ids.to(device),
                    attention_mask=mask.to(device),
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=False,
                    pad_token_id=pad,
                )
            n_in += sum(len(p) for p, _ in chunk)
            n_out += sum(n for _, n in chunk)
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    del model
    gc.collect()
    return RunResult(
        engine=f"transformers generate (static batch {batch_size})",
        requests=len(reqs),
        input_tokens=n_in,
        output_tokens=n_out,
        elapsed_s=round(elapsed, 3),
        output_tok_s=round(n_out / elapsed, 1),
        total_tok_s=round((n_in + n_out) / elapsed, 1),
        clocks=clocks.samples.summary(),
    )


def print_table(workload: Workload, results: list[RunResult]) -> None:
    print(f"\nworkload {workload.name}: {workload.describe()}")
    with_images = any(r.images for r in results)
    img_head = f" {'images/s':>9}" if with_images else ""
    header = f"{'engine':<40} {'req':>5} {'out tok/s':>10}{img_head} {'total tok/s':>12} {'elapsed s':>10} {'start-up s':>10} {'SM MHz':>7} {'limit frac':>11}"
    print(header)
    print("-" * len(header))
    for r in results:
        sm = r.clocks.get("sm_clock_mhz_median", "n/a") if r.clocks else "n/a"
        frac = f"{r.limit_fraction_overlapped:.2f}" if r.limit_fraction_overlapped is not None else "-"
        start = f"{r.startup_s:.1f}" if r.startup_s is not None else "-"
        img = f" {r.images_s if r.images_s is not None else '-':>9}" if with_images else ""
        print(
            f"{r.engine:<40} {r.requests:>5} {r.output_tok_s:>10.1f}{img} {r.total_tok_s:>12.1f} "
            f"{r.elapsed_s:>10.2f} {start:>10} {sm!s:>7} {frac:>11}"
        )
    if len(results) > 1:
        print(
            f"ratio output tok/s, overnight / {results[1].engine}: "
            f"{results[0].output_tok_s / results[1].output_tok_s:.2f}x"
        )


def to_json(workload: Workload, results: list[RunResult]) -> str:
    return json.dumps({"workload": asdict(workload), "results": [asdict(r) for r in results]})
