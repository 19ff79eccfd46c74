"""How widely a MoE model's decode steps route on dummy weights, in either engine (bench/vllm_dummy.py
says why it matters: an expert GEMM reads the weights of the experts its tokens picked).

    PYTHONPATH=. python bench/routing_spread_gpu.py --engine ours --model qwen3-30b-a3b --quantization fp8
    VLLM_ENABLE_V1_MULTIPROCESSING=0 PYTHONPATH=.:$HOME/vsite/a:$HOME/vsite/b python bench/routing_spread_gpu.py \
        --engine vllm [--dummy-weights overnight] --model qwen3-30b-a3b --quantization fp8

Both engines eager (no CUDA graphs, so forward hooks run), greedy, the first --requests requests of
long-1024-1024 cut to --max-tokens outputs. Hooks on the routers of three layers (first, middle, last)
count the distinct experts each decode forward picks (top-k of the router's logits; a forward of
exactly --requests tokens is a decode step of the whole batch). Prints, per layer, the mean distinct
experts a decode step hit (of the model's num_experts; uniform routing of R tokens x k picks hits
nearly all), and the distinct output tokens across requests at a few output positions; one JSON line.
Session R (H200, Qwen3-30B-A3B FP8): ours 123-127 of 128 experts a step, vLLM 123 (its own draw) and
123-126 (drawn as ours), 64 distinct tokens at every position: both route as widely, over 256 tokens.
Session U's vLLM window (FP8, steps 300-330 of long-1024-1024) had its expert GEMMs at 2.6 ms a step,
which only a few experts' weights fit in: run with --max-tokens 1024 --requests 256 to see the late
steps (the last quarter's spread is printed apart).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, ".")

from bench.vllm_dummy import SCHEMES, install  # noqa: E402
from overnight.bench.workloads import WORKLOADS  # noqa: E402

POSITIONS = (0, 15, 63, 127, 255, 511, 1023)


def router_hooks(model, top_k: int, batch: int) -> dict[str, list[int]]:
    """Hooks on three routers (modules named *.mlp.gate); returns {layer name: distinct experts per
    decode forward}, filled as the model runs."""
    gates = [(n, m) for n, m in model.named_modules() if n.endswith("mlp.gate")]
    picked = [gates[0], gates[len(gates) // 2], gates[-1]] if gates else []
    seen: dict[str, list[int]] = {n: [] for n, _ in picked}

    def hook(name):
        def record(_module, _inputs, output):
            logits = output[0] if isinstance(output, tuple) else output
            if logits.shape[0] == batch:
                seen[name].append(int(logits.float().topk(top_k, dim=-1).indices.unique().numel()))

        return record

    for name, module in picked:
        module.register_forward_hook(hook(name))
    return seen


def mean_of(counts: list[int]) -> float | None:
    return round(sum(counts) / len(counts), 1) if counts else None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=("ours", "vllm"), required=True)
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--quantization", default=None, choices=["fp8"])
    ap.add_argument("--dummy-weights", default="vllm", choices=SCHEMES, help="vLLM's draw only")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=256)
    args = ap.parse_args()
    w = WORKLOADS["long-1024-1024"]
    if args.engine == "ours":
        from overnight import LLM, SamplingParams

        llm = LLM(args.model, load_format="dummy", quantization=args.quantization, enforce_eager=True)
        arch = llm.engine.config.model.arch
        seen = router_hooks(llm.engine.runner.model, arch.num_experts_per_tok, args.requests)
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0)
    else:
        from bench.vllm_throughput import model_arch, preset_folder, vllm_engine

        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
            print("set VLLM_ENABLE_V1_MULTIPROCESSING=0: the hooks run in this process")
            return 2
        if args.dummy_weights == "overnight":
            install()
        from vllm import SamplingParams as VParams  # type: ignore[import-not-found]

        folder = preset_folder(args.model)
        arch = model_arch(folder)
        extra: dict[str, object] = {"enforce_eager": True}
        if args.quantization:
            extra["quantization"] = args.quantization
        llm = vllm_engine(folder, **extra)
        holder: list[dict[str, list[int]]] = []
        llm.apply_model(lambda m: holder.append(router_hooks(m, arch.num_experts_per_tok, args.requests)))
        seen = holder[0]
        params = VParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=False)
    prompts = [{"prompt_token_ids": ids} for ids, _ in w.requests(arch.vocab_size)[: args.requests]]
    outs = llm.generate(prompts, params, use_tqdm=False)
    experts = arch.num_experts
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    distinct = {p: len({t[p] for t in tokens if len(t) > p}) for p in POSITIONS if p < args.max_tokens}
    spread = {name: mean_of(v) for name, v in seen.items()}
    # the last quarter of the decode steps alone: a batch whose outputs collapse late (every request
    # on the same tokens) routes narrowly only there, which the mean over all steps would hide
    late = {name: mean_of(v[-max(1, len(v) // 4) :]) for name, v in seen.items()}
    who = args.engine + (f" (dummy weights drawn as {args.dummy_weights})" if args.engine == "vllm" else "")
    print(f"{who}: {args.requests} requests, {args.model}, {args.quantization or 'bf16'}")
    for name, mean in spread.items():
        print(f"  {name}: {mean} of {experts} experts hit a decode step, {late[name]} in the last quarter "
              f"(steps seen: {len(seen[name])})")  # fmt: skip
    print(f"  distinct output tokens at positions {distinct}")
    record = {
        "bench": "routing_spread",
        "engine": args.engine,
        "dummy_weights": args.dummy_weights if args.engine == "vllm" else "overnight",
        "model": args.model,
        "quantization": args.quantization,
        "requests": args.requests,
        "experts": experts,
        "experts_hit_per_decode_step": spread,
        "experts_hit_last_quarter": late,
        "distinct_tokens_at": distinct,
    }
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
