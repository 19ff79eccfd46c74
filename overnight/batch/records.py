"""The output lines of a batch file, in the format of the OpenAI Batch API.

Success:  {"id": "batch_req_...", "custom_id": ..., "response": {"status_code": 200, "request_id": ...,
           "body": <ChatCompletion | Completion>}, "error": null}
Failure:  {"id": ..., "custom_id": <id or null>, "response": {"status_code": 400, "request_id": ...,
           "body": null}, "error": {"code": ..., "message": ...}}

An output holds at most one record per custom_id. A line whose custom_id cannot name its answer (none,
not a string, or one an earlier line already uses) is answered with "custom_id": null and its input
line number under "line", so joining results to inputs by custom_id never meets two answers for one id.
Every failure message starts with "line N: " (N counts input lines from 1), so a user can find the line
and a resumed run can tell which lines without a custom_id were already reported.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from overnight.openai_api.errors import ApiError

_LINE_PREFIX = re.compile(r"^line (\d+): ")


def _ids() -> tuple[str, str]:
    return f"batch_req_{uuid.uuid4().hex}", f"req_{uuid.uuid4().hex}"


def success_record(custom_id: str, body: dict[str, Any]) -> dict[str, Any]:
    line_id, request_id = _ids()
    return {
        "id": line_id,
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": request_id, "body": body},
        "error": None,
    }


def error_record(custom_id: str | None, line_no: int, error: ApiError) -> dict[str, Any]:
    """custom_id None: the line has none it may use; the record then names its line under "line"."""
    line_id, request_id = _ids()
    record: dict[str, Any] = {
        "id": line_id,
        "custom_id": custom_id,
        "response": {"status_code": error.status_code, "request_id": request_id, "body": None},
        "error": {"code": error.code, "message": f"line {line_no}: {error.message}"},
    }
    if custom_id is None:
        record["line"] = line_no
    return record


def encode(record: dict[str, Any]) -> bytes:
    """One output line. No NaN/Infinity (not JSON); non-ASCII text stays readable."""
    return (json.dumps(record, ensure_ascii=False, allow_nan=False, separators=(",", ":")) + "\n").encode()


def is_failure(record: dict[str, Any]) -> bool:
    return record.get("error") is not None


def reported_line(record: dict[str, Any]) -> int | None:
    """The input line number a failure record names, if any."""
    if isinstance(record.get("line"), int):
        return record["line"]
    error = record.get("error")
    if not isinstance(error, dict):
        return None
    m = _LINE_PREFIX.match(str(error.get("message", "")))
    return int(m.group(1)) if m else None
