"""POST /v1/score, /v1/rerank, /v1/classify (and vLLM's unversioned /score, /rerank, /classify): a body
in, the scores or classes out, for a cross-encoder or sequence classifier served with runner pooling.
server/embeddings.py's counterpart: the same shared OpenAI layer, load shedding and disconnect handling.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from overnight.errors import InvalidRequestError
from overnight.openai_api.convert import new_id
from overnight.openai_api.errors import ApiError
from overnight.openai_api.inputs import EngineInputs, prepare
from overnight.openai_api.protocol import parse_request
from overnight.openai_api.scores import (
    CLASSIFY_URL,
    RERANK_URL,
    SCORE_URL,
    ClassificationRequest,
    RerankRequest,
    ScoreRequest,
    ScoringRequest,
    scoring_response,
)
from overnight.outputs import PoolingRequestOutput
from overnight.server.async_engine import AsyncEngine
from overnight.server.errors import engine_unavailable, overloaded
from overnight.server.serving import CLIENT_CLOSED, ServingConfig, collect_outputs, decode_json

log = logging.getLogger("overnight.server")

# The paths each body is served at (vLLM's unversioned ones too) -> the body's url in protocol.ROUTES.
PATHS = {
    "/v1/score": SCORE_URL,
    "/score": SCORE_URL,
    "/v1/rerank": RERANK_URL,
    "/rerank": RERANK_URL,
    "/v2/rerank": RERANK_URL,  # Cohere's v2 path, as vLLM serves it
    "/v1/classify": CLASSIFY_URL,
    "/classify": CLASSIFY_URL,
}
_ID_PREFIX = {SCORE_URL: "score", RERANK_URL: "rerank", CLASSIFY_URL: "classify"}


class OpenAIServingScores:
    def __init__(self, engine: AsyncEngine, config: ServingConfig) -> None:
        self.engine = engine
        self.config = config
        pooler = engine.engine.config.model.pooler
        classifier = pooler.classifier if pooler is not None else None
        self.labels = classifier.labels if classifier is not None else ()
        self.embedding_scores = pooler is not None and classifier is None  # cosine of embeddings

    async def handle(self, url: str, request: Request) -> Response:
        """url: the body's route (SCORE_URL, RERANK_URL or CLASSIFY_URL)."""
        raw = await request.body()
        req = await asyncio.to_thread(lambda: parse_request(url, decode_json(raw)))
        assert isinstance(req, (ScoreRequest, RerankRequest, ClassificationRequest))
        if not self.engine.is_running:
            raise engine_unavailable(self.engine.error)
        limit = self.config.max_waiting
        if limit is not None and self.engine.num_waiting >= limit:
            raise overloaded(self.engine.num_waiting)
        inputs = await asyncio.to_thread(self._prepare, req)
        response_id = new_id(_ID_PREFIX[url])
        prompts = [(f"{response_id}-{i}", text, ids) for i, (text, ids) in enumerate(inputs.prompts)]
        collected = await collect_outputs(self.engine, request, prompts, inputs.params)
        if collected is None:
            return Response(status_code=CLIENT_CLOSED)
        outputs = [o for o in collected if isinstance(o, PoolingRequestOutput)]
        body = scoring_response(
            req, outputs, self.config.model_name, self.labels, pairs=inputs.pairs, response_id=response_id
        )
        return JSONResponse(body)

    def _prepare(self, req: ScoringRequest) -> EngineInputs:
        core = self.engine.engine
        try:
            return prepare(
                req,
                core.tokenizer,
                core.max_model_len,
                self.config.accepted_names,
                core.validate,
                runner=core.config.model.runner,
                embedding_scores=self.embedding_scores,
            )
        except (ApiError, InvalidRequestError):
            raise
        except Exception as e:  # noqa: BLE001 - the tokenizer failed on the user's text: their fault
            log.info("scoring request refused while tokenizing: %r", e)
            raise ApiError(
                "invalid_request", f"the input cannot be tokenized: {type(e).__name__}: {e}"
            ) from None
