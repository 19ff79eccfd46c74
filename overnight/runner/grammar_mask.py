"""The token mask of a step's structured rows: built on the host, copied to the device, applied by the
sampler before it draws (runner/sampler.py, kernels/token_bitmask.py).

When. ModelRunner.launch enqueues the step's forward pass and logits first; only then, and only when a
sampled row is structured, it waits for the previous step's tokens (on CUDA that step may still be
running), lets each matcher accept its request's new tokens, fills one bitmask for all structured rows
and enqueues the copy and the sampling. The GPU runs this step's forward pass meanwhile, so the one-step
lead of the host over the device is kept; a batch without structured rows does none of this.

Consistency. A matcher consumes exactly the request's output tokens known on the host
(RunnerRequest.token_ids past the prompt), in order, before each mask, so it follows the tokens wherever
they come from: a preempted request loses its runner state and the resumed one builds a new matcher that
replays the outputs it had; n > 1 children are separate requests with their own matchers; a tensor
parallel rank that adopted rank 0's token replays that one. When the grammar is complete the mask allows
only the stop tokens (EOS), so the request ends with finish_reason "stop".

Memory layout of the host buffer (pinned on CUDA), one row per structured sampled row, in row order:

    bitmask [max_rows, ceil(V / 32)] int32    rows [max_rows] int64 (index into the step's logits)
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch

from overnight.runner.request_state import Guide, RunnerRequest
from overnight.runner.sampler import TokenMask

if TYPE_CHECKING:
    import xgrammar as xgr

    from overnight.structured.compiler import GrammarCompiler

log = logging.getLogger("overnight")


class GrammarMask:
    def __init__(self, compiler: GrammarCompiler, max_rows: int, device: torch.device) -> None:
        self.compiler = compiler
        self.max_rows = max_rows
        self.device = device
        self.words = -(-compiler.vocab_size // 32)
        self._stops = frozenset(compiler.stop_token_ids)
        self._host: torch.Tensor | None = None  # allocated on the first structured step
        self._rows_host: torch.Tensor | None = None
        self._dev: torch.Tensor | None = None
        self._rows_dev: torch.Tensor | None = None
        self._batch: xgr.BatchGrammarMatcher | None = None

    def build(self, sampled: list[RunnerRequest]) -> TokenMask | None:
        """The mask of the structured rows among `sampled` (the step's sampled requests in row order),
        or None when none is structured. Every token the requests sampled before must be on the host."""
        rows: list[int] = []
        guides: list[Guide] = []
        for i, st in enumerate(sampled):
            params = st.params.structured_outputs
            if params is None:
                continue
            if st.guide is None:
                st.guide = Guide(self.compiler.matcher(params), waiting_for=params.start_after or None)
            rows.append(i)
            guides.append(st.guide)
        if not rows:
            return None
        self._catch_up([sampled[i] for i in rows])
        return self._fill(rows, guides)

    # -- matchers ---------------------------------------------------------------------------------

    def _catch_up(self, reqs: list[RunnerRequest]) -> None:
        """Each matcher accepts the output tokens it has not seen: one per request in steady state (in
        one batched call), a whole output after a resume."""
        import xgrammar as xgr

        single_m: list[xgr.GrammarMatcher] = []
        single_t: list[int] = []
        single_r: list[RunnerRequest] = []
        for st in reqs:
            g = st.guide
            assert g is not None
            if st.num_pending != 1:  # only this step's own sample may be outstanding
                raise RuntimeError(f"request {st.req_id}: a mask needs every earlier token on the host")
            start = st.num_prompt_tokens + g.consumed
            new = len(st.token_ids) - start
            if new == 0 or g.ended:
                g.consumed += new
                continue
            if g.waiting_for is not None:
                start = self._wait_for_marker(g, st.token_ids, start)
                new = len(st.token_ids) - start
                if g.waiting_for is not None or new == 0:
                    continue
            if new == 1:
                single_m.append(g.matcher)
                single_t.append(st.token_ids[start])
                single_r.append(st)
                continue
            for tok in st.token_ids[start:]:
                self._accepted(st.req_id, g, tok, g.matcher.accept_token(tok))
                if g.ended:
                    break
            g.consumed += new
        if single_m:
            accepted = xgr.BatchGrammarMatcher.batch_accept_token(single_m, single_t)
            for st, ok, tok in zip(single_r, accepted, single_t):
                g = st.guide
                assert g is not None
                g.consumed += 1
                self._accepted(st.req_id, g, tok, ok)

    def _wait_for_marker(self, g: Guide, token_ids: list[int], start: int) -> int:
        """Reads the tokens from `start` until the output shows g.waiting_for; returns the index of the
        first token the grammar sees (past the marker's last token). Only rows still waiting pay this
        per-token decode, and only until their reasoning ends."""
        marker = g.waiting_for
        assert marker is not None
        for i in range(start, len(token_ids)):
            g.consumed += 1
            g.tail = (g.tail + self.compiler.token_text(token_ids[i]))[-(2 * len(marker) + 16) :]
            if marker in g.tail:
                g.waiting_for = None
                return i + 1
        return len(token_ids)

    def _accepted(self, req_id: str, g: Guide, tok: int, ok: bool) -> None:
        if not ok:
            g.ended = True
            log.warning(
                "request %s: token %d is not allowed by its grammar; ending it at the next step", req_id, tok
            )
        elif tok in self._stops:
            g.ended = True

    # -- the mask ---------------------------------------------------------------------------------

    def _fill(self, rows: list[int], guides: list[Guide]) -> TokenMask:
        import xgrammar as xgr

        if self._host is None:
            pin = self.device.type == "cuda"
            self._host = torch.zeros((self.max_rows, self.words), dtype=torch.int32, pin_memory=pin)
            self._rows_host = torch.zeros(self.max_rows, dtype=torch.int64, pin_memory=pin)
            if pin:
                self._dev = torch.zeros_like(self._host, device=self.device)
                self._rows_dev = torch.zeros_like(self._rows_host, device=self.device)
            self._batch = xgr.BatchGrammarMatcher(min(8, max(1, (os.cpu_count() or 2) // 2)))
        assert self._rows_host is not None and self._batch is not None
        k = len(rows)
        host = self._host[:k]
        live = [j for j, g in enumerate(guides) if not g.ended and g.waiting_for is None]
        if len(live) == k:
            self._batch.batch_fill_next_token_bitmask([g.matcher for g in guides], host)
        else:
            if live:
                self._batch.batch_fill_next_token_bitmask([guides[j].matcher for j in live], host, live)
            for j, g in enumerate(guides):
                if g.ended:
                    self._only_stop_tokens(host[j])
                elif g.waiting_for is not None:
                    host[j].fill_(-1)  # every token allowed until the grammar starts
        self._rows_host[:k] = torch.tensor(rows, dtype=torch.int64)
        if self._dev is None:  # CPU: the host buffers are the device's
            return TokenMask(host, self._rows_host[:k])
        # The host buffers are refilled only after this step's tokens were read (the next structured
        # step waits for them first), so these asynchronous copies have long finished by then.
        assert self._rows_dev is not None
        dev = self._dev[:k]
        dev.copy_(host, non_blocking=True)
        rows_dev = self._rows_dev[:k]
        rows_dev.copy_(self._rows_host[:k], non_blocking=True)
        return TokenMask(dev, rows_dev)

    def _only_stop_tokens(self, row: torch.Tensor) -> None:
        row.zero_()
        for t in self.compiler.stop_token_ids:
            word, bit = divmod(t, 32)
            row[word] |= 1 << bit if bit < 31 else -(1 << 31)
