"""Merging streamed deltas that queued up for one response, so they go out as one chunk.

When the event loop falls behind the engine (a step delivers to a thousand streams at once), several
steps' deltas wait in a response's queue. Sending them as one SSE chunk costs the loop one JSON
encoding and one socket write instead of several: the loop's work per token falls exactly when it is
the bottleneck, and a loop that keeps up still sends a chunk per step.

`--stream-interval N` (vLLM's option of that name) goes further on purpose: a stream's deltas are held
until they carry N new tokens (or the request ends), so the loop encodes and writes about one chunk per
N tokens even while it keeps up. On the H200 the HTTP process's loop was the server's limit at 512
clients (bench/server_cost_cpu.py shows the loop's cost per token); N trades a little latency per token for that headroom.
"""

from __future__ import annotations

from dataclasses import replace

from overnight.outputs import CompletionOutput, EngineOutput, RequestOutput


def merge(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """One delta holding both: text, token ids and logprobs concatenated per choice; finish state,
    metrics and cache hits from the newer."""
    by_index = {c.index: c for c in older.outputs}
    for c in newer.outputs:
        before = by_index.get(c.index)
        by_index[c.index] = c if before is None else _merge_completion(before, c)
    return replace(newer, outputs=sorted(by_index.values(), key=lambda c: c.index))


def coalesce(items: list[tuple[int, EngineOutput]]) -> list[tuple[int, EngineOutput]]:
    """(prompt index, output) pairs in arrival order -> one pair per prompt index, deltas merged,
    in the order each index first appeared. Whole (non-delta) outputs and pooled vectors (one per
    request) pass as they are."""
    merged: dict[int, EngineOutput] = {}
    for index, out in items:
        before = merged.get(index)
        if isinstance(before, RequestOutput) and isinstance(out, RequestOutput) and out.delta:
            merged[index] = merge(before, out)
        else:
            merged[index] = out
    return list(merged.items())


class Pacer:
    """Holds a stream's deltas until one of its choices has `interval` new tokens, or it finished."""

    def __init__(self, interval: int) -> None:
        self.interval = interval  # >= 1: ServerOptions refuses less
        self._held: dict[int, RequestOutput] = {}

    def due(self, batch: list[tuple[int, EngineOutput]]) -> list[tuple[int, EngineOutput]]:
        """What of `batch` (coalesced: one entry per index) goes out now, merged with what was held."""
        out: list[tuple[int, EngineOutput]] = []
        for index, item in batch:
            held = self._held.pop(index, None)
            if not isinstance(item, RequestOutput) or not item.delta:
                out.append((index, item))
                continue
            item = item if held is None else merge(held, item)
            if item.finished or max((len(c.token_ids) for c in item.outputs), default=0) >= self.interval:
                out.append((index, item))
            else:
                self._held[index] = item
        return out

    def flush(self) -> list[tuple[int, EngineOutput]]:
        """Everything held (before an error ends the stream: what came before it is still sent)."""
        out: list[tuple[int, EngineOutput]] = list(self._held.items())
        self._held.clear()
        return out


def _merge_completion(a: CompletionOutput, b: CompletionOutput) -> CompletionOutput:
    logprobs = None
    if a.logprobs is not None or b.logprobs is not None:
        logprobs = (a.logprobs or []) + (b.logprobs or [])
    return replace(
        b,
        text=a.text + b.text,
        token_ids=a.token_ids + b.token_ids,
        logprobs=logprobs,
    )
