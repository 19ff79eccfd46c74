"""Reaching a running server from a command (`overnight check`, `overnight bench sweep`), and what to
tell the user when that fails.

A server that is down, wants an API key, refuses the one given, or answers something the command cannot
read becomes one ServerUnreachableError sentence naming the URL and what to do; the command line prints
it as one line (exit status 2), never as a traceback.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from overnight.errors import ServerUnreachableError

if TYPE_CHECKING:
    import httpx


def auth_headers(api_key: str | None) -> dict[str, str] | None:
    return {"Authorization": f"Bearer {api_key}"} if api_key else None


def unreachable(url: str, error: BaseException) -> ServerUnreachableError:
    """The error for a request that got no answer at all (refused, timed out, not HTTP)."""
    why = str(error) or type(error).__name__
    return ServerUnreachableError(
        f"no server answers at {url} ({why}): is it running? Start one with `overnight serve`, "
        "or pass the --url of one that is"
    )


def check_status(url: str, path: str, response: httpx.Response, api_key: str | None) -> None:
    """Raise ServerUnreachableError when `response` is an error status, saying what to change."""
    status = response.status_code
    if status < 400:
        return
    if status in (401, 403):
        if api_key:
            raise ServerUnreachableError(f"{url} refused the API key given with --api-key ({status})")
        raise ServerUnreachableError(f"{url} wants an API key ({status} on {path}): pass --api-key KEY")
    detail = " ".join(response.text.split())[:200]
    raise ServerUnreachableError(f"{url}{path} answered {status}: {detail or 'no body'}")


def get(url: str, path: str, api_key: str | None, timeout: float = 30.0) -> httpx.Response:
    """GET url + path; raises ServerUnreachableError for no answer or an error status."""
    import httpx

    try:
        response = httpx.get(url + path, headers=auth_headers(api_key), timeout=timeout)
    except httpx.HTTPError as e:
        raise unreachable(url, e) from None
    check_status(url, path, response, api_key)
    return response


def get_json(url: str, path: str, api_key: str | None, timeout: float = 30.0) -> Any:
    response = get(url, path, api_key, timeout)
    try:
        return response.json()
    except ValueError:
        raise ServerUnreachableError(
            f"{url}{path} did not answer JSON: is {url} an OpenAI-compatible server?"
        ) from None


def first_model(url: str, api_key: str | None) -> dict[str, Any]:
    """The first model card of the server's /v1/models."""
    body = get_json(url, "/v1/models", api_key)
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list) or not data or not isinstance(data[0], dict) or "id" not in data[0]:
        raise ServerUnreachableError(
            f"{url}/v1/models lists no model (expected an OpenAI model list): is {url} an "
            "OpenAI-compatible server?"
        )
    return data[0]
