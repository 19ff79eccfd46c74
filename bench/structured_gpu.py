"""Structured outputs on the GPU: correctness first, then the cost (run on the H200 from the repo root).

    PYTHONPATH=. python bench/structured_gpu.py [--num-prompts N]      (about 2-3 minutes)

Needs xgrammar (not in the GPU image): pip install --no-deps the two cp312 wheels
xgrammar-0.2.9-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl and
apache_tvm_ffi-0.1.15.post2-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl.

Model: Qwen3-8B dummy weights (bf16) with a synthetic byte-level BPE tokenizer of the model's 151936 ids
(overnight/tokenizer/synthetic.py; <|endoftext|>, <|im_start|>, <|im_end|> at Qwen's ids, EOS 151645).

1. Correctness.
   a. The token-mask Triton kernel against its PyTorch reference: 1024 rows x 151936, a random bitmask on
      700 of the rows, bf16 / fp16 / fp32: outputs must be identical.
   b. The engine: 32 requests under a small bounded schema (enum, boolean, bounded integer), greedy and
      seeded: every output must parse, satisfy the schema, and replay through a fresh grammar matcher
      token by token, ending in EOS (finish_reason "stop").
2. Cost.
   a. The mask kernel at 1024 rows: median time (triton do_bench) against the reference's.
   b. seed-512-256 (1024 prompts of 512 random ids, 256 output tokens, greedy), one engine, one run:
      unconstrained (ignore_eos) against one JSON schema on every request whose last field is an
      unbounded string, so random weights do not end it early (requests that do end early are counted;
      tok/s counts the tokens generated). Output tok/s, SM clock, and the host's time per step:
      schedule / launch (of which: waiting for the previous step's tokens, building the mask) / wait /
      update. Target: overhead <= 10%, goal <= 3%.
Prints the checks, a table, then one line of JSON.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import os
import sys
import tempfile
import time
import traceback

import torch

sys.path.insert(0, ".")

from overnight.bench.gpu_info import sm_clock_now  # noqa: E402

VOCAB = 151936
SPECIALS = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"}
EOS = 151645
SMALL_SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["alpha", "beta", "gamma"]},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["kind", "ok", "n"],
}
BENCH_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999999},
        "label": {"enum": ["alpha", "beta", "gamma"]},
        "text": {"type": "string"},
    },
    "required": ["id", "label", "text"],
}

checks: list[tuple[str, bool, str]] = []
report: dict = {"sm_clock_start": sm_clock_now()}


def check(name: str, ok: bool, detail: str = "") -> None:
    checks.append((name, ok, detail))
    print(f"[{'PASS' if ok else 'FAIL'}] {name} {detail}", flush=True)


def section(name: str):
    """Run one part; a failure is reported and the script goes on to the next part."""

    def wrap(fn):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - reported, then the next section runs
                traceback.print_exc()
                check(name, False, f"raised {type(e).__name__}: {e}")
                return None
            finally:
                print(f"-- {name}: {time.perf_counter() - t0:.1f} s", flush=True)

        return run

    return wrap


@section("kernel")
def kernel_checks_and_timing() -> None:
    import triton.testing

    from overnight.kernels.token_bitmask import apply_token_bitmask_kernel_, apply_token_bitmask_ref

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    words = -(-VOCAB // 32)
    rows = torch.randperm(1024, generator=gen, device=dev)[:700]
    bitmask = torch.randint(-(2**31), 2**31 - 1, (700, words), generator=gen, device=dev, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        logits = torch.randn(1024, VOCAB, generator=gen, device=dev).to(dtype)
        a, b = logits.clone(), logits.clone()
        apply_token_bitmask_kernel_(a, bitmask, rows)
        apply_token_bitmask_ref(b, bitmask, rows)
        check(f"kernel == reference ({dtype})", torch.equal(a, b))
    logits = torch.randn(1024, VOCAB, generator=gen, device=dev).to(torch.bfloat16)
    all_rows = torch.arange(1024, device=dev)
    full = torch.randint(-(2**31), 2**31 - 1, (1024, words), generator=gen, device=dev, dtype=torch.int64)
    full = full.to(torch.int32)
    t_kernel = triton.testing.do_bench(lambda: apply_token_bitmask_kernel_(logits, full, all_rows))
    t_ref = triton.testing.do_bench(lambda: apply_token_bitmask_ref(logits, full, all_rows))
    moved = logits.numel() * 2 + full.numel() * 4  # read every logit row once (store only where masked)
    report["kernel_ms"] = {"triton": round(t_kernel, 4), "torch_reference": round(t_ref, 4)}
    print(
        f"mask 1024 x {VOCAB} bf16: triton {t_kernel * 1e3:.1f} us ({moved / t_kernel / 1e6:.0f} GB/s), "
        f"torch reference {t_ref * 1e3:.1f} us",
        flush=True,
    )


def build_llm(tokenizer_dir: str):
    from overnight import LLM

    return LLM(model="qwen3-8b", load_format="dummy", tokenizer=tokenizer_dir, dtype="bfloat16", seed=0)


@section("engine correctness")
def engine_checks(llm) -> None:
    import xgrammar as xgr

    from overnight import SamplingParams, StructuredOutputsParams

    so = StructuredOutputsParams(json=SMALL_SCHEMA)
    prompts = [{"prompt_token_ids": [100 + 7 * i + j for j in range(40)]} for i in range(32)]
    params = [
        SamplingParams(max_tokens=64, temperature=0.0 if i % 2 else 0.9, seed=i, structured_outputs=so)
        for i in range(32)
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    compiled = llm.engine.grammars.compile(so)
    bad = []
    for i, o in enumerate(outs):
        c = o.outputs[0]
        try:
            v = json.loads(c.text)
            assert v["kind"] in ("alpha", "beta", "gamma") and isinstance(v["ok"], bool)
            assert isinstance(v["n"], int) and 0 <= v["n"] <= 999 and set(v) == {"kind", "ok", "n"}
            assert c.finish_reason == "stop" and c.token_ids[-1] == EOS
            m = xgr.GrammarMatcher(compiled)
            assert all(m.accept_token(t) for t in c.token_ids) and m.is_terminated()
        except Exception as e:  # noqa: BLE001
            bad.append(f"request {i}: {type(e).__name__} {e} text={c.text!r}")
    check("32 structured outputs parse, validate, replay and end in EOS", not bad, "; ".join(bad[:3]))
    report["engine_sample_outputs"] = [o.outputs[0].text for o in outs[:4]]


@section("throughput")
def throughput(llm, num_prompts: int, repeats: int):
    from overnight.bench import structured
    from overnight.bench.workloads import WORKLOADS, Workload

    w = WORKLOADS["seed-512-256"]
    w = Workload(w.name, w.model, num_prompts, w.input_len, w.output_len)
    reqs = w.requests(VOCAB)
    results, summary = structured.compare(llm, reqs, BENCH_SCHEMA, probe=False, repeats=repeats)
    report["workload"] = w.__dict__
    report["results"] = [r.__dict__ for r in results]
    report["structured"] = summary
    return results, summary


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=1, help="timed (unconstrained, constrained) pairs")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    try:
        import xgrammar  # noqa: F401  (only whether it imports)
    except ImportError as e:
        print(
            f"xgrammar is not installed ({e}). Install the cp312 wheels with: pip install --no-deps "
            "xgrammar-0.2.9-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl "
            "apache_tvm_ffi-0.1.15.post2-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl",
            file=sys.stderr,
        )
        return 2
    report["xgrammar"] = importlib.metadata.version("xgrammar")
    report["gpu"] = torch.cuda.get_device_name()
    print(
        f"GPU {report['gpu']}, SM clock {report['sm_clock_start']}, xgrammar {report['xgrammar']}",
        flush=True,
    )
    kernel_checks_and_timing()
    gc.collect()
    torch.cuda.empty_cache()  # the engine sizes its KV pool from the memory left
    from overnight.tokenizer.synthetic import save_synthetic_tokenizer_folder

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        folder = save_synthetic_tokenizer_folder(os.path.join(tmp, "tok"), VOCAB, SPECIALS, "<|im_end|>")
        print(f"synthetic tokenizer: {time.perf_counter() - t0:.1f} s", flush=True)
        t0 = time.perf_counter()
        llm = section("engine start")(build_llm)(folder)
        print(f"engine start: {time.perf_counter() - t0:.1f} s", flush=True)
        measured = None
        if llm is not None:
            engine_checks(llm)
            measured = throughput(llm, args.num_prompts, args.repeats)
    report["sm_clock_end"] = sm_clock_now()
    report["checks"] = [{"name": n, "ok": ok, "detail": d} for n, ok, d in checks]
    print("\nchecks: " + ", ".join(f"{n}: {'PASS' if ok else 'FAIL'}" for n, ok, _ in checks))
    if "kernel_ms" in report:
        k = report["kernel_ms"]
        print(
            f"mask kernel, 1024 x {VOCAB} bf16: triton {k['triton']} ms, torch reference {k['torch_reference']} ms"
        )
    if measured is not None:
        from overnight.bench import structured

        print(
            f"\nseed-512-256, {args.num_prompts} prompts, Qwen3-8B dummy bf16, SM clock {report['sm_clock_end']}"
        )
        structured.print_table(*measured)
    print(json.dumps(report, default=str))
    return 0 if all(ok for _, ok, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
