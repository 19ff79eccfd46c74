"""Do vLLM's dummy weights make a mixture of experts route narrower than ours? A check on the CPU, on a
reduced Qwen3-MoE in transformers (no vLLM needed).

    python bench/dummy_routing_cpu.py [--vocab 16384 --hidden 1024 --layers 4 --requests 64 --tokens 128]

Why: on the H100's MoE FP8 row vLLM's decode steps take less time than reading every expert's bytes
and its context's KV at its kernels' isolated rates allows (docs/performance.md, session AC), so either
its graphs run faster than its kernels alone or its steps read fewer experts. A step reads the experts
its tokens pick, and each engine's dummy model is its own random draw:
- vLLM 0.26 seeds every tensor's draw with one seed (1234), so tensors of one shape hold the same
  values (the embedding equals the LM head, every layer's router is the same), and draws its norm
  weights uniform(-1e-3, 1e-3) like the rest;
- ours (overnight/loader/dummy.py, bench/vllm_dummy.py) draws each tensor from its own seed and sets
  norm weights to 1.
This draws the reduced model both ways, decodes greedily (random prompts of 64 tokens), counts the
distinct experts the routers of the first and last layer pick at each decode step of all the requests,
and the distinct tokens the requests emit at a few positions. It prints one line a scheme. The GPU
check of the real model is bench/routing_spread_gpu.py; the pairs' JSON lines carry distinct_tokens.
"""

from __future__ import annotations

import argparse

import torch

PROMPT = 64
DUMMY_RANGE = 1e-3


def draw(model: torch.nn.Module, scheme: str) -> None:
    """The model's weights as vLLM ("vllm") or we ("overnight") draw dummy weights (module docstring)."""
    seeds = iter(range(1, 1 << 30))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if scheme == "overnight" and name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            seed = 1234 if scheme == "vllm" else next(seeds)
            p.uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=torch.Generator().manual_seed(seed))


def spread(args: argparse.Namespace, scheme: str) -> dict[str, object]:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        moe_intermediate_size=args.hidden // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        tie_word_embeddings=False,
        max_position_embeddings=PROMPT + args.tokens + 8,
    )
    model = Qwen3MoeForCausalLM(cfg).eval()
    draw(model, scheme)
    gates = [(n, m) for n, m in model.named_modules() if n.endswith("mlp.gate")]
    hits: dict[str, list[int]] = {}

    def hook(name: str):
        def count(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], _out: object) -> None:
            x = inputs[0].reshape(-1, inputs[0].shape[-1])
            if x.shape[0] == args.requests:  # a decode step of every request
                top = torch.nn.functional.linear(x, module.weight).topk(cfg.num_experts_per_tok, dim=-1)
                hits.setdefault(name, []).append(int(top.indices.unique().numel()))

        return count

    for name, module in (gates[0], gates[-1]):
        module.register_forward_hook(hook(name))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(100, args.vocab - 100, (args.requests, PROMPT), generator=gen)
    with torch.no_grad():
        out = model.generate(
            ids,
            max_new_tokens=args.tokens,
            min_new_tokens=args.tokens,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    new = out[:, PROMPT:]
    positions = sorted({0, 1, 2, args.tokens // 2, args.tokens - 1})
    period_two = bool((new[:, 2:] == new[:, :-2]).all()) if args.tokens > 2 else False
    return {
        "scheme": scheme,
        "embedding_is_lm_head": torch.equal(model.model.embed_tokens.weight, model.lm_head.weight),
        "distinct_tokens": {p: len(set(new[:, p].tolist())) for p in positions},
        "every_request_two_token_cycle": period_two,
        "experts_hit_per_step": {n: (min(h), round(sum(h) / len(h), 1), max(h)) for n, h in hits.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    for scheme in ("vllm", "overnight"):
        print(spread(args, scheme), flush=True)


if __name__ == "__main__":
    main()
