"""`overnight generate PROMPT...`: a quick look at a model (chat-templated by default)."""

from __future__ import annotations

import argparse

from overnight.options import add_engine_args, options_from_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate from prompts given on the command line")
    p.add_argument("prompts", nargs="+")
    p.add_argument("--raw", action="store_true", help="send prompts as plain text, not as chat messages")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    add_engine_args(p)


def run(args: argparse.Namespace) -> int:
    from overnight import LLM, SamplingParams

    llm = LLM(**options_from_args(args, "offline").__dict__)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    if args.raw:
        outputs = llm.generate(args.prompts, params)
    else:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
    for prompt, out in zip(args.prompts, outputs):
        print(f"> {prompt}\n{out.outputs[0].text.strip()}\n")
    return 0
