"""Drives the offline engine over a stream of batch lines, writing each line's result as it finishes.

    read a line -> check it -> add its engine requests (one per prompt) -> engine.step() ...
        -> when all of a line's requests are done: build the response body -> write (in the order asked)

Lines are admitted only while the sequences in flight stay under `max_in_flight` (a few times
max_num_seqs: enough waiting work to refill the batch each step, no more) and the output order has room,
so memory holds the requests in flight and the reorder window, never the file.

Skip rules on resume (the output already answers some lines): a custom_id the output answers is skipped
the first time it appears; a later line with the same custom_id is a duplicate and gets an error line
(unless that error line was written already: those are remembered by input line number).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from overnight.batch.ordering import OutputOrder
from overnight.batch.output import Answered, Sink
from overnight.batch.progress import Progress
from overnight.batch.reader import BatchLine
from overnight.batch.records import error_record, success_record
from overnight.batch.summary import Summary
from overnight.engine.interfaces import EngineClient
from overnight.errors import InvalidRequestError
from overnight.openai_api.convert import chat_completion, completion
from overnight.openai_api.embeddings import embedding_response
from overnight.openai_api.errors import ApiError
from overnight.openai_api.inputs import prepare
from overnight.openai_api.protocol import AnyRequest, ChatCompletionRequest, EmbeddingRequest
from overnight.outputs import EngineOutput, PoolingRequestOutput, RequestOutput


@dataclass(slots=True)
class _Line:
    """A line whose engine requests are running."""

    seq: int
    line_no: int
    custom_id: str
    request: AnyRequest
    outputs: list[EngineOutput | None]
    num_seqs: int  # engine sequences it holds: prompts x n
    remaining: int  # prompts not yet finished
    created: int


class BatchRunner:
    def __init__(
        self,
        engine: EngineClient,
        sink: Sink,
        summary: Summary,
        *,
        model_name: str,
        names: Collection[str],
        order: OutputOrder,
        max_in_flight: int,
        answered: Answered | None = None,
        progress: Progress | None = None,
    ) -> None:
        self.engine = engine
        self.sink = sink
        self.summary = summary
        self.model_name = model_name
        self.names = names
        self.order = order
        self.max_in_flight = max_in_flight
        self.answered = answered or Answered()
        self.progress = progress
        self.active: dict[int, _Line] = {}
        self.seqs_in_flight = 0
        self._seen: set[str] = set()

    def run(self, lines: Iterable[BatchLine]) -> None:
        """Serve every line; on any exit (done, Ctrl-C, an engine failure) all finished results are written
        and the engine is left empty. Unfinished lines are not written, so --resume runs them again."""
        it = iter(lines)
        exhausted = False
        try:
            while True:
                while not exhausted and self.seqs_in_flight < self.max_in_flight and self.order.has_room:
                    line = next(it, None)
                    if line is None:
                        exhausted = True
                    else:
                        self._admit(line)
                if not self.active:
                    if exhausted:
                        break
                    continue
                for out in self.engine.step():
                    if out.finished:
                        self._on_finished(out)
        finally:
            self._abort_all()
            self._write(self.order.drain())

    # -- admitting lines --------------------------------------------------------------------------

    def _admit(self, line: BatchLine) -> None:
        if line.line_no in self.answered.lines:
            self.summary.skipped += 1
            return
        cid = line.custom_id
        if cid is not None:
            if cid in self._seen:
                self._fail(
                    line,
                    ApiError(
                        "duplicate_custom_id", f"custom_id {cid!r} is used by an earlier line", "custom_id"
                    ),
                )
                return
            self._seen.add(cid)
            if cid in self.answered.custom_ids:
                self.summary.skipped += 1
                return
        if line.error is not None or line.request is None or cid is None:
            self._fail(line, line.error or ApiError("invalid_line", "the line could not be read"))
            return
        req = line.request
        try:
            inputs = prepare(
                req,
                self.engine.tokenizer,
                self.engine.max_model_len,
                self.names,
                self.engine.validate,
                runner=self.engine.config.model.runner,
            )
        except ApiError as e:
            self._fail(line, e)
            return
        seq = self.order.start()
        state = _Line(
            seq,
            line.line_no,
            cid,
            req,
            [None] * len(inputs.prompts),
            num_seqs=inputs.num_seqs,
            remaining=len(inputs.prompts),
            created=int(time.time()),
        )
        for p, (text, ids) in enumerate(inputs.prompts):
            try:
                self.engine.add_request(f"{seq}.{p}", ids, inputs.params, prompt=text)
            except InvalidRequestError as e:  # checked in prepare; kept so a miss costs a line, not the run
                for q in range(p):
                    self.engine.abort_request(f"{seq}.{q}")
                self._finish(seq, error_record(cid, line.line_no, ApiError.from_exception(e)))
                self.summary.add_failure("invalid_request")
                return
        self.active[seq] = state
        self.seqs_in_flight += state.num_seqs

    def _fail(self, line: BatchLine, error: ApiError) -> None:
        seq = self.order.start()
        self.summary.add_failure(error.code)
        self._finish(seq, error_record(line.custom_id, line.line_no, error))

    # -- finishing lines --------------------------------------------------------------------------

    def _on_finished(self, out: EngineOutput) -> None:
        seq_text, _, prompt_text = out.request_id.rpartition(".")
        state = self.active.get(int(seq_text))
        if state is None:
            return
        state.outputs[int(prompt_text)] = out
        state.remaining -= 1
        if state.remaining:
            return
        del self.active[state.seq]
        self.seqs_in_flight -= state.num_seqs
        outputs = [o for o in state.outputs if o is not None]
        record = self._response(state, outputs)
        self._finish(state.seq, record)

    def _response(self, state: _Line, vectors_or_texts: list[EngineOutput]) -> dict:
        req = state.request
        if isinstance(req, EmbeddingRequest):  # an aborted pooling request has no output: never here
            pooled = [o for o in vectors_or_texts if isinstance(o, PoolingRequestOutput)]
            body = embedding_response(pooled, self.model_name, req.encoding_format, created=state.created)
            self.summary.add_ok(body["usage"]["prompt_tokens"], 0)
            return success_record(state.custom_id, body)
        outputs = [o for o in vectors_or_texts if isinstance(o, RequestOutput)]
        if any(c.finish_reason == "abort" for o in outputs for c in o.outputs):
            self.summary.add_failure("aborted")
            return error_record(
                state.custom_id, state.line_no, ApiError("aborted", "the request was aborted")
            )
        if isinstance(req, ChatCompletionRequest):
            body = chat_completion(
                outputs[0], self.model_name, created=state.created, num_logprobs=req.num_logprobs
            )
        else:
            body = completion(outputs, self.model_name, created=state.created)
        usage = body["usage"]
        self.summary.add_ok(usage["prompt_tokens"], usage["completion_tokens"])
        return success_record(state.custom_id, body)

    def _finish(self, seq: int, record: dict) -> None:
        self._write(self.order.finish(seq, record))
        if self.progress is not None:
            self.progress.update()

    def _write(self, records: list[dict]) -> None:
        for record in records:
            self.sink.write(record)

    def _abort_all(self) -> None:
        for state in self.active.values():
            for p in range(len(state.outputs)):
                self.engine.abort_request(f"{state.seq}.{p}")
        self.active.clear()
        self.seqs_in_flight = 0
