"""The progress bar: lines done (of the total when the input is a file), ok / failed, input and output
tokens per second, and tqdm's ETA."""

from __future__ import annotations

import time

from overnight.batch.summary import Summary

_REFRESH_S = 0.5


class Progress:
    def __init__(self, total: int | None, summary: Summary, enabled: bool = True) -> None:
        self.summary = summary
        self.bar = None
        self._last = 0.0
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc="Batch", unit="req", dynamic_ncols=True, smoothing=0.1)

    def update(self, lines: int = 1) -> None:
        if self.bar is None:
            return
        self.bar.update(lines)
        now = time.perf_counter()
        if now - self._last >= _REFRESH_S:  # formatting every line would cost more than the bar is worth
            self._last = now
            self._postfix()

    def _postfix(self) -> None:
        assert self.bar is not None
        s = self.summary
        elapsed = max(s.elapsed, 1e-9)
        self.bar.set_postfix_str(
            f"ok {s.ok}, failed {s.failed}, in {s.prompt_tokens / elapsed:.0f} tok/s, "
            f"out {s.completion_tokens / elapsed:.0f} tok/s",
            refresh=False,
        )

    def close(self) -> None:
        if self.bar is not None:
            self._postfix()
            self.bar.close()
