"""The HTTP app: routes, API-key check, error shapes, and the engine thread's lifetime.

POST /v1/chat/completions, /v1/completions   OpenAI schemas (+ sampling extras), stream or not
POST /v1/responses                            OpenAI's Responses API (stateless), stream or not
POST /v1/embeddings                           OpenAI schema, for a model served with runner pooling
POST /v1/score, /v1/rerank, /classify         vLLM's scoring routes, for a cross-encoder or classifier
GET  /v1/models, /v1/models/{id}              the one model served
POST /tokenize, /detokenize                   text or messages -> token ids -> text, as vLLM spells them
GET  /health                                  200 while the engine serves, 503 otherwise; no key needed
GET  /metrics                                 Prometheus text format; no key needed unless protected
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic.json_schema import models_json_schema
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from overnight import __version__
from overnight.lora.request import LoRARequest
from overnight.metrics.prometheus import PrometheusObserver
from overnight.openai_api.inputs import check_route_task
from overnight.openai_api.protocol import ROUTES, ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from overnight.openai_api.responses import RESPONSES_URL, ResponsesRequest
from overnight.openai_api.scores import ClassificationRequest, RerankRequest, ScoreRequest
from overnight.openai_api.tokenize import detokenize, tokenize
from overnight.server.async_engine import AsyncEngine
from overnight.server.embeddings import OpenAIServingEmbedding
from overnight.server.errors import (
    EXCEPTION_HANDLERS,
    HttpError,
    engine_unavailable,
    too_large,
    unauthorized,
)
from overnight.server.scores import PATHS as SCORE_PATHS
from overnight.server.scores import OpenAIServingScores
from overnight.server.serving import OpenAIServing, ServingConfig, decode_json

# Reachable without the API key: load balancers probe /health, Prometheus scrapes /metrics (as it does
# against vLLM, whose key guards only the API); ServerOptions.protect_metrics puts /metrics behind it.
OPEN_PATHS = frozenset({"/health", "/metrics"})
DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20


def build_app(
    engine: AsyncEngine,
    config: ServingConfig,
    metrics: PrometheusObserver,
    api_key: str | None = None,
    open_paths: frozenset[str] = OPEN_PATHS,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await engine.stop()  # after uvicorn drained or cancelled the in-flight requests

    app = FastAPI(
        title="overnight",
        version=__version__,
        lifespan=lifespan,
        exception_handlers=EXCEPTION_HANDLERS,  # type: ignore[arg-type]
        docs_url=None,
        redoc_url=None,
    )
    serving = OpenAIServing(engine, config)
    embeddings = OpenAIServingEmbedding(engine, config)
    scores = OpenAIServingScores(engine, config)
    created = int(time.time())
    core = engine.engine
    runner = core.config.model.runner  # the routes of the other kind answer 400, naming the right one

    @app.post("/v1/chat/completions", openapi_extra=_body_schema(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        check_route_task(False, runner)
        return await serving.handle("/v1/chat/completions", request)

    @app.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest))
    async def completions(request: Request) -> Response:
        check_route_task(False, runner)
        return await serving.handle("/v1/completions", request)

    @app.post("/v1/responses", openapi_extra=_body_schema(ResponsesRequest))
    async def responses(request: Request) -> Response:
        check_route_task(False, runner)
        return await serving.handle(RESPONSES_URL, request)

    @app.post("/v1/embeddings", openapi_extra=_body_schema(EmbeddingRequest))
    async def create_embeddings(request: Request) -> Response:
        check_route_task(True, runner)
        return await embeddings.handle(request)

    def scoring_route(url: str):  # one handler per path, bound to its body's url
        async def route(request: Request) -> Response:
            check_route_task(True, runner, "scores")
            return await scores.handle(url, request)

        return route

    for path, url in SCORE_PATHS.items():
        app.add_api_route(path, scoring_route(url), methods=["POST"], openapi_extra=_body_schema(ROUTES[url]))

    def model_card() -> dict[str, Any]:
        return {
            "id": config.model_name,
            "object": "model",
            "created": created,
            "owned_by": "overnight",
            "root": core.config.model.model,
            "max_model_len": core.max_model_len,
        }

    def adapter_card(lora: LoRARequest) -> dict[str, Any]:  # vLLM's: parent = the base model
        return {**model_card(), "id": lora.lora_name, "root": lora.lora_path, "parent": config.model_name}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(), *map(adapter_card, config.adapters.values())]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        if model_id in config.adapters:
            return adapter_card(config.adapters[model_id])
        if model_id not in config.accepted_names:
            raise HttpError(
                404,
                f"the model {model_id!r} does not exist here; serving: {config.model_name}",
                "not_found_error",
                "model_not_found",
                "model",
            )
        return model_card()

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> JSONResponse:
        raw = await request.body()
        body = await asyncio.to_thread(
            lambda: tokenize(decode_json(raw), core.tokenizer, core.max_model_len, config.accepted_names)
        )
        return JSONResponse(body)

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> JSONResponse:
        raw = await request.body()
        body = await asyncio.to_thread(
            lambda: detokenize(decode_json(raw), core.tokenizer, config.accepted_names)
        )
        return JSONResponse(body)

    @app.get("/health")
    async def health() -> JSONResponse:
        if not engine.is_running:
            raise engine_unavailable(engine.error)
        return JSONResponse({})

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, open_paths=open_paths)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_bytes)  # added last: runs first
    return app


class BodyLimitMiddleware:
    """413 for a request body over max_bytes: at once when Content-Length says so, else as soon as the
    bytes read pass it (a chunked upload), so an oversized body is never held in memory."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await too_large(self.max_bytes).response()(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise too_large(self.max_bytes)  # reaches the app's handler while it reads the body
            return message

        await self.app(scope, counted, send)


class ApiKeyMiddleware:
    """401 on every route but the open ones (/health, /metrics) unless `Authorization: Bearer <key>`
    matches (compared in constant time). Plain ASGI, so streaming responses and disconnect detection pass
    through untouched."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self.app = app
        self.key = api_key.encode()
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.key):
                await unauthorized().response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


# -- OpenAPI ---------------------------------------------------------------------------------------
# The bodies are parsed by the shared layer (for OpenAI-shaped 400s, not FastAPI's 422s), so FastAPI does
# not see their models; the schema names them explicitly, for clients, docs and the fuzz tests.

_REF = "#/components/schemas/{model}"


def _body_schema(model: type) -> dict[str, Any]:
    ref = {"$ref": _REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def _openapi(app: FastAPI) -> dict[str, Any]:
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        _, defs = models_json_schema(
            [
                (ChatCompletionRequest, "validation"),
                (CompletionRequest, "validation"),
                (EmbeddingRequest, "validation"),
                (ResponsesRequest, "validation"),
                (ScoreRequest, "validation"),
                (RerankRequest, "validation"),
                (ClassificationRequest, "validation"),
            ],
            ref_template=_REF,
        )
        schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
        app.openapi_schema = schema
    return app.openapi_schema
