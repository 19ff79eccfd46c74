"""GPU correctness of the whole engine in bf16 (run on the H200: PYTHONPATH=. python bench/correctness_gpu.py).

1. Random-weight Qwen3-0.6B (exact architecture, weights spread so logits are well separated) served by
   our engine vs transformers generate: until the first divergence each side's token must be in the
   other's top-5; report how many prompts are identical for the first 32 tokens.
2. Greedy outputs identical between the CUDA-graph path and the eager path.
"""

from __future__ import annotations

import gc
import json
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, ".")

from overnight import LLM, SamplingParams  # noqa: E402
from overnight.bench.hf_reference import hf_config  # noqa: E402
from overnight.loader.resolve import resolve_source  # noqa: E402

NUM_PROMPTS = 32
NEW_TOKENS = 32
TOP = 5


def spread_(model: torch.nn.Module, seed: int = 0) -> None:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                v = 1.0 + 0.2 * (torch.rand(p.shape, generator=gen) - 0.5)
            elif "embed_tokens" in name or "lm_head" in name:
                v = torch.randn(p.shape, generator=gen)
            else:
                v = torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5
            p.copy_(v.to(p.dtype))


def main() -> int:
    import transformers

    t0 = time.time()
    source = resolve_source("qwen3-0.6b", "dummy")
    config = hf_config(source.arch, source.hf_architecture)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    spread_(model)
    folder = tempfile.mkdtemp()
    model.to(torch.bfloat16).save_pretrained(folder)
    model = model.to(torch.bfloat16).cuda().eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 150000) for _ in range(rng.randint(8, 200))] for _ in range(NUM_PROMPTS)]

    # transformers, one prompt at a time (no padding), greedy with per-step scores.
    ref_tokens, ref_top = [], []
    for p in prompts:
        out = model.generate(
            torch.tensor([p], device="cuda"),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        ref_tokens.append(out.sequences[0, len(p) :].tolist())
        ref_top.append([s[0].float().log_softmax(-1).topk(TOP).indices.tolist() for s in out.scores])
    del model
    gc.collect()
    torch.cuda.empty_cache()

    results = {}
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=TOP)
    for mode, eager in (("graphs", False), ("eager", True)):
        llm = LLM(
            folder,
            skip_tokenizer_init=True,
            dtype="bfloat16",
            gpu_memory_utilization=0.35,
            enforce_eager=eager,
            max_model_len=1024,
        )
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results[mode] = outs
        del llm
        gc.collect()
        torch.cuda.empty_cache()

    close = identical = 0
    first_div = []
    for i, out in enumerate(results["graphs"]):
        ours = out.outputs[0].token_ids
        our_top = [list(d.keys()) for d in out.outputs[0].logprobs]
        ok = True
        div = NEW_TOKENS
        for t in range(NEW_TOKENS):
            if ours[t] != ref_tokens[i][t]:
                div = t
                ok = ours[t] in ref_top[i][t] and ref_tokens[i][t] in our_top[t]
                break
        first_div.append(div)
        close += ok
        identical += div == NEW_TOKENS
    same_graph_eager = sum(
        a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(results["graphs"], results["eager"])
    )
    summary = {
        "prompts": NUM_PROMPTS,
        "logprob_close": close,
        "identical_32_tokens": identical,
        "first_divergence": first_div,
        "graphs_equal_eager": same_graph_eager,
        "seconds": round(time.time() - t0, 1),
    }
    print("CORRECTNESS", json.dumps(summary))
    ok = close == NUM_PROMPTS and identical >= NUM_PROMPTS // 2 and same_graph_eager == NUM_PROMPTS
    print("CORRECTNESS", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
