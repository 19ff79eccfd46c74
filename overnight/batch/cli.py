"""`overnight run-batch -i requests.jsonl -o results.jsonl [--model M]`: an OpenAI batch file through the
offline engine.

Exit status: 0 when every line was answered (failed lines included: they are answers), 1 when a line
failed --validate-only or the engine stopped, 2 for a usage error (bad flags, a model that cannot be
loaded, an output file another run holds), 130 when interrupted. After 1 or 130,
`--resume` continues where the output ends.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from overnight.batch.ordering import ORDERS
from overnight.batch.output import UsageError, check_output
from overnight.batch.spill import check_spill
from overnight.entrypoints.submission import make_order
from overnight.errors import ConfigError
from overnight.lora.modules import add_lora_modules_arg, check_adapters, lora_overrides, parse_lora_modules
from overnight.multimodal.processor import image_processor_for

# Needs pydantic (the server extra): imported here so `overnight` can name the missing package.
from overnight.openai_api.protocol import ROUTES
from overnight.options import ChatOptions, add_engine_args, add_option_args, from_args, options_from_args

log = logging.getLogger("overnight.batch")

EPILOG = """\
input lines:  {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
               "body": {"messages": [{"role": "user", "content": "Hello"}], "max_completion_tokens": 64}}
urls: URLS (a list "prompt" gives one choice per prompt).
Each output line is written and flushed as its request finishes; after a crash, run again with --resume.
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run-batch",
        help="run an OpenAI batch file (JSONL) through the engine",
        description=__doc__,
        epilog=EPILOG.replace("URLS", ", ".join(ROUTES)),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-i", "--input-file", required=True, help="batch file (JSONL), or - for stdin")
    p.add_argument(
        "-o",
        "--output-file",
        default=None,
        help="results (JSONL), or - for stdout; required unless --validate-only",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--resume",
        action="store_true",
        help="continue an existing output: drop a torn last line, skip answered custom_ids",
    )
    mode.add_argument("--overwrite", action="store_true", help="replace a non-empty output file")
    p.add_argument(
        "--order",
        choices=ORDERS,
        default="input",
        help="write results in input order (default; finished lines that must wait for an earlier one "
        "wait on disk in OUTPUT.spill) or as they finish",
    )
    p.add_argument(
        "--error-file",
        "--errors-file",
        dest="errors_file",
        default=None,
        help="write failed lines here instead of the output (as the OpenAI Batch API keeps an error file)",
    )
    p.add_argument(
        "--validate-only",
        action="store_true",
        help="check every line (bodies, model name, prompt lengths) without loading the model",
    )
    p.add_argument("--summary-json", default=None, help="also write the summary to this file as JSON")
    p.add_argument(
        "--max-in-flight",
        type=int,
        default=None,
        help="engine sequences queued at once (default: 2 x max_num_seqs)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_engine_args(p)
    add_option_args(p, ChatOptions, "chat: reasoning and tool calls")
    add_lora_modules_arg(p)
    r = p.add_argument_group("ray (pip install 'overnight[ray]')")
    r.add_argument("--ray", action="store_true", help="run the engines as replicas on a Ray cluster")
    r.add_argument(
        "--ray-address", default=None, help="cluster to join (default: RAY_ADDRESS, else a new local cluster)"
    )
    r.add_argument("--num-replicas", type=int, default=1, help="engines on the cluster, with --ray")


def run(args: argparse.Namespace) -> int:
    try:
        _check_args(args)
        if args.validate_only:
            from overnight.batch.validate import validate_file

            return validate_file(args)
        return _run_batch(args)
    except UsageError as e:
        print(f"overnight run-batch: {e}", file=sys.stderr)
        return 2


def _check_args(args: argparse.Namespace) -> None:
    options_from_args(args, mode="batch")  # a wrong option value: ConfigError, before any file is touched
    if args.input_file != "-" and not os.path.isfile(args.input_file):
        raise UsageError(f"input file {args.input_file} not found")
    if args.validate_only:
        chat_options(args)
        return
    if args.output_file is None:
        raise UsageError("-o/--output-file is required (use - for stdout)")
    paths = [args.input_file, args.output_file] + ([args.errors_file] if args.errors_file else [])
    real = [os.path.realpath(p) for p in paths if p != "-"]
    if len(set(real)) < len(real):
        raise UsageError("the input, output and errors files must be different files")
    if args.errors_file == "-":
        raise UsageError("--errors-file must be a file")
    for path, what in ((args.output_file, "output"), (args.errors_file, "errors")):
        if path is not None:
            check_output(path, resume=args.resume, overwrite=args.overwrite, what=what)
    check_spill(args.output_file, resume=args.resume, overwrite=args.overwrite)
    try:
        parse_lora_modules(args.lora_modules)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    chat_options(args)


def chat_options(args: argparse.Namespace) -> ChatOptions:
    try:
        return from_args(ChatOptions, args)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _run_batch(args: argparse.Namespace) -> int:
    from overnight.batch.ordering import OutputOrder
    from overnight.batch.output import Sink, lock_output, open_output
    from overnight.batch.progress import Progress
    from overnight.batch.reader import count_lines, input_lines, read_lines
    from overnight.batch.runner import BatchRunner
    from overnight.batch.spill import Spill
    from overnight.batch.summary import Summary
    from overnight.batch.timeline import Timeline
    from overnight.build import build_engine, build_ray_engine
    from overnight.openai_api.inputs import served_names

    # Locked before the model loads: a second run on these files stops now, not after minutes.
    out_handle = lock_output(args.output_file)
    errors_handle = lock_output(args.errors_file, "errors") if args.errors_file else None
    adapters = parse_lora_modules(args.lora_modules)
    opts = options_from_args(args, mode="batch", **lora_overrides(adapters))
    if args.ray:  # replicas on a Ray cluster behind one front: overnight/parallel/ray.py
        try:
            engine = build_ray_engine(opts, args.num_replicas, address=args.ray_address)
        except ImportError as e:
            raise UsageError(str(e)) from None
    else:
        engine = build_engine(opts)  # a bad model: one line, exit 2
    check_adapters(engine, adapters)
    if not args.ray and args.data_parallel_size == 1:  # a line a minute: which limit holds the batch
        from overnight.tools.check import start_check_log

        # A light load in a batch job is the end of the file (the default --max-in-flight keeps twice
        # the engine's seats queued): "send more requests" would be noise, unless --max-in-flight is
        # what keeps the seats empty.
        seats = engine.config.scheduler.max_num_seqs
        starved = args.max_in_flight is not None and args.max_in_flight < seats
        start_check_log(engine, interval_s=60.0, quiet=() if starved else ("idle", "light_load"))
    served = engine.source.served_name
    out, answered = open_output(
        args.output_file, resume=args.resume, overwrite=args.overwrite, locked=out_handle
    )
    errors = None
    if args.errors_file:
        errors, answered_errors = open_output(
            args.errors_file,
            resume=args.resume,
            overwrite=args.overwrite,
            what="errors",
            locked=errors_handle,
        )
        answered.merge(answered_errors)
    if answered.num_records:
        log.info("resuming: %d lines already answered in %s", answered.num_records, args.output_file)
    sink = Sink(out, errors)
    spill = Spill.beside(args.output_file, resume=args.resume, answered_ids=answered.custom_ids)
    if spill.recovered:
        log.info("resuming: %d finished lines wait in %s", len(spill.recovered), spill.path)
    sched = engine.config.scheduler
    block_size = engine.config.cache.block_size
    images = image_processor_for(engine.source, opts)
    window = args.lookahead_window
    if images is not None:
        # Lines in the window hold their images' pixels (megabytes each): keep it near the engine's seats.
        window = min(window, max(2 * sched.max_num_seqs, 64))
    timeline = Timeline(args.schedule, window, sched.max_num_seqs)
    summary = Summary(input=args.input_file, output=args.output_file, model=served, timeline=timeline)
    total = None
    if args.input_file != "-":
        total = max(count_lines(args.input_file) - len(answered.custom_ids) - len(answered.lines), 0)
    progress = Progress(total, summary, enabled=not args.no_progress)
    runner = BatchRunner(
        engine,
        sink,
        summary,
        model_name=served,
        names=served_names(served, args.model) | set(adapters),
        adapters=adapters,
        order=OutputOrder(args.order, spill),
        max_in_flight=args.max_in_flight or 2 * sched.max_num_seqs,
        schedule=make_order(args.schedule, window, block_size),
        answered=answered,
        progress=progress,
        chat=chat_options(args),
        images=images,
    )
    status, code = "completed", 0
    # SIGTERM (a scheduler pre-empting the job) stops like Ctrl-C: finished lines written, summary printed.
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        runner.run(read_lines(input_lines(args.input_file)))
    except KeyboardInterrupt:
        status, code = "interrupted", 130
    except Exception:
        log.exception("the engine stopped; finished lines are written, --resume continues")
        status, code = "failed", 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        progress.close()
        sink.close()
    summary.finish(status)
    print(summary.text(), file=sys.stderr)
    kept = runner.order.num_held + len(spill.recovered)
    if status != "completed" and spill.durable and kept:
        print(
            f"overnight run-batch: {kept} finished lines wait in {spill.path}; "
            "--resume writes them in input order",
            file=sys.stderr,
        )
    if args.summary_json:
        summary.write_json(args.summary_json)
    return code
