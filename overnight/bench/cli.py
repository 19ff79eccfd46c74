"""`overnight bench throughput | sweep`. Importable without the server packages."""

from __future__ import annotations

import argparse
import importlib
import sys

from overnight.options import add_engine_args, options_from_args

# sub-command -> module with add_arguments(parser) and run(args) -> int (besides throughput, below)
SUBCOMMANDS = {"sweep": "overnight.bench.sweep"}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure throughput")
    bench = p.add_subparsers(dest="bench_command", metavar="BENCH")
    t = bench.add_parser("throughput", help="offline throughput on a fixed workload")
    t.add_argument(
        "--workload",
        default=None,
        help="seed-512-256, nano-256, long-1024-1024 (GPU, dummy weights), cpu-64, or caption-448 "
        "(one synthetic image per request: a vision-language model; reports images/s)",
    )
    t.add_argument("--num-prompts", type=int, default=None)
    t.add_argument("--input-len", type=int, nargs="+", default=None, help="one length, or lo hi")
    t.add_argument("--output-len", type=int, nargs="+", default=None, help="one length, or lo hi")
    t.add_argument(
        "--compare",
        choices=["transformers"],
        default=None,
        help="also run transformers' static-batch generate on the same prompts",
    )
    t.add_argument("--hf-batch-size", type=int, default=256)
    t.add_argument(
        "--hf-max-requests",
        type=int,
        default=None,
        help="run transformers on the first N requests only (its time is long)",
    )
    t.add_argument("--json-out", default=None, help="also write the JSON line to this file")
    t.add_argument(
        "--json-schema",
        default=None,
        metavar="FILE",
        help="constrain every request to this JSON schema and compare with unconstrained generation "
        "of the same lengths, in one run (structured-output overhead and its step breakdown)",
    )
    t.add_argument(
        "--repeats", type=int, default=1, help="with --json-schema: timed pairs, order alternating"
    )
    t.add_argument(
        "--lora-adapters",
        type=int,
        default=0,
        metavar="N",
        help="run the workload on the base model, then spread over N random LoRA adapters in one batch",
    )
    t.add_argument("--lora-rank", type=int, default=16, help="rank of the --lora-adapters (every projection)")
    add_engine_args(t)
    for name, module in SUBCOMMANDS.items():
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError:
            continue
        mod.add_arguments(bench.add_parser(name, help=(mod.__doc__ or "").strip().splitlines()[0]))


def _workload(args: argparse.Namespace):
    from dataclasses import replace

    from overnight.bench.workloads import WORKLOADS, Workload

    if args.workload:
        if args.workload not in WORKLOADS:
            raise SystemExit(f"unknown workload {args.workload!r}; known: {', '.join(WORKLOADS)}")
        w = WORKLOADS[args.workload]
        if args.num_prompts:
            w = replace(w, num_requests=args.num_prompts)
        if w.image_size is not None and (args.compare or args.json_schema):
            flag = "--compare" if args.compare else "--json-schema"
            raise SystemExit(f"{flag} takes text workloads only; {w.name} is an image workload")
        return w

    def span(v, default):
        v = v or default
        return (v[0], v[-1])

    return Workload(
        "custom", "", args.num_prompts or 64, span(args.input_len, [128]), span(args.output_len, [128])
    )


def run(args: argparse.Namespace) -> int:
    if args.bench_command != "throughput":
        if args.bench_command in SUBCOMMANDS:
            return int(importlib.import_module(SUBCOMMANDS[args.bench_command]).run(args) or 0)
        print("usage: overnight bench {throughput,sweep} ...", file=sys.stderr)
        return 2
    from overnight.bench.throughput import print_table, run_ours, run_transformers, to_json

    workload = _workload(args)
    if args.model is None and workload.model not in ("", "default"):
        args.model = workload.model
        if args.load_format == "auto":
            args.load_format = "dummy"
    elif args.model is not None:
        from dataclasses import replace

        workload = replace(workload, model=args.model)  # the JSON line names the model that ran
    opts = options_from_args(args, mode="offline")
    if args.json_schema:
        from overnight.bench import structured

        variants, summary = structured.run(opts, workload, args.json_schema, repeats=args.repeats)
        structured.print_table(variants, summary)
        line = structured.to_json(workload, variants, summary)
        print(line)
        if args.json_out:
            with open(args.json_out, "a") as f:
                f.write(line + "\n")
        return 0
    results = []
    if args.lora_adapters:
        from overnight.bench import lora

        results = lora.run(opts, workload, args.lora_adapters, args.lora_rank)
    else:
        ours, _ = run_ours(opts, workload)
        results.append(ours)
    if args.compare == "transformers":
        results.append(run_transformers(opts, workload, args.hf_batch_size, args.hf_max_requests))
    print_table(workload, results)
    line = to_json(workload, results)
    print(line)
    if args.json_out:
        with open(args.json_out, "a") as f:
            f.write(line + "\n")
    return 0
