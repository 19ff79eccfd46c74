"""`run-batch --validate-only`: every check a line can fail, without loading the model's weights.

Reads the model's metadata (names, context length, vocabulary) and its tokenizer, so prompt lengths and
chat templates are checked too; only the engine's own limits that depend on memory are left out.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from overnight.batch.records import error_record
from overnight.batch.summary import Summary
from overnight.errors import InvalidRequestError, ModelLoadError
from overnight.openai_api.errors import ApiError
from overnight.openai_api.inputs import prepare, served_names
from overnight.sampling_params import SamplingParams

_SHOWN = 50  # errors printed on stderr; all of them go to --errors-file


def validate_file(args: argparse.Namespace) -> int:
    from overnight.batch.cli import input_lines
    from overnight.batch.output import Sink, open_output
    from overnight.batch.reader import read_lines
    from overnight.loader.resolve import resolve_source

    try:
        source = resolve_source(args.model, args.load_format)
    except ModelLoadError as e:
        print(f"overnight run-batch: {e}", file=sys.stderr)
        return 2
    served = args.served_model_name or source.served_name
    tokenizer = None
    if not args.skip_tokenizer_init and source.tokenizer_path is not None:
        from overnight.tokenizer.tokenizer import load_tokenizer

        if args.tokenizer:
            source = dataclasses.replace(source, tokenizer_path=args.tokenizer)
        tokenizer = load_tokenizer(source)
    max_model_len = args.max_model_len or source.arch.max_position_embeddings
    vocab_size = source.arch.vocab_size
    grammars = None
    if tokenizer is not None:
        from overnight.structured.compiler import GrammarCompiler

        grammars = GrammarCompiler.for_tokenizer(tokenizer, vocab_size)

    def engine_checks(ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise InvalidRequestError(
                f"prompt token id {bad[0]} is outside the vocabulary (size {vocab_size})"
            )
        if params.stop_strings and tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer")
        if params.structured_outputs is not None:  # compiled, as the engine does before queuing
            if grammars is None:
                raise InvalidRequestError("structured outputs need a tokenizer")
            grammars.compile(params.structured_outputs)

    names = served_names(served, args.model)
    sink = None
    if args.errors_file:
        errors, _ = open_output(args.errors_file, resume=False, overwrite=args.overwrite, what="errors")
        sink = Sink(errors, errors)
    summary = Summary(input=args.input_file, output=args.errors_file or "-", model=served)
    seen: set[str] = set()
    for line in read_lines(input_lines(args.input_file)):
        error = line.error
        if error is None and line.custom_id in seen:
            error = ApiError(
                "duplicate_custom_id", f"custom_id {line.custom_id!r} is used by an earlier line", "custom_id"
            )
        if line.custom_id is not None:
            seen.add(line.custom_id)
        if error is None and line.request is not None:
            try:
                prepare(line.request, tokenizer, max_model_len, names, engine_checks)
            except ApiError as e:
                error = e
        if error is None:
            summary.ok += 1
            continue
        summary.add_failure(error.code)
        if summary.failed <= _SHOWN:
            where = f"line {line.line_no}" + (f" ({line.custom_id})" if line.custom_id is not None else "")
            print(f"{where}: {error.code}: {error.message}", file=sys.stderr)
        if sink is not None:
            sink.write(error_record(line.custom_id, line.line_no, error))
    if sink is not None:
        sink.close()
    if summary.failed > _SHOWN:
        print(f"... and {summary.failed - _SHOWN} more", file=sys.stderr)
    summary.finish("validated")
    print(
        f"validated {summary.done} lines: {summary.ok} valid, {summary.failed} invalid"
        + (
            " (" + ", ".join(f"{k} {v}" for k, v in sorted(summary.errors_by_code.items())) + ")"
            if summary.failed
            else ""
        ),
        file=sys.stderr,
    )
    if args.summary_json:
        summary.write_json(args.summary_json)
    return 1 if summary.failed else 0
