"""Turns sampled tokens into RequestOutputs: text, stop strings, logprobs, and the n > 1 fan-in.

Detokenizing every token of every request costs host time that grows with the batch, so text is built
incrementally only where it is needed (stop strings, streaming); other requests decode once at the end.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from overnight.engine.request import Request
from overnight.engine.step_io import PromptTokenLogprobs, TokenLogprobs
from overnight.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestMetrics, RequestOutput

if TYPE_CHECKING:
    from overnight.tokenizer.detokenizer import IncrementalDetokenizer
    from overnight.tokenizer.tokenizer import Tokenizer


@dataclass
class ParentRequest:
    """What the user submitted: one prompt and its n completions (best_of generated, when larger)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    n: int  # completions generated
    stream: bool
    metrics: RequestMetrics
    completions: list[CompletionOutput] = field(default_factory=list)
    # Its children's output state, so a step touches only its own (a scan of every child per parent
    # cost O(running^2) a step: 23 ms at 1024 streams).
    kids: list[_Child] = field(default_factory=list)
    num_finished: int = 0
    num_cached_tokens: int = 0
    num_returned: int | None = None  # best_of: the n with the highest cumulative logprob; None: all
    prompt_logprobs: PromptLogprobs | None = None  # filled from the first completion's prefill
    prompt_logprobs_sent: bool = False

    @property
    def finished(self) -> bool:
        return self.num_finished == self.n


