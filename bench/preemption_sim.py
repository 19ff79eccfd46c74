"""The scheduler alone on a synthetic offline workload: preemptions, tokens computed and a step-time proxy.

No runner: each step's sampled token is a constant (or EOS at a chosen output length), so it runs a
1,024-request workload in seconds on the CPU. The proxy prices a step on an H200 with a 24B bf16 model:
    t = max(A, B * tokens) + C * context
A = 10 ms (48 GB of weights read at ~4.8 TB/s: the decode floor), B = 80 us/token (48 GFLOP a token at
~600 TFLOP/s achieved), C = 33 ns per context token attended (160 KB of KV a token, Mistral-Small-24B:
40 layers x 8 KV heads x 128 x 2 x bf16, at ~4.8 TB/s).

    python bench/preemption_sim.py --pool-tokens 508000                 # mistral-small-24b on an H200
    python bench/preemption_sim.py --pool-tokens 1000000                # a Qwen3-8B-like pool
    python bench/preemption_sim.py --pool-tokens 508000 --eos-at 0.3    # outputs end early
    python bench/preemption_sim.py --pool-tokens 132800 --windowed-groups 6  # gemma-3-27b on an H200
    # Qwen3-30B-A3B, FP8, long-1024-1024 on an H100's pool; its step times (16 ms a step with the host's
    # share, 11 us a token computed, 29 ns a token attended); its admission (engine/admission.py's
    # tail_share and step_tokens, from the preset: --model sets both)
    python bench/preemption_sim.py --requests 512 --prompt-len 1024 --max-tokens 1024 --pool-tokens 456176 \
        --step-ms 16 --token-us 11 --context-ns 29 --model qwen3-30b-a3b
The result's "decode_bands" give, per band of 64 requests, the decode-only steps and the mean context
they attend (the tokens a step's attention reads). With --greedy and vLLM's pool the replay is vLLM's
schedule: on Qwen3-30B-A3B FP8's H100 pool (433,872 tokens) its band counts match vLLM's own timeline
within 2 steps a band (docs/performance.md, session R), so it gives the context vLLM's steps attend.
"""

from __future__ import annotations

import argparse
import json
import random
from typing import Any

from overnight.config import DENSE_STEP_TOKENS, DENSE_TAIL_SHARE, SchedulerConfig
from overnight.engine.kv_cache_manager import KVCacheManager
from overnight.engine.request import Request
from overnight.engine.scheduler import Scheduler
from overnight.engine.step_io import ModelRunnerOutput
from overnight.sampling_params import SamplingParams

A, B, C = 10e-3, 80e-6, 33e-9
EOS, TOKEN = 2, 7


