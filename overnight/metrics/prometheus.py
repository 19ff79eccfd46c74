"""The engine's metrics in Prometheus form: an observer of every step that keeps gauges, counters and
histograms under the names users' dashboards already query (`<prefix>:num_requests_running`, ...).

Each instance owns its CollectorRegistry, so several engines in one process (tests, a batch job beside
a server) never collide in prometheus_client's global registry.
"""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

from overnight.engine.scheduler import SchedulerStats
from overnight.engine.stats import IterationStats

DEFAULT_PREFIX = "overnight"

# Latency buckets in seconds: fine where interactive traffic lives, coarse out to hours-long batch queues.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_TIME_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def token_buckets(max_tokens: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to the first value >= max_tokens (a request's length never exceeds it)."""
    out: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            out.append(value)
            if value >= max_tokens:
                return tuple(out)
        exponent += 1


class PrometheusObserver:
    """A StatsObserver: append it to engine.observers; read it through `registry` or `render()`.

    Gauges follow the scheduler after every step; an adapter that changes the queues outside a step (an
    abort, a request added while the engine idles) calls update_gauges() so a scrape is never stale.
    Counters that the scheduler keeps as running totals (preemptions, prefix-cache tokens) are advanced
    by the difference since the last step, so a Prometheus rate() reads them as ordinary counters.
    """

    def __init__(
        self,
        model_name: str,
        prefix: str = DEFAULT_PREFIX,
        max_model_len: int = 1 << 20,
        registry: CollectorRegistry | None = None,
        limits: dict[str, int] | None = None,
    ) -> None:
        self.model_name = model_name
        self.prefix = prefix
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = ["model_name"]

        def name(short: str) -> str:
            return f"{prefix}:{short}"

        def gauge(short: str, doc: str) -> Gauge:
            return Gauge(name(short), doc, labels, registry=self.registry).labels(model_name)

        def counter(short: str, doc: str) -> Counter:
            return Counter(name(short), doc, labels, registry=self.registry).labels(model_name)

        def histogram(short: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            h = Histogram(name(short), doc, labels, buckets=buckets, registry=self.registry)
            return h.labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).")

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests admitted.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.num_preemptions = counter("num_preemptions", "Preemptions (requests evicted to recompute).")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Tokens found in the prefix cache.")
        self.lora_swaps = counter("lora_swaps", "LoRA adapters evicted from a device slot for another.")
        self.kv_admission_deferrals = counter(
            "kv_admission_deferrals",
            "Steps in which a waiting request was held back to keep KV room for the running ones' growth.",
        )
        self.decode_row_caps = counter(
            "decode_row_caps",
            "Decode steps that computed a row cap's requests (whole int4 GEMM row tiles) and left the "
            "newest to the next step.",
        )
        self._request_success = Counter(
            name("request_success"),
            "Finished requests, by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        for reason in ("stop", "length", "abort"):  # present at 0 from the start, for rate()
            self._request_success.labels(model_name, reason)

        tok = token_buckets(max_model_len)
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Time from arrival to the first token.", TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between two tokens of one request.", ITL_BUCKETS
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Time from arrival to finish.", REQUEST_TIME_BUCKETS
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Time from arrival to first scheduling.", REQUEST_TIME_BUCKETS
        )
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt length of finished requests.", tok
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated length of finished requests.", tok
        )
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Tokens in one forward pass.", ITERATION_TOKEN_BUCKETS
        )

        if limits:
            # The engine's fixed limits (max_num_seqs, ...), so a reader of the page can tell whether
            # the running gauge sits at its ceiling: `<prefix>:engine_limits_info{max_num_seqs="256",...} 1`.
            info = Info(
                name("engine_limits"),
                "The engine's batch and KV-cache limits.",
                labels,
                registry=self.registry,
            )
            info.labels(model_name).info({k: str(v) for k, v in limits.items()})

        self._last_totals = (0, 0, 0, 0, 0, 0)  # the scheduler's running totals at the previous step

    # -- StatsObserver ----------------------------------------------------------------------------

    def on_step(self, scheduler: SchedulerStats, iteration: IterationStats) -> None:
        self.update_gauges(scheduler)
        self._advance_totals(scheduler)
        if iteration.num_prompt_tokens:
            self.prompt_tokens.inc(iteration.num_prompt_tokens)
        if iteration.num_generation_tokens:
            self.generation_tokens.inc(iteration.num_generation_tokens)
        if iteration.num_scheduled_tokens:
            self.iteration_tokens.observe(iteration.num_scheduled_tokens)
        for t in iteration.time_to_first_token:
            self.time_to_first_token.observe(t)
        for t in iteration.inter_token_latency:
            self.inter_token_latency.observe(t)
        for fin in iteration.finished:
            self._request_success.labels(self.model_name, fin.finish_reason).inc()
            self.e2e_request_latency.observe(fin.e2e_latency)
            self.request_queue_time.observe(fin.queue_time)
            self.request_prompt_tokens.observe(fin.num_prompt_tokens)
            self.request_generation_tokens.observe(fin.num_generation_tokens)

    def record_aborted(self, num_requests: int) -> None:
        """Requests ended by abort_request (a client gone, a shutdown): the engine reports those
        outside a step, so the adapter that aborted them counts them here."""
        if num_requests:
            self._request_success.labels(self.model_name, "abort").inc(num_requests)

    def update_gauges(self, scheduler: SchedulerStats) -> None:
        self.num_requests_running.set(scheduler.num_running)
        self.num_requests_waiting.set(scheduler.num_waiting)
        usage = scheduler.kv_cache_usage
        self.kv_cache_usage_perc.set(min(max(usage, 0.0), 1.0) if math.isfinite(usage) else 0.0)

    def _advance_totals(self, s: SchedulerStats) -> None:
        totals = (
            s.num_preemptions_total,
            s.prefix_cache_queries,
            s.prefix_cache_hits,
            s.lora_swaps_total,
            s.kv_admission_deferrals_total,
            s.decode_row_capped_total,
        )
        counters = (
            self.num_preemptions,
            self.prefix_cache_queries,
            self.prefix_cache_hits,
            self.lora_swaps,
            self.kv_admission_deferrals,
            self.decode_row_caps,
        )
        for counter, now, before in zip(counters, totals, self._last_totals, strict=True):
            if now > before:
                counter.inc(now - before)
        self._last_totals = totals

    # -- reading ----------------------------------------------------------------------------------

    def render(self) -> bytes:
        """The text exposition format, as GET /metrics serves it."""
        return generate_latest(self.registry)
