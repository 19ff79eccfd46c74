"""The OpenAI API's request and response objects, shared by `overnight run-batch` and `overnight serve`.

    protocol  request bodies (pydantic): ChatCompletionRequest, CompletionRequest, parse_request
    inputs    body -> engine inputs: prepare (model name, prompts, length, SamplingParams)
    convert   RequestOutput -> ChatCompletion / Completion bodies and streaming chunks
    errors    ApiError: status code and the {"error": {...}} object

Needs pydantic (the `server` extra); the engine itself never imports this package.
"""

from overnight.openai_api.convert import (
    ChatStream,
    CompletionStream,
    chat_completion,
    completion,
    finish_reason,
    new_id,
    usage,
    usage_of,
)
from overnight.openai_api.errors import ApiError, error_body
from overnight.openai_api.inputs import EngineInputs, check_model, check_prompt_length, prepare, served_names
from overnight.openai_api.protocol import (
    ROUTES,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    OpenAIRequest,
    StreamOptions,
    parse_request,
)

__all__ = [
    "ROUTES",
    "ApiError",
    "ChatCompletionRequest",
    "ChatMessage",
    "ChatStream",
    "CompletionRequest",
    "CompletionStream",
    "EngineInputs",
    "OpenAIRequest",
    "StreamOptions",
    "chat_completion",
    "check_model",
    "check_prompt_length",
    "completion",
    "error_body",
    "finish_reason",
    "new_id",
    "parse_request",
    "prepare",
    "served_names",
    "usage",
    "usage_of",
]
