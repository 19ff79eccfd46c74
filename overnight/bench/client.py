"""One streaming /v1/completions request against any OpenAI-compatible server, with the arrival time
of every token.

Servers show their tokens differently, so how chunks are counted is a choice (token_timing):

    usage     stream_options.continuous_usage_stats: every chunk carries the usage so far, so a chunk
              merging several steps counts right (ours and vLLM's). The cheapest for the server.
    logprobs  logprobs=0: a chunk lists its tokens (servers without the usage extension; a server
              without a tokenizer streams no text, so only logprobs show when tokens arrived)
    text      one token per chunk with text or an empty text (servers that send one chunk a token)

Whatever the timing, the stream's usage (the last chunk's, or any chunk's) gives the exact total:
tokens no chunk showed are counted when the stream ends. A server that sends usage with choices, in
the last chunk only, or not at all is read the same way.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import httpx

PromptT = str | list[int]  # text, or token ids (the completions API takes either)


class RequestSpec(Protocol):
    """What one request needs of the load's spec (load.py's LoadSpec)."""

    @property
    def model(self) -> str: ...

    @property
    def token_timing(self) -> str: ...


TIMINGS = ("usage", "logprobs", "text")

# (new output tokens, prompt tokens credited when the first token arrives): the load's live counters.
Progress = Callable[[int, int], None]


@dataclass
class RequestRecord:
    start: float
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    end: float | None = None  # the stream finished; None: cut at the stop, or failed
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None
    # A closed-loop worker's first request, its answer cut to a random length to spread the workers'
    # phases (load.py): not one of the workload's requests, so the steady-state ratio leaves it out.
    shortened: bool = False


def request_body(spec: RequestSpec, prompt: PromptT, max_tokens: int) -> dict[str, object]:
    options: dict[str, object] = {"include_usage": True}
    if spec.token_timing == "usage":
        options["continuous_usage_stats"] = True
    body: dict[str, object] = {
        "model": spec.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": options,
    }
    if spec.token_timing == "logprobs":
        body["logprobs"] = 0  # the sampled token's only: the cheapest way to see each token
    return body


async def send_one(
    client: httpx.AsyncClient,
    spec: RequestSpec,
    prompt: PromptT,
    max_tokens: int,
    rec: RequestRecord,
    progress: Progress | None = None,
) -> None:
    if isinstance(prompt, list):
        rec.prompt_tokens = len(prompt)  # known before the usage chunk, which a cut stream never gets
    counter = ChunkCounter(spec.token_timing)
    try:
        async with client.stream("POST", "/v1/completions", json=request_body(spec, prompt, max_tokens)) as r:
            if r.status_code != 200:
                await r.aread()
                rec.error = f"HTTP {r.status_code}: {r.text[:200]}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.monotonic()
                chunk = json.loads(data)
                if chunk.get("error"):
                    rec.error = str(chunk["error"].get("message", chunk["error"]))[:200]
                    return
                usage = chunk.get("usage")
                if usage:
                    rec.prompt_tokens = usage.get("prompt_tokens") or rec.prompt_tokens
                    rec.output_tokens = usage.get("completion_tokens") or 0
                n = counter.count(chunk)
                if n:
                    _note(rec, now, n, progress)
    except (httpx.HTTPError, ValueError) as e:
        rec.error = f"{type(e).__name__}: {e}"[:200]
        return
    rec.end = time.monotonic()
    missing = rec.output_tokens - sum(rec.chunk_tokens)
    if missing > 0:  # merged text, or a server that streams no per-token chunks
        _note(rec, rec.end, missing, progress)
    if not rec.output_tokens:
        rec.output_tokens = sum(rec.chunk_tokens)


def _note(rec: RequestRecord, t: float, n: int, progress: Progress | None) -> None:
    first = not rec.chunk_times
    rec.chunk_times.append(t)
    rec.chunk_tokens.append(n)
    if progress is not None:
        progress(n, rec.prompt_tokens if first else 0)


class ChunkCounter:
    """Output tokens each chunk of one stream brings."""

    def __init__(self, timing: str) -> None:
        if timing not in TIMINGS:
            raise ValueError(f"token timing must be one of {TIMINGS}, got {timing!r}")
        self.timing = timing
        self.seen = 0  # tokens counted so far

    def count(self, chunk: dict) -> int:
        usage = chunk.get("usage")
        if self.timing == "usage" and usage and usage.get("completion_tokens") is not None:
            n = max(int(usage["completion_tokens"]) - self.seen, 0)
        else:  # no usage on this chunk (or not asked for): read the choices
            n = sum(chunk_tokens(c) for c in chunk.get("choices") or ())
        self.seen += n
        return n


def chunk_tokens(choice: dict) -> int:
    lp = choice.get("logprobs")
    if lp and lp.get("tokens") is not None:
        return len(lp["tokens"])
    # One chunk per generated token, with empty text when the token shows none yet (no tokenizer,
    # or text held back); a final chunk with only a finish reason carries no token.
    if choice.get("text") or (choice.get("finish_reason") is None and "text" in choice):
        return 1
    return 0
