"""Reading a server's /metrics page: the gauges and counters the sweep and `overnight check` judge a
run by, under either prefix (`overnight:` or `vllm:`), averaged over a window of scrapes.

Names are kept without their prefix, as the text format writes them: `num_requests_running`,
`num_preemptions_total`, `generation_tokens_total`. Samples of one name are summed over their labels
(a page serves one model); histogram buckets are left out.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:  # httpx is needed only to scrape; the summaries serve in-process checks without it
    import httpx

PREFIXES = ("overnight:", "vllm:")
LIMITS_INFO = "engine_limits_info"


@dataclass(frozen=True)
class Snapshot:
    t: float  # time.monotonic() when the page arrived
    values: dict[str, float]
    limits: dict[str, int] = field(default_factory=dict)  # from <prefix>:engine_limits_info, if served

    def get(self, name: str) -> float:
        return self.values.get(name, 0.0)

    @property
    def running(self) -> float:
        return self.get("num_requests_running")

    @property
    def waiting(self) -> float:
        return self.get("num_requests_waiting")

    @property
    def kv_usage(self) -> float:
        return self.get("kv_cache_usage_perc")

    @property
    def preemptions_total(self) -> float:
        return self.get("num_preemptions_total")

    @property
    def generation_tokens_total(self) -> float:
        return self.get("generation_tokens_total")


def parse_metrics(text: str, t: float | None = None) -> Snapshot:
    values: dict[str, float] = {}
    limits: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = _short(s.name)
            if name is None or "le" in s.labels:
                continue
            if name == LIMITS_INFO:
                limits.update({k: int(v) for k, v in s.labels.items() if v.isdigit()})
                continue
            values[name] = values.get(name, 0.0) + s.value
    return Snapshot(time.monotonic() if t is None else t, values, limits)


def _short(name: str) -> str | None:
    for prefix in PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return None


async def scrape(client: httpx.AsyncClient, base_url: str) -> Snapshot:
    r = await client.get(base_url.rstrip("/") + "/metrics")
    r.raise_for_status()
    return parse_metrics(r.text)


def scrape_sync(base_url: str, timeout: float = 10.0, headers: dict[str, str] | None = None) -> Snapshot:
    import httpx

    r = httpx.get(base_url.rstrip("/") + "/metrics", timeout=timeout, headers=headers)
    r.raise_for_status()
    return parse_metrics(r.text)


async def poll(
    client: httpx.AsyncClient,
    base_url: str,
    until: float,
    interval_s: float = 0.5,
    out: list[Snapshot] | None = None,
) -> list[Snapshot]:
    """Scrape every interval_s until time.monotonic() passes `until` (one scrape at least, and one at
    the end, so counter differences span the whole window). out: the list to append to, which keeps
    what was scraped if the task is cancelled before `until`."""
    out = [] if out is None else out
    out.append(await scrape(client, base_url))
    while True:
        left = until - time.monotonic()
        if left <= 0:
            break
        await asyncio.sleep(min(interval_s, left))
        out.append(await scrape(client, base_url))
    return out


@dataclass(frozen=True)
class WindowMetrics:
    """Means of the gauges and increments of the counters over a window of samples."""

    duration_s: float
    num_samples: int
    mean_running: float
    mean_waiting: float
    mean_kv_usage: float
    max_kv_usage: float
    waiting_fraction: float  # share of samples with a request waiting
    preemptions: float  # increase over the window
    generation_tokens: float | None  # increase over the window; None: not counted
    max_num_seqs: int | None
    num_kv_blocks: int | None = None
    steps: float | None = None  # engine steps in the window (the iteration_tokens histogram's count)
    scheduled_tokens: float | None = None  # tokens those steps computed (its sum)
    # steps in which planned admission held a request back for the pool (None: not served, e.g. vLLM)
    kv_deferrals: float | None = None
    # decode steps a row cap held (scheduler.py _decode_rows; None: not served)
    row_capped: float | None = None

    @property
    def generation_tok_s(self) -> float | None:
        if self.generation_tokens is None:
            return None
        return self.generation_tokens / self.duration_s if self.duration_s > 0 else 0.0

    def to_dict(self) -> dict[str, float | int | None]:
        return {
            "mean_running": round(self.mean_running, 2),
            "mean_waiting": round(self.mean_waiting, 2),
            "mean_kv_usage": round(self.mean_kv_usage, 4),
            "max_kv_usage": round(self.max_kv_usage, 4),
            "waiting_fraction": round(self.waiting_fraction, 3),
            "preemptions": int(self.preemptions),
            "server_generation_tok_s": None
            if self.generation_tok_s is None
            else round(self.generation_tok_s, 1),
            "max_num_seqs": self.max_num_seqs,
            "num_kv_blocks": self.num_kv_blocks,
            # Whether the step budget (max_num_batched_tokens) binds: compare the two.
            "mean_tokens_per_step": None
            if not self.steps or self.scheduled_tokens is None
            else round(self.scheduled_tokens / self.steps, 1),
            "steps_per_s": None
            if self.steps is None or self.duration_s <= 0
            else round(self.steps / self.duration_s, 2),
            "samples": self.num_samples,
        }


def summarize(snaps: list[Snapshot]) -> WindowMetrics:
    if not snaps:
        raise ValueError("no samples")
    n = len(snaps)
    first, last = snaps[0], snaps[-1]
    limits = last.limits

    def increase(name: str) -> float | None:
        if name not in last.values:
            return None
        return last.get(name) - first.get(name)

    return WindowMetrics(
        duration_s=last.t - first.t,
        num_samples=n,
        mean_running=sum(s.running for s in snaps) / n,
        mean_waiting=sum(s.waiting for s in snaps) / n,
        mean_kv_usage=sum(s.kv_usage for s in snaps) / n,
        max_kv_usage=max(s.kv_usage for s in snaps),
        waiting_fraction=sum(s.waiting > 0 for s in snaps) / n,
        preemptions=last.preemptions_total - first.preemptions_total,
        generation_tokens=last.generation_tokens_total - first.generation_tokens_total,
        max_num_seqs=limits.get("max_num_seqs"),
        num_kv_blocks=limits.get("num_kv_blocks"),
        steps=increase("iteration_tokens_total_count"),
        scheduled_tokens=increase("iteration_tokens_total_sum"),
        kv_deferrals=increase("kv_admission_deferrals_total"),
        row_capped=increase("decode_row_caps_total"),
    )
