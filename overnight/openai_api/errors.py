"""Errors as the OpenAI API reports them: an HTTP status and {"error": {message, type, param, code}}.

The codes name what went wrong so a batch user can group failed lines by cause; they appear in the
`error.code` of run-batch output lines and in the server's error bodies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from overnight.errors import InvalidRequestError

# code -> HTTP status. OpenAI's own codes where it has one (model_not_found, context_length_exceeded).
STATUS = {
    "invalid_json": 400,
    "invalid_line": 400,  # a batch line without custom_id / method / url / body
    "invalid_method": 400,
    "unsupported_url": 400,
    "invalid_request": 400,  # the body: a field out of range, of the wrong type, or missing
    "model_not_found": 404,
    "context_length_exceeded": 400,
    "duplicate_custom_id": 400,
    "unsupported_model": 400,  # a route the model is not served for (embeddings vs. generation)
    "aborted": 500,
    "internal_error": 500,
}


@dataclass
class ApiError(Exception):
    code: str
    message: str
    param: str | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)

    @property
    def status_code(self) -> int:
        return STATUS.get(self.code, 400)

    @property
    def type(self) -> str:
        if self.code == "model_not_found":
            return "not_found_error"
        return "server_error" if self.status_code >= 500 else "invalid_request_error"

    def body(self) -> dict[str, Any]:
        """The OpenAI error object, as an HTTP error response's JSON body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @classmethod
    def from_exception(cls, e: BaseException) -> ApiError:
        """400 for anything the request got wrong, 500 for our own failures."""
        if isinstance(e, ApiError):
            return e
        if isinstance(e, InvalidRequestError):
            return cls("invalid_request", str(e), getattr(e, "param", None))
        return cls("internal_error", f"{type(e).__name__}: {e}")


def error_body(
    message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """An OpenAI error object from its parts (for errors that are not an ApiError)."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
