"""Pooled outputs as the OpenAI API's embedding response, a JSON-ready dict:

    {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": [...] | "<base64>"}],
     "model": ..., "usage": {"prompt_tokens": n, "total_tokens": n}, "id": ..., "created": ...}

("id" and "created" are extras, as vLLM sends them.) base64 is the vector's little-endian float32 bytes,
what the official client decodes.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from overnight.openai_api.convert import new_id
from overnight.outputs import PoolingRequestOutput


def encode_vector(vector: Any, encoding_format: str) -> list[float] | str:
    values = np.asarray(vector, dtype="<f4")
    if encoding_format == "base64":
        return base64.b64encode(values.tobytes()).decode("ascii")
    return values.tolist()


def embedding_response(
    outputs: Sequence[PoolingRequestOutput],
    model: str,
    encoding_format: str = "float",
    *,
    response_id: str | None = None,
    created: int | None = None,
) -> dict[str, Any]:
    """The response to one request whose inputs gave `outputs`, in input order."""
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {
        "id": response_id or new_id("embd"),
        "object": "list",
        "created": created if created is not None else int(time.time()),
        "model": model,
        "data": [
            {"object": "embedding", "index": i, "embedding": encode_vector(o.outputs.data, encoding_format)}
            for i, o in enumerate(outputs)
        ],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
