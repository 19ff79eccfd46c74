"""Engine metrics for Prometheus: the observer, and helpers to attach and expose it."""

from overnight.metrics.exposure import (
    add_metrics_args,
    attach_metrics,
    engine_limits,
    engine_model_name,
    hide_created_series,
    start_metrics_server,
)
from overnight.metrics.prometheus import DEFAULT_PREFIX, PrometheusObserver

__all__ = [
    "DEFAULT_PREFIX",
    "PrometheusObserver",
    "add_metrics_args",
    "attach_metrics",
    "engine_limits",
    "engine_model_name",
    "hide_created_series",
    "start_metrics_server",
]
