"""Putting an engine's metrics where users look: attach an observer to any engine (the offline class,
run-batch, the server), and serve them on a port while a batch job runs.

    from overnight.metrics import attach_metrics
    metrics = attach_metrics(llm.engine, port=9400)      # scrape http://127.0.0.1:9400/metrics
    llm.generate(prompts)
    print(metrics.render().decode())
"""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

import prometheus_client

from overnight.metrics.prometheus import DEFAULT_PREFIX, PrometheusObserver

if TYPE_CHECKING:
    from overnight.engine.interfaces import EngineClient

log = logging.getLogger("overnight")


def engine_model_name(engine: EngineClient) -> str:
    return engine.source.served_name


def engine_limits(engine: EngineClient) -> dict[str, int]:
    """The limits a reader of /metrics needs to judge the gauges: the batch ceilings and the pool size."""
    sched, cache = engine.config.scheduler, engine.config.cache
    limits = {
        "max_num_seqs": sched.max_num_seqs,
        "max_num_batched_tokens": sched.max_num_batched_tokens,
        "max_model_len": sched.max_model_len,
        "block_size": cache.block_size,
        "num_kv_blocks": engine.pool_plan.num_blocks,  # one engine's (each of a data-parallel group has one)
    }
    return limits


def attach_metrics(
    engine: EngineClient,
    prefix: str = DEFAULT_PREFIX,
    model_name: str | None = None,
    port: int | None = None,
    host: str = "127.0.0.1",
) -> PrometheusObserver:
    """Add a PrometheusObserver to the engine's observers; with a port, also serve it over HTTP."""
    observer = PrometheusObserver(
        model_name or engine_model_name(engine),
        prefix=prefix,
        max_model_len=engine.max_model_len,
        limits=engine_limits(engine),
    )
    observer.update_gauges(engine.stats())
    engine.observers.append(observer)
    if port is not None:
        bound = start_metrics_server(observer, port, host)
        log.info("Prometheus metrics on http://%s:%d/metrics", host, bound)
    return observer


def start_metrics_server(observer: PrometheusObserver, port: int, host: str = "127.0.0.1") -> int:
    """Serve GET /metrics from a daemon thread (it dies with the job); returns the bound port (port 0
    picks a free one)."""
    hide_created_series()
    server, _thread = prometheus_client.start_http_server(port, addr=host, registry=observer.registry)
    return int(server.server_port)


def hide_created_series() -> None:
    """Drop the `<name>_created` timestamp series prometheus_client adds beside each counter and
    histogram: dashboards never read them and they double the page. Process-wide, so only entry points
    that own the process call it."""
    prometheus_client.disable_created_metrics()


def add_metrics_args(parser: argparse.ArgumentParser, with_port: bool = True) -> None:
    g = parser.add_argument_group("metrics")
    g.add_argument(
        "--metrics-prefix",
        default=DEFAULT_PREFIX,
        help="metric name prefix; 'vllm' makes existing dashboards work unchanged "
        f"(default: {DEFAULT_PREFIX})",
    )
    if with_port:
        g.add_argument(
            "--metrics-port",
            type=int,
            default=None,
            help="serve Prometheus metrics on this port (127.0.0.1) while the job runs",
        )
