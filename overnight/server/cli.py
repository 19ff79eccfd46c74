"""`overnight serve`: the engine behind an OpenAI-compatible HTTP API, with Prometheus metrics.

    overnight serve                                   # the embedded default model on 127.0.0.1:8000
    overnight serve Qwen/Qwen3-8B                     # as `vllm serve MODEL` (or --model MODEL)
    overnight serve --model ./my-model --api-key KEY --metrics-prefix vllm --max-waiting 256

SIGTERM (or Ctrl-C) stops accepting connections, lets in-flight requests finish for up to
--shutdown-timeout seconds, aborts what is left, and exits 0, also when the signal reaches the whole
process group: the engine processes leave stopping to this one.
"""

from __future__ import annotations

import argparse
import logging
import signal
from dataclasses import dataclass, replace

from overnight.build import build_engine
from overnight.engine.interfaces import EngineClient
from overnight.errors import ConfigError
from overnight.lora.modules import add_lora_modules_arg, check_adapters, lora_overrides, parse_lora_modules
from overnight.lora.request import LoRARequest
from overnight.metrics import (
    DEFAULT_PREFIX,
    PrometheusObserver,
    engine_limits,
    engine_model_name,
    hide_created_series,
)
from overnight.multimodal.processor import ImageProcessor, image_processor_for
from overnight.openai_api.inputs import served_names
from overnight.options import (
    SUBMISSION_OPTIONS,
    ChatOptions,
    EngineOptions,
    add_engine_args,
    add_option_args,
    check_options,
    from_args,
    option,
    options_from_args,
)
from overnight.server.app import DEFAULT_MAX_REQUEST_BYTES, OPEN_PATHS, build_app
from overnight.server.async_engine import AsyncEngine
from overnight.server.serving import ServingConfig

log = logging.getLogger("overnight.server")


@dataclass(frozen=True)
class ServerOptions:
    host: str = option("127.0.0.1", "address to bind (127.0.0.1: this machine only)")
    port: int = option(8000, "port to listen on", minimum=0)
    api_key: str | None = option(
        None, "require 'Authorization: Bearer KEY' on every route but /health and /metrics"
    )
    protect_metrics: bool = option(
        False, "with --api-key, /metrics needs the key too (Prometheus scrapers then must send it)"
    )
    max_request_bytes: int = option(
        DEFAULT_MAX_REQUEST_BYTES, "answer 413 to request bodies larger than this many bytes", minimum=1
    )
    max_waiting: int | None = option(
        None,
        "answer 503 to new requests while this many wait to be scheduled (default: no limit)",
        minimum=0,
    )
    stream_interval: int = option(
        1,
        "a streamed response sends a chunk once it holds this many new tokens (or ends): fewer chunks "
        "cost the HTTP process less per token at saturation, each token arriving a little later",
        minimum=1,
    )
    shutdown_timeout: float = option(
        30.0, "on SIGTERM, seconds in-flight requests get to finish before they are aborted", minimum=0
    )
    metrics_prefix: str = option(
        DEFAULT_PREFIX, "prefix of /metrics names; 'vllm' keeps existing dashboards working"
    )
    access_log: bool = option(True, "log every request")
    log_level: str = option(
        "info", "server log level", choices=("critical", "error", "warning", "info", "debug")
    )

    def __post_init__(self) -> None:
        check_options(self)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server with Prometheus metrics",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model, as `vllm serve MODEL` takes it",
    )
    add_engine_args(p, skip=SUBMISSION_OPTIONS)  # a server takes requests as they come
    add_lora_modules_arg(p)
    add_option_args(p, ServerOptions, "server")
    add_option_args(p, ChatOptions, "chat: reasoning and tool calls")


def make_app(
    engine: EngineClient,
    opts: ServerOptions,
    model_arg: str | None = None,
    chat: ChatOptions | None = None,
    adapters: dict[str, LoRARequest] | None = None,
    images: ImageProcessor | None = None,
):
    """The app serving `engine` (not yet started: the app's lifespan starts the engine thread);
    images: a vision-language model's image processor (multimodal/processor.py)."""
    model_name = engine_model_name(engine)
    metrics = PrometheusObserver(
        model_name,
        prefix=opts.metrics_prefix,
        max_model_len=engine.max_model_len,
        limits=engine_limits(engine),
    )
    engine.observers.append(metrics)
    config = ServingConfig(
        model_name=model_name,
        accepted_names=served_names(model_name, model_arg) | set(adapters or {}),
        max_waiting=opts.max_waiting,
        stream_interval=opts.stream_interval,
        chat=chat,
        adapters=dict(adapters or {}),
        images=images,
    )
    open_paths = OPEN_PATHS - {"/metrics"} if opts.protect_metrics else OPEN_PATHS
    return build_app(
        AsyncEngine(engine, metrics),
        config,
        metrics,
        api_key=opts.api_key,
        open_paths=open_paths,
        max_request_bytes=opts.max_request_bytes,
    )


def uvicorn_server(app, opts: ServerOptions):
    import uvicorn

    config = uvicorn.Config(
        app,
        host=opts.host,
        port=opts.port,
        timeout_graceful_shutdown=max(int(round(opts.shutdown_timeout)), 0),
        access_log=opts.access_log,
        log_level=opts.log_level,
        lifespan="on",
    )
    return uvicorn.Server(config)


def engine_options(args: argparse.Namespace) -> EngineOptions:
    """The engine of a server: server limits, and its own process unless --no-engine-process (its step
    then never waits for the GIL the HTTP side holds; bench/server_cost_cpu.py measures the difference)."""
    # `bench sweep` starts a server from its own flags, which have no --lora-modules
    adapters = parse_lora_modules(getattr(args, "lora_modules", None))
    opts = options_from_args(args, mode="server", **lora_overrides(adapters))
    return opts if opts.engine_process is not None else replace(opts, engine_process=True)


def run(args: argparse.Namespace) -> int:
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ConfigError(f"two models given: {args.model_tag} and --model {args.model}; name one")
        args.model = args.model_tag
    opts = from_args(ServerOptions, args)
    try:
        chat = from_args(ChatOptions, args)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if opts.host not in ("127.0.0.1", "localhost", "::1") and not opts.api_key:
        log.warning(
            "serving on %s without --api-key: anyone who can reach this port can use the model", opts.host
        )
    adapters = parse_lora_modules(args.lora_modules)
    engine_opts = engine_options(args)
    engine = build_engine(engine_opts)
    check_adapters(engine, adapters)  # a bad adapter folder stops the server before it listens
    hide_created_series()
    images = image_processor_for(engine.source, engine_opts)
    app = make_app(engine, opts, model_arg=args.model, chat=chat, adapters=adapters, images=images)
    server = uvicorn_server(app, opts)
    # uvicorn turns SIGTERM / SIGINT into a graceful shutdown, then raises the signal again for the handler
    # that was installed before it started. A no-op there makes a clean drain exit 0, not die by signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
    if not server.started:
        return 1  # could not bind, or the engine failed to start: uvicorn has logged why
    return 0