@dataclass
class _Child:
    req: Request
    parent: ParentRequest
    index: int
    detok: IncrementalDetokenizer | None  # when text is built token by token
    stop_window: int  # characters held back while streaming, so a partial stop string is never sent
    sent_text: int = 0
    sent_tokens: int = 0
    sent_logprobs: int = 0
    final_sent: bool = False
    # Nothing to do per token (no streaming, stop strings or logprobs): the token ids are taken
    # from the request once it finishes. Keeps host work per step small for batch jobs.
    plain: bool = False


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.children: dict[str, _Child] = {}

    def add(self, req: Request, parent: ParentRequest, index: int) -> None:
        params = req.params
        detok = None
        if params.detokenize and self.tokenizer is not None and (params.stop_strings or parent.stream):
            from overnight.tokenizer.detokenizer import IncrementalDetokenizer

            detok = IncrementalDetokenizer(
                self.tokenizer, req.prompt_token_ids, skip_special_tokens=params.skip_special_tokens
            )
        window = max((len(s) for s in params.stop_strings), default=1) - 1
        if params.include_stop_str_in_output:
            window = 0
        tracks_logprob = params.sampled_logprobs is not None
        completion = CompletionOutput(
            index=index,
            text="",
            token_ids=[],
            cumulative_logprob=0.0 if tracks_logprob else None,
            logprobs=[] if params.logprobs is not None else None,
        )
        parent.completions.append(completion)
        if index == 0 and params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None]
        plain = detok is None and not parent.stream and not tracks_logprob
        child = _Child(req, parent, index, detok, window, plain=plain)
        self.children[req.req_id] = child
        parent.kids.append(child)

    def drop(self, req_id: str) -> None:
        self.children.pop(req_id, None)

    def add_prompt_logprobs(self, scored: dict[str, PromptTokenLogprobs]) -> None:
        """Fold in the prompt tokens a step scored. Positions already held are skipped: a request
        recomputed after a preemption scores them again."""
        for req_id, chunk in scored.items():
            child = self.children.get(req_id)
            if child is None or child.parent.prompt_logprobs is None or child.index != 0:
                continue
            held = child.parent.prompt_logprobs
            k = child.req.params.prompt_logprobs or 0
            ids = child.parent.prompt_token_ids
            for i in range(max(len(held) - chunk.start, 0), len(chunk.logprobs)):
                pos = chunk.start + i
                entry = {
                    tid: Logprob(value, rank, self._token_text(tid))
                    for rank, (tid, value) in enumerate(
                        zip(chunk.top_ids[i][:k], chunk.top_logprobs[i][:k]), start=1
                    )
                }
                if ids[pos] not in entry:
                    entry[ids[pos]] = Logprob(chunk.logprobs[i], chunk.ranks[i], self._token_text(ids[pos]))
                held.append(entry)

    def process(
        self,
        advanced: list[Request],
        logprobs: dict[str, TokenLogprobs],
        finished: list[Request],
    ) -> tuple[list[RequestOutput], list[tuple[Request, str]]]:
        """Returns the outputs to hand back, and the requests a stop string ended (for the scheduler)."""
        stopped: list[tuple[Request, str]] = []
        touched: dict[str, ParentRequest] = {}
        children = self.children
        for req in advanced:
            child = children.get(req.req_id)
            if child is None or child.plain:
                continue
            comp = child.parent.completions[child.index]
            token = req.all_token_ids[-1]
            comp.token_ids.append(token)
            lp = logprobs.get(req.req_id)
            if lp is not None:
                if comp.logprobs is not None:
                    comp.logprobs.append(self._logprob_dict(lp, token, req.params.logprobs or 0))
                comp.cumulative_logprob = (comp.cumulative_logprob or 0.0) + lp.sampled_logprob
            if child.detok is not None:
                delta = child.detok.append([token])
                if delta:
                    comp.text += delta
                    hit = self._find_stop(comp, req, len(delta))
                    if hit is not None and not req.is_finished:
                        stopped.append((req, hit))
            if child.parent.stream:
                touched[child.parent.request_id] = child.parent
        for req, stop_str in stopped:
            req.stop_reason = stop_str
        now = time.monotonic()
        done = finished + [r for r, _ in stopped]
        for req in done:
            child = self.children.get(req.req_id)
            if child is None:
                continue
            self._complete(child, req, now)
            child.parent.num_finished += 1
            if child.parent.finished:
                child.parent.metrics.finished_time = now
            touched[child.parent.request_id] = child.parent
        outputs = []
        for parent in touched.values():
            if parent.stream:
                outputs.append(self._delta_output(parent))
            elif parent.finished:
                outputs.append(self._full_output(parent))
        for req in done:
            child = self.children.get(req.req_id)
            if child is not None and child.parent.finished:
                for sibling in self._siblings(child.parent):
                    self.children.pop(sibling, None)
        return outputs, stopped

    def abort(self, req: Request) -> RequestOutput | None:
        """Mark an aborted request's completion; returns its parent's output once all are done."""
        child = self.children.get(req.req_id)
        if child is None:
            return None
        now = time.monotonic()
        self._complete(child, req, now)
        parent = child.parent
        parent.num_finished += 1
        if not parent.finished:
            return None
        parent.metrics.finished_time = now
        # Built before the children are dropped: a streamed delta is made from them.
        out = self._delta_output(parent) if parent.stream else self._full_output(parent)
        for sibling in self._siblings(parent):
            self.children.pop(sibling, None)
        return out

    # -- helpers ----------------------------------------------------------------------------------

    @staticmethod
    def _siblings(parent: ParentRequest) -> list[str]:
        return [c.req.req_id for c in parent.kids]

    def _find_stop(self, comp: CompletionOutput, req: Request, delta_len: int) -> str | None:
        """Look for a stop string ending in the newly added text; truncate the text at it."""
        stops = req.params.stop_strings
        if not stops:
            return None
        text = comp.text
        for stop in stops:
            start = max(0, len(text) - delta_len - len(stop) + 1)
            idx = text.find(stop, start)
            if idx >= 0:
                end = idx + len(stop) if req.params.include_stop_str_in_output else idx
                comp.text = text[:end]
                return stop
        return None

    def _complete(self, child: _Child, req: Request, now: float) -> None:
        """Final text and finish reason of one completion; `now` is the time its parent may finish at,
        so last_token_time never comes after finished_time."""
        comp = child.parent.completions[child.index]
        params = req.params
        if child.plain:
            comp.token_ids = req.output_token_ids
        if params.detokenize and self.tokenizer is not None:
            if child.detok is None:
                comp.text = self.tokenizer.decode(
                    comp.token_ids, skip_special_tokens=params.skip_special_tokens
                )
            elif not isinstance(req.stop_reason, str):  # not cut at a stop string: flush held bytes
                comp.text += child.detok.finish()
        comp.finish_reason = req.status.finish_reason or "stop"
        comp.stop_reason = req.stop_reason
        parent = child.parent
        parent.num_cached_tokens = max(parent.num_cached_tokens, req.num_cached_tokens)
        m = parent.metrics
        if req.first_scheduled_time is not None:
            m.first_scheduled_time = min(
                m.first_scheduled_time or req.first_scheduled_time, req.first_scheduled_time
            )
        if req.first_token_time is not None:
            m.first_token_time = min(m.first_token_time or req.first_token_time, req.first_token_time)
        m.last_token_time = now

    def _logprob_dict(self, lp: TokenLogprobs, token: int, k: int) -> dict[int, Logprob]:
        out: dict[int, Logprob] = {}
        for rank, (tid, value) in enumerate(zip(lp.top_ids[:k], lp.top_logprobs[:k]), start=1):
            out[tid] = Logprob(value, rank, self._token_text(tid))
        if token not in out:
            out[token] = Logprob(lp.sampled_logprob, lp.sampled_rank, self._token_text(token))
        return out

    def _token_text(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _full_output(self, parent: ParentRequest) -> RequestOutput:
        outputs = sorted(parent.completions, key=lambda c: c.index)
        keep = parent.num_returned
        if keep is not None and keep < len(outputs):  # best_of: the most likely n, renumbered
            best = sorted(outputs, key=lambda c: -(c.cumulative_logprob or 0.0))[:keep]
            outputs = sorted(best, key=lambda c: c.index)
            for i, c in enumerate(outputs):
                c.index = i
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=outputs,
            finished=True,
            metrics=parent.metrics,
            num_cached_tokens=parent.num_cached_tokens,
            prompt_logprobs=parent.prompt_logprobs,
        )

    def _delta_output(self, parent: ParentRequest) -> RequestOutput:
        deltas = []
        for child in parent.kids:
            if child.req.req_id not in self.children:  # dropped (aborted) meanwhile
                continue
            comp = parent.completions[child.index]
            is_done = comp.finish_reason is not None
            text_end = len(comp.text) if is_done else max(child.sent_text, len(comp.text) - child.stop_window)
            new_text = comp.text[child.sent_text : text_end]
            new_tokens = comp.token_ids[child.sent_tokens :]
            new_lps = comp.logprobs[child.sent_logprobs :] if comp.logprobs is not None else None
            if not new_text and not new_tokens and (not is_done or child.final_sent):
                continue
            child.sent_text, child.sent_tokens = text_end, len(comp.token_ids)
            if comp.logprobs is not None:
                child.sent_logprobs = len(comp.logprobs)
            child.final_sent = is_done
            deltas.append(
                CompletionOutput(
                    index=comp.index,
                    text=new_text,
                    token_ids=new_tokens,
                    cumulative_logprob=comp.cumulative_logprob,
                    logprobs=new_lps,
                    finish_reason=comp.finish_reason,
                    stop_reason=comp.stop_reason,
                )
            )
        prompt_logprobs = None
        if not parent.prompt_logprobs_sent and parent.prompt_logprobs is not None:
            # Sent once, with the first delta: the whole prompt was scored before the first token.
            prompt_logprobs, parent.prompt_logprobs_sent = parent.prompt_logprobs, True
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=deltas,
            finished=parent.finished,
            metrics=parent.metrics,
            num_cached_tokens=parent.num_cached_tokens,
            delta=True,
            prompt_logprobs=prompt_logprobs,
        )
