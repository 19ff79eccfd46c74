"""Per-step statistics handed to observers (the Prometheus exporter, progress logs). The engine core
knows nothing of how they are shown: an observer is any object with on_step()."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from overnight.engine.scheduler import SchedulerStats


@dataclass(slots=True)
class FinishedRequestStats:
    finish_reason: str
    num_prompt_tokens: int
    num_generation_tokens: int
    e2e_latency: float
    queue_time: float


@dataclass
class IterationStats:
    num_scheduled_tokens: int = 0  # tokens in this step's forward pass
    num_prompt_tokens: int = 0  # prompt tokens of requests that started this step
    num_generation_tokens: int = 0  # tokens sampled this step
    time_to_first_token: list[float] = field(default_factory=list)
    inter_token_latency: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)


class StatsObserver(Protocol):
    def on_step(self, scheduler: SchedulerStats, iteration: IterationStats) -> None: ...
