"""Reads a batch input file lazily, one line at a time, into parsed requests or per-line errors.

Nothing here can stop a run: every problem a line can have becomes that line's ApiError, and the lines
after it are read as usual. Blank lines are skipped (they are common at the end of hand-written files).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from overnight.openai_api.errors import ApiError
from overnight.openai_api.protocol import AnyRequest, parse_request
from overnight.openai_api.responses import ResponsesRequest

# Used only to name the custom_id of a line that is not valid JSON, so its error line can carry it.
_CUSTOM_ID = re.compile(rb'"custom_id"\s*:\s*"((?:[^"\\]|\\.)*)"')


@dataclass(slots=True)
class BatchLine:
    line_no: int  # 1-based, counting every line of the file (blank ones too)
    custom_id: str | None
    url: str | None = None
    request: AnyRequest | ResponsesRequest | None = None
    error: ApiError | None = None


def input_lines(path: str) -> Iterator[bytes]:
    """The raw lines of the input, read lazily."""
    if path == "-":
        yield from sys.stdin.buffer
        return
    with open(path, "rb") as f:
        yield from f


def read_lines(raw_lines: Iterable[bytes]) -> Iterator[BatchLine]:
    for line_no, raw in enumerate(raw_lines, start=1):
        if raw.strip():
            yield parse_line(line_no, raw)


def parse_line(line_no: int, raw: bytes) -> BatchLine:
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        return BatchLine(
            line_no, _guess_custom_id(raw), error=ApiError("invalid_json", f"not valid JSON: {e}")
        )
    if not isinstance(obj, dict):
        return BatchLine(
            line_no,
            None,
            error=ApiError("invalid_line", f"a line must be a JSON object, not {type(obj).__name__}"),
        )
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        # Not even a number is taken as its string: "7" may be another line's custom_id.
        what = "missing" if custom_id is None else f"not a non-empty string ({custom_id!r})"
        return BatchLine(line_no, None, error=ApiError("invalid_line", f"custom_id is {what}", "custom_id"))
    line = BatchLine(line_no, custom_id)
    method, url, body = obj.get("method"), obj.get("url"), obj.get("body")
    if method is None:
        line.error = ApiError("invalid_line", 'method is missing (use "POST")', "method")
    elif not isinstance(method, str) or method.upper() != "POST":
        line.error = ApiError("invalid_method", f'method {method!r} is not allowed: use "POST"', "method")
    elif url is None:
        line.error = ApiError("invalid_line", "url is missing", "url")
    elif not isinstance(url, str):
        line.error = ApiError("unsupported_url", f"url must be a string, not {type(url).__name__}", "url")
    elif body is None:
        line.error = ApiError("invalid_line", "body is missing", "body")
    else:
        line.url = url
        try:
            line.request = parse_request(url, body)
        except ApiError as e:
            line.error = e
    return line


def _guess_custom_id(raw: bytes) -> str | None:
    m = _CUSTOM_ID.search(raw)
    if m is None:
        return None
    try:
        return json.loads(b'"' + m.group(1) + b'"')
    except ValueError:
        return None


def count_lines(path: str) -> int:
    """Non-blank lines of a file, for the progress bar's total (a fast pass, no parsing)."""
    n = 0
    with open(path, "rb") as f:
        for raw in f:
            if raw.strip():
                n += 1
    return n
