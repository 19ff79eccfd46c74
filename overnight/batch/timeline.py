"""What the schedule did in a run: where the time went, how much of the prompt the prefix cache served,
and how long the tail lasted (the stretch at the end where fewer than max_num_seqs / 4 requests ran,
the batch nearly empty while the last answers finish).

The runner adds the time of each phase as it goes and calls step() after every engine step with the
engine's counters; nothing here reaches into the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from overnight.engine.scheduler import SchedulerStats

PHASES = ("read", "tokenize", "engine", "write")


@dataclass
class Timeline:
    schedule: str  # lookahead | fifo
    window: int  # look-ahead window (requests read ahead of the engine)
    max_num_seqs: int
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    steps: int = 0  # engine steps: unlike time, the same on a busy machine
    first_step: float | None = None
    last_step: float | None = None
    last_busy: float | None = None  # end of the last step with running >= max_num_seqs / 4
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache during the run
    prefix_hits: int = 0
    preemptions: int = 0
    spilled: int = 0  # lines that waited in the spill
    peak_held: int = 0  # most lines waiting in the spill at once
    _base: SchedulerStats | None = None

    def start(self, stats: SchedulerStats) -> None:
        """The engine's cumulative counters before the run (an engine may serve several runs)."""
        self._base = stats

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] += seconds

    def step(self, stats: SchedulerStats, started: float, now: float) -> None:
        self.steps += 1
        if self.first_step is None:
            self.first_step = started
        self.last_step = now
        if stats.num_running >= self.max_num_seqs / 4:
            self.last_busy = now
        base = self._base or SchedulerStats(0, 0, 0.0, 0, 0, 0)
        self.prefix_queries = stats.prefix_cache_queries - base.prefix_cache_queries
        self.prefix_hits = stats.prefix_cache_hits - base.prefix_cache_hits
        self.preemptions = stats.num_preemptions_total - base.num_preemptions_total

    @property
    def engine_span_s(self) -> float:
        if self.first_step is None or self.last_step is None:
            return 0.0
        return self.last_step - self.first_step

    @property
    def tail_s(self) -> float:
        """From the last step the batch was at least a quarter full to the last step (all of the run
        when it never was)."""
        if self.last_step is None or self.first_step is None:
            return 0.0
        return self.last_step - (self.last_busy if self.last_busy is not None else self.first_step)

    @property
    def prefix_hit_rate(self) -> float | None:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else None

    def as_dict(self) -> dict[str, Any]:
        rate = self.prefix_hit_rate
        return {
            "schedule": self.schedule,
            "lookahead_window": self.window if self.schedule == "lookahead" else None,
            "prefix_cache_hit_rate": None if rate is None else round(rate, 4),
            "prefix_cache_queries": self.prefix_queries,
            "prefix_cache_hits": self.prefix_hits,
            "preemptions": self.preemptions,
            "engine_steps": self.steps,
            "engine_span_s": round(self.engine_span_s, 3),
            "tail_s": round(self.tail_s, 3),
            "tail_running_below": self.max_num_seqs / 4,
            "time_s": {k: round(v, 3) for k, v in self.seconds.items()},
            "spilled_lines": self.spilled,
            "peak_spilled_waiting": self.peak_held,
        }

    def text(self) -> list[str]:
        rate = self.prefix_hit_rate
        how = f"lookahead (window {self.window})" if self.schedule == "lookahead" else "fifo"
        hits = "no lookups seen" if rate is None else f"{rate:.1%} of prompt tokens hit"
        lines = [
            f"  schedule: {how}; prefix cache {hits}; {self.preemptions} preemptions",
            f"  tail: {self.tail_s:.1f} s of {self.engine_span_s:.1f} s ({self.steps} steps) with fewer "
            f"than {self.max_num_seqs / 4:g} running",
            "  time: " + ", ".join(f"{k} {v:.1f} s" for k, v in self.seconds.items()),
        ]
        if self.spilled:
            lines.append(
                f"  spill: {self.spilled} lines waited on disk for an earlier line "
                f"(at most {self.peak_held} at once)"
            )
        return lines
