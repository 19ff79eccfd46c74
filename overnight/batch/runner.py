"""Drives the offline engine over a stream of batch lines, writing each line's result as it finishes.

    read a line -> check and tokenize it -> the look-ahead window (SubmissionOrder)
        -> submitted in the window's order: its engine requests (one per prompt) -> engine.step() ...
        -> when all of a line's requests are done: build the response body -> write (in the order asked)

A line gets its sequence number in input order when it is read; only the submission order moves
(overnight/entrypoints/submission.py). Lines are submitted while the sequences in flight stay under
`max_in_flight` (a few times max_num_seqs: enough waiting work to refill the batch each step, no
more), and read while the window has room, so memory holds the window and the requests in flight,
never the file; finished lines waiting for an earlier one wait on disk (spill.py).

Skip rules on resume (the output already answers some lines): a custom_id the output answers is skipped
the first time it appears; a later line with the same custom_id is a duplicate and gets an error line
(unless that error line was written already: those are remembered by input line number). A line whose
answer an earlier run left in the spill is placed from there.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass

from overnight.batch.ordering import OutputOrder
from overnight.batch.output import Answered, Sink
from overnight.batch.progress import Progress
from overnight.batch.reader import BatchLine
from overnight.batch.records import error_record, success_record
from overnight.batch.summary import Summary
from overnight.batch.timeline import Timeline
from overnight.engine.interfaces import EngineClient
from overnight.entrypoints.prompts import conversation_images
from overnight.entrypoints.submission import FifoOrder, SubmissionOrder, max_output_tokens
from overnight.errors import InvalidRequestError
from overnight.lora.request import LoRARequest, hash_root
from overnight.multimodal.inputs import MultiModalInputs
from overnight.multimodal.processor import ImageProcessor, no_images_reason
from overnight.openai_api.convert import response_body
from overnight.openai_api.embeddings import embedding_response
from overnight.openai_api.errors import ApiError
from overnight.openai_api.inputs import prepare
from overnight.openai_api.protocol import AnyRequest, ChatCompletionRequest, EmbeddingRequest
from overnight.openai_api.responses import ResponsesRequest
from overnight.openai_api.scores import (
    ClassificationRequest,
    RerankRequest,
    ScoreRequest,
    ScoringRequest,
    scoring_response,
)
from overnight.options import ChatOptions
from overnight.outputs import EngineOutput, PoolingRequestOutput, RequestOutput
from overnight.pooling_params import RequestParams
from overnight.sampling_params import SamplingParams
from overnight.tool_calls.message import MessagePlan


@dataclass(slots=True)
class _Line:
    """A line read and tokenized: waiting in the window, then running."""

    seq: int
    line_no: int
    custom_id: str
    request: (
        AnyRequest | ResponsesRequest | ScoringRequest
    )  # the body, for the response's shape (chat, completions, embeddings, scores; echo, ...)
    params: RequestParams
    # Until submitted. Token ids as compact arrays: the window holds thousands of lines.
    prompts: list[tuple[str | None, array]]
    outputs: list[EngineOutput | None]
    num_seqs: int  # engine sequences it holds: prompts x n
    remaining: int  # prompts not yet finished
    created: int = 0
    plan: MessagePlan | None = None  # chat: reasoning / tool calls read from the output
    lora: LoRARequest | None = None  # the adapter the body's model names (None: the base model)
    multi_modal: MultiModalInputs | None = None  # a chat line's images
    pairs: list[tuple[int, int]] | None = None  # score lines on an embedding model (EngineInputs.pairs)


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
        schedule: SubmissionOrder | None = None,
        answered: Answered | None = None,
        progress: Progress | None = None,
        chat: ChatOptions | None = None,
        adapters: Mapping[str, LoRARequest] | None = None,
        images: ImageProcessor | None = None,
    ) -> None:
        self.engine = engine
        self.images = images  # a vision-language model's image processor (None: image parts refused)
        self.chat = chat
        self.sink = sink
        self.summary = summary
        self.model_name = model_name
        self.names = names
        self.order = order
        self.max_in_flight = max_in_flight
        self.schedule = schedule if schedule is not None else FifoOrder()
        self.answered = answered or Answered()
        self.progress = progress
        self.adapters = adapters or {}  # LoRA adapters by the name a line's model gives (--lora-modules)
        pooler = engine.config.model.pooler
        classifier = pooler.classifier if pooler is not None else None
        self.labels = classifier.labels if classifier is not None else ()  # /v1/classify lines' labels
        self.embedding_scores = pooler is not None and classifier is None  # score lines: cosine similarity
        if summary.timeline is None:
            summary.timeline = Timeline("fifo", 1, engine.config.scheduler.max_num_seqs)
        self.timeline = summary.timeline
        self.waiting: dict[int, _Line] = {}  # read, not yet submitted
        self.active: dict[int, _Line] = {}  # submitted
        self.seqs_in_flight = 0
        self._seen: set[str] = set()
        self._input_done = False

    def run(self, lines: Iterable[BatchLine]) -> None:
        """Serve every line. On any exit (done, Ctrl-C, an engine failure) all finished results are
        written or kept in the spill and the engine is left empty; unfinished lines are not written, so
        --resume runs them again."""
        it = iter(lines)
        if self.images is not None:  # images decode in the pool while the engine steps
            it = self.images.prefetched(it, _image_urls)
        engine, tl = self.engine, self.timeline
        tl.start(engine.stats())
        completed = False
        try:
            while True:
                self._feed(it)
                if not self.active:
                    if self._input_done and not self.waiting:
                        break
                    self.schedule.on_step(0)  # nothing runs: nothing to wait for
                    continue
                t0 = time.perf_counter()
                outputs = engine.step()
                t1 = time.perf_counter()
                stats = engine.stats()
                self.schedule.on_step(stats.num_waiting)
                tl.add("engine", t1 - t0)
                tl.step(stats, t0, t1)
                for out in outputs:
                    if out.finished:
                        self._on_finished(out)
            completed = True
        finally:
            self._abort_all()
            t0 = time.perf_counter()
            self._write(self.order.close(completed=completed))
            tl.add("write", time.perf_counter() - t0)
            tl.spilled = self.order.spill.num_appended
            tl.peak_held = self.order.peak_held

    def _feed(self, it: Iterator[BatchLine]) -> None:
        """Read while the window has room, submit while the engine has room."""
        while True:
            while not self._input_done and self.schedule.has_room:
                t0 = time.perf_counter()
                line = next(it, None)
                self.timeline.add("read", time.perf_counter() - t0)
                if line is None:
                    self._input_done = True
                    self.schedule.close()
                else:
                    self._read(line)
            if self.seqs_in_flight >= self.max_in_flight:
                return
            seq = self.schedule.pop()
            if seq is None:
                return
            self._submit(self.waiting.pop(seq))

    # -- reading lines ----------------------------------------------------------------------------

    def _read(self, line: BatchLine) -> None:
        if line.line_no in self.answered.lines:
            self.summary.skipped += 1
            return
        cid = line.custom_id
        if cid is not None:
            if cid in self._seen:
                # Answered under "line", not the id: the output keeps one record per custom_id.
                error = ApiError(
                    "duplicate_custom_id", f"custom_id {cid!r} is used by an earlier line", "custom_id"
                )
                self._fail(line, error, keep_id=False)
                return
            self._seen.add(cid)
            if cid in self.answered.custom_ids:
                self.summary.skipped += 1
                return
        if line.error is not None or line.request is None or cid is None:
            self._fail(line, line.error or ApiError("invalid_line", "the line could not be read"))
            return
        seq = self.order.start()
        t0 = time.perf_counter()
        recovered = self.order.recover(seq, cid)
        if recovered is not None:
            self.summary.recovered += 1
            self._done(recovered)
            self.timeline.add("write", time.perf_counter() - t0)
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
                chat=self.chat,
                images=self.images,
                embedding_scores=self.embedding_scores,
                no_images=no_images_reason(self.engine.source.arch),
            )
        except ApiError as e:
            self.timeline.add("tokenize", time.perf_counter() - t0)
            self.summary.add_failure(e.code)
            self._finish(seq, error_record(cid, line.line_no, e))
            return
        state = _Line(
            seq,
            line.line_no,
            cid,
            request=req,
            params=inputs.params,
            prompts=[(text, array("i", ids)) for text, ids in inputs.prompts],
            outputs=[None] * len(inputs.prompts),
            num_seqs=inputs.num_seqs,
            remaining=len(inputs.prompts),
            plan=inputs.plan,
            lora=self.adapters.get(req.model) if req.model else None,
            multi_modal=inputs.multi_modal,
            pairs=inputs.pairs,
        )
        first = inputs.prompts[0][1]
        params = inputs.params
        max_output = (
            max_output_tokens(len(first), params.max_tokens, self.engine.max_model_len)
            if isinstance(params, SamplingParams)
            else 1  # an embedding line ends with its prompt
        )
        self.schedule.add(seq, first, max_output, hash_root(state.lora))
        self.waiting[seq] = state
        self.timeline.add("tokenize", time.perf_counter() - t0)

    def _fail(self, line: BatchLine, error: ApiError, keep_id: bool = True) -> None:
        seq = self.order.start()
        self.summary.add_failure(error.code)
        self._finish(seq, error_record(line.custom_id if keep_id else None, line.line_no, error))

    # -- submitting lines -------------------------------------------------------------------------

    def _submit(self, state: _Line) -> None:
        t0 = time.perf_counter()
        state.created = int(time.time())
        prompts, state.prompts = state.prompts, []
        for p, (text, ids) in enumerate(prompts):
            try:
                self.engine.add_request(
                    f"{state.seq}.{p}",
                    ids.tolist(),
                    state.params,
                    prompt=text,
                    lora_request=state.lora,
                    multi_modal=state.multi_modal,
                )
            except InvalidRequestError as e:  # checked in prepare; kept so a miss costs a line, not the run
                for q in range(p):
                    self.engine.abort_request(f"{state.seq}.{q}")
                self.timeline.add("engine", time.perf_counter() - t0)
                self.summary.add_failure("invalid_request")
                self._finish(
                    state.seq, error_record(state.custom_id, state.line_no, ApiError.from_exception(e))
                )
                return
        self.active[state.seq] = state
        self.seqs_in_flight += state.num_seqs
        self.timeline.add("engine", time.perf_counter() - t0)

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
        if isinstance(req, (ScoreRequest, RerankRequest, ClassificationRequest)):
            pooled = [o for o in vectors_or_texts if isinstance(o, PoolingRequestOutput)]
            body = scoring_response(
                req, pooled, self.model_name, self.labels, pairs=state.pairs, created=state.created
            )
            self.summary.add_ok(body["usage"]["prompt_tokens"], 0)
            return success_record(state.custom_id, body)
        outputs = [o for o in vectors_or_texts if isinstance(o, RequestOutput)]
        if any(c.finish_reason == "abort" for o in outputs for c in o.outputs):
            self.summary.add_failure("aborted")
            return error_record(
                state.custom_id, state.line_no, ApiError("aborted", "the request was aborted")
            )
        model = state.lora.lora_name if state.lora is not None else self.model_name
        body = response_body(
            req,
            outputs,
            model,
            created=state.created,
            tokenizer=self.engine.tokenizer,
            plan=state.plan,
        )
        usage = body["usage"]
        if "input_tokens" in usage:  # a Response's
            self.summary.add_ok(usage["input_tokens"], usage["output_tokens"])
        else:
            self.summary.add_ok(usage["prompt_tokens"], usage["completion_tokens"])
        return success_record(state.custom_id, body)

    def _finish(self, seq: int, record: dict) -> None:
        t0 = time.perf_counter()
        self._done(self.order.finish(seq, record))
        self.timeline.add("write", time.perf_counter() - t0)

    def _done(self, records: list[dict]) -> None:
        self._write(records)
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
        self.waiting.clear()
        self.seqs_in_flight = 0


def _image_urls(line: BatchLine) -> list[str]:
    req = line.request
    if isinstance(req, ChatCompletionRequest) and any(m.has_images for m in req.messages):
        return conversation_images(req.conversation())
    return []
