"""POST /v1/embeddings: a body in, the embedding response out (server/serving.py's counterpart for
pooling models: the same shared OpenAI layer, load shedding and disconnect handling)."""

from __future__ import annotations

import asyncio
import logging

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from overnight.errors import InvalidRequestError
from overnight.openai_api.convert import new_id
from overnight.openai_api.embeddings import embedding_response
from overnight.openai_api.errors import ApiError
from overnight.openai_api.inputs import EngineInputs, prepare
from overnight.openai_api.protocol import EmbeddingRequest, parse_request
from overnight.outputs import PoolingRequestOutput
from overnight.server.async_engine import AsyncEngine
from overnight.server.errors import engine_unavailable, overloaded
from overnight.server.serving import CLIENT_CLOSED, ServingConfig, collect_outputs, decode_json

log = logging.getLogger("overnight.server")

ROUTE = "/v1/embeddings"


class OpenAIServingEmbedding:
    def __init__(self, engine: AsyncEngine, config: ServingConfig) -> None:
        self.engine = engine
        self.config = config

    async def handle(self, request: Request) -> Response:
        raw = await request.body()
        # Off the event loop, as for the generation routes: a large input list takes a while to parse
        # and tokenize.
        req = await asyncio.to_thread(lambda: parse_request(ROUTE, decode_json(raw)))
        assert isinstance(req, EmbeddingRequest)
        if not self.engine.is_running:
            raise engine_unavailable(self.engine.error)
        limit = self.config.max_waiting
        if limit is not None and self.engine.num_waiting >= limit:
            raise overloaded(self.engine.num_waiting)
        inputs = await asyncio.to_thread(self._prepare, req)
        response_id = new_id("embd")
        prompts = [(f"{response_id}-{i}", text, ids) for i, (text, ids) in enumerate(inputs.prompts)]
        collected = await collect_outputs(self.engine, request, prompts, inputs.params)
        outputs = None if collected is None else [o for o in collected if isinstance(o, PoolingRequestOutput)]
        if outputs is None:
            return Response(status_code=CLIENT_CLOSED)
        body = embedding_response(
            outputs, self.config.model_name, req.encoding_format, response_id=response_id
        )
        return JSONResponse(body)

    def _prepare(self, req: EmbeddingRequest) -> EngineInputs:
        core = self.engine.engine
        try:
            return prepare(
                req,
                core.tokenizer,
                core.max_model_len,
                self.config.accepted_names,
                core.validate,
                runner=core.config.model.runner,
            )
        except (ApiError, InvalidRequestError):
            raise
        except Exception as e:  # noqa: BLE001 - the tokenizer failed on the user's text: their fault
            log.info("embedding request refused while tokenizing: %r", e)
            raise ApiError(
                "invalid_request", f"the input cannot be tokenized: {type(e).__name__}: {e}", "input"
            ) from None
