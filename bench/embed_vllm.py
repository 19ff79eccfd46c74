"""vLLM's embedding throughput on the same prompts as bench/embed_gpu.py (docs/performance.md). Needs
vLLM in the environment; run both in one session on one GPU:
    PYTHONPATH=. python bench/embed_vllm.py [qwen3-0.6b]
    PYTHONPATH=. python bench/embed_gpu.py --throughput-only
vLLM 0.26: LLM(model=<the preset's config folder>, runner="pooling", load_format="dummy", bf16, a synthetic
tokenizer of the model's vocabulary, defaults otherwise) and one LLM.embed call over each workload's
token-id prompts after a warm-up: the decoder turned into an embedding model with last-token pooling and
normalization, the work our LLM("qwen3-0.6b", runner="pooling").encode does. Prints a table and one JSON
line (bench "embed_vllm").
"""

from __future__ import annotations

import json
import sys
import time

sys.path.insert(0, ".")

from bench.embed_gpu import WORKLOADS, rate_record, token_prompts  # noqa: E402
from bench.vllm_throughput import preset_folder, vocab_size  # noqa: E402
from overnight.bench.gpu_info import ClockSampler, sm_clock_now  # noqa: E402


def main() -> int:
    # vLLM's pooling entry point needs a tokenizer even for token-id prompts: the config folder is
    # copied beside a synthetic tokenizer of the model's vocabulary (the ids are all that is used).
    from vllm import LLM  # type: ignore[import-not-found]

    from overnight.tokenizer.synthetic import save_synthetic_tokenizer_folder

    config = preset_folder(sys.argv[1] if len(sys.argv) > 1 else "qwen3-0.6b")
    save_synthetic_tokenizer_folder(config, vocab_size(config))
    t0 = time.perf_counter()
    llm = LLM(
        model=config,
        runner="pooling",
        load_format="dummy",
        dtype="bfloat16",
        seed=0,
        max_model_len=4096,
        gpu_memory_utilization=0.6,
    )
    init_s = time.perf_counter() - t0
    print(f"vLLM up in {init_s:.1f} s, SM clock now {sm_clock_now()}", flush=True)
    warm = [{"prompt_token_ids": p} for p in token_prompts(512, 16, 512, seed=99)]
    llm.embed(warm, use_tqdm=False)
    results: dict[str, object] = {"init_s": round(init_s, 1)}
    for name, (n, lo, hi) in WORKLOADS.items():
        prompts = [{"prompt_token_ids": p} for p in token_prompts(n, lo, hi)]
        tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
        with ClockSampler() as clocks:
            t0 = time.perf_counter()
            outs = llm.embed(prompts, use_tqdm=False)
            seconds = time.perf_counter() - t0
        assert len(outs) == n and len(outs[0].outputs.embedding) > 0
        results[name] = rate_record(n, tokens, seconds, clocks)
        clock = clocks.samples.summary()
        print(
            f"vllm {name:<16}{n:>8}{tokens:>11}{seconds:>9.2f}{tokens / seconds:>10.0f}"
            f"  {clock['sm_clock_mhz_median']} / {clock['sm_clock_mhz_min']} MHz",
            flush=True,
        )
    print(json.dumps({"bench": "embed_vllm", **results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
