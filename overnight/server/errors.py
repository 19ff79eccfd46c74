"""Every error the server sends, as OpenAI's error object with the right status.

Request-body errors are the shared layer's ApiError (400 / 404 model_not_found); this file adds the ones
only a server has: 401, 404 for an unknown route, 405, 503 (overloaded or no engine), and a 500 that is
kept for our own bugs (bad input never reaches it: the test suite fuzzes for that).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from overnight.errors import InvalidRequestError
from overnight.openai_api.errors import ApiError, error_body

log = logging.getLogger("overnight.server")


@dataclass
class HttpError(Exception):
    status: int
    message: str
    type: str
    code: str | None = None
    param: str | None = None
    retry_after: int | None = None  # seconds, for 503

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def unauthorized() -> HttpError:
    return HttpError(
        401,
        "missing or invalid API key: send 'Authorization: Bearer <key>'",
        "authentication_error",
        "invalid_api_key",
    )


def too_large(max_bytes: int) -> HttpError:
    return HttpError(
        413,
        f"the request body is larger than this server takes ({max_bytes} bytes; --max-request-bytes)",
        "invalid_request_error",
        "request_too_large",
    )


def overloaded(num_waiting: int) -> HttpError:
    return HttpError(
        503,
        f"the server is overloaded ({num_waiting} requests waiting); retry later",
        "server_error",
        "server_overloaded",
        retry_after=1,
    )


def engine_unavailable(cause: BaseException | None) -> HttpError:
    detail = f": {cause}" if cause is not None else ""
    return HttpError(503, f"the engine is not serving{detail}", "server_error", "engine_unavailable")


# -- exception handlers (installed on the app) -----------------------------------------------------


async def handle_api_error(request: Request, e: Exception) -> JSONResponse:
    assert isinstance(e, ApiError)
    return JSONResponse(e.body(), status_code=e.status_code)


async def handle_http_error(request: Request, e: Exception) -> JSONResponse:
    assert isinstance(e, HttpError)
    return e.response()


async def handle_invalid_request(request: Request, e: Exception) -> JSONResponse:
    return JSONResponse(ApiError.from_exception(e).body(), status_code=400)


async def handle_starlette_http(request: Request, e: Exception) -> JSONResponse:
    """Routing errors (404 unknown route, 405 wrong method) in the OpenAI shape."""
    assert isinstance(e, StarletteHTTPException)
    if e.status_code == 404:
        message, code = f"no route {request.method} {request.url.path}", "not_found"
    elif e.status_code == 405:
        message, code = f"method {request.method} is not allowed on {request.url.path}", "method_not_allowed"
    else:
        message, code = str(e.detail), None
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    return JSONResponse(
        error_body(message, kind, None, code), status_code=e.status_code, headers=getattr(e, "headers", None)
    )


async def handle_client_gone(request: Request, e: Exception) -> Response:
    """The client closed its connection before its request body arrived (a load generator cutting its
    streams at the end of a run does this): nothing to answer and nothing went wrong here."""
    log.debug("client left before its request body arrived: %s %s", request.method, request.url.path)
    return Response(status_code=499)  # nginx's "client closed request"; no one reads it


async def handle_unexpected(request: Request, e: Exception) -> JSONResponse:
    log.exception("unexpected error serving %s %s", request.method, request.url.path)
    return JSONResponse(
        error_body(f"internal error: {type(e).__name__}", "server_error", None, "internal_error"),
        status_code=500,
    )


EXCEPTION_HANDLERS = {
    ApiError: handle_api_error,
    HttpError: handle_http_error,
    InvalidRequestError: handle_invalid_request,
    StarletteHTTPException: handle_starlette_http,
    ClientDisconnect: handle_client_gone,
    Exception: handle_unexpected,
}