def simulate(
    num_requests: int = 1024,
    prompt_len: int = 512,
    max_tokens: int = 256,
    pool_tokens: int = 508_000,
    block_size: int = 16,
    max_num_seqs: int = 1024,
    max_num_batched_tokens: int = 16384,
    eos_at: float | None = None,
    seed: int = 0,
    planned: bool = True,
    windowed_groups: int = 0,
    window: int = 1024,
    tail_share: float = DENSE_TAIL_SHARE,
    step_tokens: float = DENSE_STEP_TOKENS,
    step_times: tuple[float, float, float] = (A, B, C),
) -> dict[str, Any]:
    """pool_tokens is per sequence-equivalent: with windowed_groups, the pool holds one full-attention
    group and that many groups of `window` (Gemma 3 27B: 6 of 1,024), each a block per block_size tokens.
    eos_at None: ignore_eos (every request runs to max_tokens); else each request emits EOS after
    uniform(1, 2 * eos_at * max_tokens) tokens (mean eos_at * max_tokens), capped by max_tokens.
    step_times: the proxy's (A, B, C) in seconds."""
    a, b, c = step_times
    rng = random.Random(seed)
    config = SchedulerConfig(
        max_num_seqs,
        max_num_batched_tokens,
        prompt_len + max_tokens,
        True,
        "planned" if planned else "greedy",
        tail_share,
        step_tokens,
    )
    windows = (None,) + (window,) * windowed_groups
    num_blocks = pool_tokens // block_size * len(windows)
    sched = Scheduler(config, KVCacheManager(num_blocks, block_size, enable_caching=True, windows=windows))
    ends: dict[str, int] = {}
    for i in range(num_requests):
        prompt = [rng.randrange(10, 30000) for _ in range(prompt_len)]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=eos_at is None, detokenize=False)
        rid = str(i)
        sched.add(Request(rid, prompt, params, 0, frozenset({EOS}), prompt_len + max_tokens, 0.0))
        if eos_at is not None:
            ends[rid] = rng.randint(1, max(1, int(2 * eos_at * max_tokens)))
    steps = tokens = 0
    proxy = running = 0.0
    bands: dict[int, list[int]] = {}  # decode-only steps by 64 requests: (steps, context summed)
    while sched.has_unfinished:
        out = sched.schedule()
        n = out.total_num_scheduled_tokens
        assert n > 0, "the scheduler made no progress"
        context = sum(sched.requests[r].num_computed_tokens for r in out.num_scheduled_tokens)
        if n == len(out.num_scheduled_tokens):
            band = bands.setdefault(n // 64 * 64, [0, 0])
            band[0] += 1
            band[1] += context
        proxy += max(a, b * n) + c * context
        steps += 1
        tokens += n
        running += len(sched.running)
        ids = [r.req_id for r in sched.running if r.num_pending]
        toks = [
            EOS if ends.get(r, 1 << 30) <= sched.requests[r].num_output_tokens + 1 else TOKEN for r in ids
        ]
        sched.update(out, ModelRunnerOutput(req_ids=ids, sampled_token_ids=toks))
    work = num_requests * (prompt_len + max_tokens - 1) if eos_at is None else None
    return {
        "preemptions": sched.num_preemptions_total,
        "steps": steps,
        "tokens": tokens,
        "min_tokens": work if work is not None else -1,
        "mean_running": round(running / steps, 1),
        "proxy_s": round(proxy, 2),
        "decode_bands": {
            f"{lo}-{lo + 63}": {"steps": k, "mean_context": round(ctx / k)}
            for lo, (k, ctx) in sorted(bands.items())
        },
    }


def admission_of(model: str | None) -> tuple[float, float]:
    """(tail share, step tokens) the engine plans with for a preset (engine/admission.py), a dense
    model's without one."""
    if model is None:
        return DENSE_TAIL_SHARE, DENSE_STEP_TOKENS
    from overnight.engine.admission import step_tokens, tail_share
    from overnight.loader.resolve import resolve_source

    arch = resolve_source(model, load_format="dummy").arch
    return tail_share(arch), step_tokens(arch)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=1024)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--pool-tokens", type=int, default=508_000)
    p.add_argument("--max-num-seqs", type=int, default=1024)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--eos-at", type=float, default=None)
    p.add_argument(
        "--windowed-groups", type=int, default=0, help="Gemma 3 27B: 6 (with --pool-tokens 132800)"
    )
    p.add_argument(
        "--greedy", action="store_true", help="admission greedy: start whatever fits now (the old rule)"
    )
    p.add_argument(
        "--tail-share", type=float, default=None, help="engine/admission.py tail_share (default: --model's)"
    )
    p.add_argument(
        "--step-tokens", type=float, default=None, help="engine/admission.py step_tokens (default: --model's)"
    )
    p.add_argument(
        "--model", default=None, help="a preset whose admission to replay (default: a dense model's)"
    )
    p.add_argument("--step-ms", type=float, default=A * 1e3, help="A: a step's floor (weights read)")
    p.add_argument("--token-us", type=float, default=B * 1e6, help="B: a token computed")
    p.add_argument("--context-ns", type=float, default=C * 1e9, help="C: a context token attended")
    a = p.parse_args()
    tail, step = admission_of(a.model)
    r = simulate(
        a.requests,
        a.prompt_len,
        a.max_tokens,
        a.pool_tokens,
        16,
        a.max_num_seqs,
        a.max_num_batched_tokens,
        a.eos_at,
        planned=not a.greedy,
        windowed_groups=a.windowed_groups,
        tail_share=tail if a.tail_share is None else a.tail_share,
        step_tokens=step if a.step_tokens is None else a.step_tokens,
        step_times=(a.step_ms * 1e-3, a.token_us * 1e-6, a.context_ns * 1e-9),
    )
    print(json.dumps(r))


if __name__ == "__main__":
    main()
