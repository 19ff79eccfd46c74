"""What a batch run did: lines ok / failed / skipped, tokens, time, throughput; on stderr and as JSON."""

from __future__ import annotations

import json
import resource
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from overnight.batch.timeline import Timeline


def peak_rss_mib() -> float:
    """This process's peak resident memory so far (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


@dataclass
class Summary:
    input: str
    output: str
    model: str | None = None
    ok: int = 0
    failed: int = 0
    skipped: int = 0  # answered by an earlier run (--resume)
    recovered: int = 0  # answered by an earlier run, placed from its spill (--resume)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    errors_by_code: Counter[str] = field(default_factory=Counter)
    status: str = "completed"  # completed | interrupted | failed
    start: float = field(default_factory=time.perf_counter)
    end: float | None = None
    timeline: Timeline | None = None  # what the schedule did

    def add_ok(self, prompt_tokens: int, completion_tokens: int) -> None:
        self.ok += 1
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens

    def add_failure(self, code: str) -> None:
        self.failed += 1
        self.errors_by_code[code] += 1

    @property
    def done(self) -> int:
        return self.ok + self.failed + self.recovered

    @property
    def elapsed(self) -> float:
        return (self.end or time.perf_counter()) - self.start

    def finish(self, status: str = "completed") -> None:
        self.status = status
        self.end = time.perf_counter()

    def as_dict(self) -> dict[str, Any]:
        elapsed = max(self.elapsed, 1e-9)
        return {
            "status": self.status,
            "input": self.input,
            "output": self.output,
            "model": self.model,
            "lines": self.done + self.skipped,
            # As the OpenAI Batch API's batch object counts them (this run's lines).
            "request_counts": {
                "total": self.done,
                "completed": self.ok + self.recovered,
                "failed": self.failed,
            },
            "ok": self.ok,
            "failed": self.failed,
            "skipped": self.skipped,
            "recovered_from_spill": self.recovered,
            "errors_by_code": dict(sorted(self.errors_by_code.items())),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "elapsed_s": round(self.elapsed, 3),
            "requests_per_s": round(self.done / elapsed, 3),
            "input_tokens_per_s": round(self.prompt_tokens / elapsed, 1),
            "output_tokens_per_s": round(self.completion_tokens / elapsed, 1),
            "peak_rss_mib": round(peak_rss_mib(), 1),
            "schedule": self.timeline.as_dict() if self.timeline is not None else None,
        }

    def text(self) -> str:
        d = self.as_dict()
        lines = [
            f"run-batch {d['status']}: {d['ok']} ok, {d['failed']} failed"
            + (f", {d['skipped']} skipped (answered by an earlier run)" if d["skipped"] else "")
            + (f", {d['recovered_from_spill']} placed from the spill" if d["recovered_from_spill"] else "")
            + f" in {d['elapsed_s']:.1f} s",
            f"  tokens: {d['prompt_tokens']} in, {d['completion_tokens']} out; "
            f"{d['input_tokens_per_s']:.1f} in tok/s, {d['output_tokens_per_s']:.1f} out tok/s, "
            f"{d['requests_per_s']:.2f} req/s",
        ]
        if d["errors_by_code"]:
            lines.append(
                "  failures by code: " + ", ".join(f"{k} {v}" for k, v in d["errors_by_code"].items())
            )
        if self.timeline is not None:
            lines += self.timeline.text()
        lines.append(f"  output: {d['output']}")
        return "\n".join(lines)

    def write_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.as_dict(), f, indent=2)
            f.write("\n")
