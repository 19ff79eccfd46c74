"""POST /v1/chat/completions and /v1/completions: a body in, a response object or an SSE stream out.

The request schema, its checks and the response objects are the shared OpenAI layer's (overnight.openai_api,
which run-batch uses too); this file adds what only a live server has: load shedding, streaming, and
aborting the work of a client that went away.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing, suppress
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from overnight.errors import EngineDeadError, InvalidRequestError
from overnight.lora.request import LoRARequest
from overnight.multimodal.inputs import MultiModalInputs
from overnight.multimodal.processor import ImageProcessor, no_images_reason
from overnight.openai_api.convert import ChatStream, CompletionStream, new_id, response_body
from overnight.openai_api.errors import ApiError
from overnight.openai_api.inputs import EngineInputs, prepare
from overnight.openai_api.protocol import (
    ChatCompletionRequest,
    EmbeddingRequest,
    OpenAIRequest,
    parse_request,
)
from overnight.openai_api.response_objects import ResponseStream
from overnight.openai_api.responses import ResponsesRequest
from overnight.options import ChatOptions
from overnight.outputs import EngineOutput, RequestOutput
from overnight.pooling_params import RequestParams
from overnight.sampling_params import SamplingParams
from overnight.server.async_engine import AsyncEngine, PromptSpec
from overnight.server.errors import engine_unavailable, overloaded
from overnight.tool_calls.message import MessagePlan

log = logging.getLogger("overnight.server")

# What a client that closed its connection is logged with (nginx's convention); it never receives it.
CLIENT_CLOSED = 499


@dataclass
class ServingConfig:
    model_name: str  # the name responses report as `model`
    accepted_names: set[str]  # names a request's `model` may use
    max_waiting: int | None  # refuse new requests (503) while this many wait; None: never
    stream_interval: int = 1  # tokens a stream's chunk carries at least (but its last); deltas.Pacer
    chat: ChatOptions | None = None  # reasoning and tool-call parsers
    # LoRA adapters a request's `model` may name (--lora-modules); their names are in accepted_names too
    adapters: dict[str, LoRARequest] = field(default_factory=dict)
    images: ImageProcessor | None = None  # a vision-language model's image processor

    def adapter(self, model: str | None) -> LoRARequest | None:
        return self.adapters.get(model) if model else None


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, config: ServingConfig) -> None:
        self.engine = engine
        self.config = config

    async def handle(self, url: str, request: Request) -> Response:
        raw = await request.body()
        # Parsing, the chat template and tokenizing take time that grows with the body (seconds for a
        # prompt of megabytes): off the event loop, so /health and the streams keep their pace.
        req = await asyncio.to_thread(lambda: parse_request(url, decode_json(raw)))
        assert not isinstance(req, EmbeddingRequest), "/v1/embeddings is served by server/embeddings.py"
        self._check_capacity()
        inputs = await asyncio.to_thread(self._prepare, req)
        assert isinstance(inputs.params, SamplingParams)  # a generation request's
        is_chat = isinstance(req, ChatCompletionRequest)
        if isinstance(req, ResponsesRequest):
            response_id = f"resp_{uuid.uuid4().hex}"
        else:
            response_id = new_id("chatcmpl" if is_chat else "cmpl")
        prompts = [
            (response_id if len(inputs.prompts) == 1 else f"{response_id}-{i}", text, ids)
            for i, (text, ids) in enumerate(inputs.prompts)
        ]
        lora = self.config.adapter(req.model)
        if req.stream:
            events = self._stream(
                req, response_id, prompts, inputs.params, inputs.plan, lora, inputs.multi_modal
            )
            return StreamingResponse(
                events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        collected = await collect_outputs(
            self.engine, request, prompts, inputs.params, lora, inputs.multi_modal
        )
        outputs = None if collected is None else [o for o in collected if isinstance(o, RequestOutput)]
        if outputs is None:
            return Response(status_code=CLIENT_CLOSED)
        body = response_body(
            req,
            outputs,
            lora.lora_name if lora is not None else self.config.model_name,
            response_id=response_id,
            tokenizer=self.engine.engine.tokenizer,
            plan=inputs.plan,
        )
        return JSONResponse(body)

    def _prepare(self, req: OpenAIRequest | ResponsesRequest) -> EngineInputs:
        core = self.engine.engine
        try:
            return prepare(
                req,
                core.tokenizer,
                core.max_model_len,
                self.config.accepted_names,
                core.validate,
                chat=self.config.chat,
                images=self.config.images,
                no_images=no_images_reason(core.source.arch),
            )
        except (ApiError, InvalidRequestError):
            raise
        except Exception as e:  # noqa: BLE001
            # Rendering and tokenizing run the user's text (and chat_template_kwargs) through the chat
            # template and the tokenizer: what fails there (a lone surrogate, a template that divides by
            # zero) is the request's fault, never a reason for a 500.
            log.info("request refused while preparing its prompt: %r", e)
            raise ApiError(
                "invalid_request",
                "the request cannot be turned into a prompt: the chat template or the tokenizer failed "
                "on its text",
            ) from None

    def _check_capacity(self) -> None:
        if not self.engine.is_running:
            raise engine_unavailable(self.engine.error)
        limit = self.config.max_waiting
        if limit is not None and self.engine.num_waiting >= limit:
            raise overloaded(self.engine.num_waiting)

    # -- whole responses ----------------------------------------------------------------------------

    # -- streams ------------------------------------------------------------------------------------

    async def _stream(
        self,
        req: OpenAIRequest | ResponsesRequest,
        response_id: str,
        prompts: list[PromptSpec],
        params: SamplingParams,
        plan: MessagePlan | None = None,
        lora: LoRARequest | None = None,
        multi_modal: MultiModalInputs | None = None,
    ) -> AsyncIterator[str]:
        """SSE events: one `data: {chunk}` per delta, the usage chunk if asked, then `data: [DONE]`
        (/v1/responses: its typed events, ending with response.completed).

        When the client disconnects, the response task is cancelled inside this generator's await; the
        aclosing block then aborts the unfinished requests, freeing their KV blocks."""
        model = lora.lora_name if lora is not None else self.config.model_name
        usage = {"include_usage": req.include_usage, "continuous_usage": req.continuous_usage}
        chat: ChatStream | ResponseStream | None
        if isinstance(req, ResponsesRequest):
            chat = ResponseStream(req, model, response_id, plan)
            text = None
            for event in chat.start():
                yield sse(event)
        elif isinstance(req, ChatCompletionRequest):
            chat = ChatStream(
                model, response_id=response_id, num_logprobs=req.num_logprobs, plan=plan, **usage
            )
            text = None
        else:
            chat = None
            text = CompletionStream(model, response_id=response_id, n=req.n, **usage)
        try:
            batches_of = self.engine.generate_batches(
                prompts,
                params,
                stream=True,
                stream_interval=self.config.stream_interval,
                lora_request=lora,
                multi_modal=multi_modal,
            )
            async with aclosing(batches_of) as batches:
                async for batch in batches:
                    # What waited since the last wake-up goes out in one write (one send call).
                    events: list[str] = []
                    for index, delta in batch:
                        assert isinstance(delta, RequestOutput)  # generation requests
                        if chat is not None:
                            chunks = chat.chunks(delta)
                        else:
                            assert text is not None
                            chunks = text.chunks(index, delta)
                        events.extend(sse(chunk) for chunk in chunks)
                    if events:
                        yield "".join(events)
            stream = chat if chat is not None else text
            assert stream is not None
            for chunk in stream.final_chunks():
                yield sse(chunk)
        except Exception as e:  # noqa: BLE001 - the status line is long gone: report it in-band
            if isinstance(e, EngineDeadError):
                yield sse(engine_unavailable(e).body())
            else:
                log.exception("stream %s failed", response_id)
                yield sse(ApiError.from_exception(e).body())
        if not isinstance(req, ResponsesRequest):  # the Responses API's stream ends with its last event
            yield "data: [DONE]\n\n"


async def collect_outputs(
    engine: AsyncEngine,
    request: Request,
    prompts: list[PromptSpec],
    params: RequestParams,
    lora: LoRARequest | None = None,
    multi_modal: MultiModalInputs | None = None,
) -> list[EngineOutput] | None:
    """The final outputs of a non-streamed request in prompt order, or None if the client disconnected
    first (its requests are then aborted: nothing would read the answer)."""

    async def run() -> list[EngineOutput]:
        results: list[EngineOutput | None] = [None] * len(prompts)
        async with aclosing(
            engine.generate_many(prompts, params, stream=False, lora_request=lora, multi_modal=multi_modal)
        ) as outputs:
            async for index, out in outputs:
                results[index] = out
        return [r for r in results if r is not None]

    work = asyncio.ensure_future(run())
    gone = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work.done():
            work.cancel()  # closes generate_many, which aborts the requests
            with suppress(asyncio.CancelledError):
                await work
        gone.cancel()
    if work.cancelled():
        return None
    try:
        return work.result()
    except EngineDeadError as e:
        raise engine_unavailable(e) from None


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def decode_json(raw: bytes) -> Any:
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ApiError("invalid_json", f"the request body is not valid JSON: {e}", "body") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client closes the connection. Only for after the body was read: every message
    the server sends then is the disconnect."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
