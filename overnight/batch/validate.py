"""`run-batch --validate-only`: every check a line can fail, without loading the model's weights.

Reads the model's metadata (names, context length, vocabulary) and its tokenizer, and resolves the
engine's configuration for this device, so each line gets exactly the engine's own checks (validation.py)
and chat templates are applied; only what depends on the KV pool's size is left out.
"""

from __future__ import annotations

import argparse
import sys

from overnight.batch.records import error_record
from overnight.batch.summary import Summary
from overnight.engine.validation import limits_of, validate_request
from overnight.errors import ConfigError, InvalidRequestError, ModelLoadError
from overnight.lora.adapter import check_adapter
from overnight.lora.modules import lora_overrides, parse_lora_modules
from overnight.multimodal.processor import image_processor_for, no_images_reason
from overnight.openai_api.errors import ApiError
from overnight.openai_api.inputs import prepare, served_names
from overnight.options import ChatOptions, from_args, options_from_args
from overnight.pooling_params import RequestParams

_SHOWN = 50  # errors printed on stderr; all of them go to --errors-file


def validate_file(args: argparse.Namespace) -> int:
    from overnight.batch.output import Sink, open_output
    from overnight.batch.reader import input_lines, read_lines
    from overnight.build import build_config, resolve_model
    from overnight.runner.device import device_memory_gib, pick_device

    try:
        adapters = parse_lora_modules(args.lora_modules)
        opts = options_from_args(args, mode="batch", **lora_overrides(adapters))
        model = resolve_model(opts)
        # The engine's own configuration and checks, without its weights (only the pool is unknown).
        device = pick_device(opts.device)
        config = build_config(opts, model.source, device, device_memory_gib(device))
        for adapter in adapters.values():
            check_adapter(adapter, model.source.arch, opts.max_lora_rank)
    except (ModelLoadError, ConfigError, InvalidRequestError) as e:
        print(f"overnight run-batch: {e}", file=sys.stderr)
        return 2
    source, tokenizer = model.source, model.tokenizer
    served = source.served_name
    limits = limits_of(config, source.arch.vocab_size, tokenizer is not None)

    def engine_checks(ids: list[int], params: RequestParams) -> None:
        validate_request(ids, params, limits, model.grammars)  # grammars compiled, as the engine does

    names = served_names(served, args.model) | set(adapters)
    pooler = config.model.pooler
    chat = from_args(ChatOptions, args)
    images = image_processor_for(source, opts)  # image lines are decoded and checked too
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
                prepare(
                    line.request,
                    tokenizer,
                    config.scheduler.max_model_len,
                    names,
                    engine_checks,
                    runner=config.model.runner,
                    chat=chat,
                    images=images,
                    embedding_scores=pooler is not None and pooler.classifier is None,
                    no_images=no_images_reason(source.arch),
                )
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
            cid = None if error.code == "duplicate_custom_id" else line.custom_id
            sink.write(error_record(cid, line.line_no, error))
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
