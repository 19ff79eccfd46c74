"""The OpenAI API's request and response objects, shared by `overnight run-batch` and `overnight serve`.

    protocol    request bodies (pydantic): ChatCompletionRequest, CompletionRequest, EmbeddingRequest,
                parse_request
    inputs      body -> engine inputs: prepare (model name, prompts, length, Sampling/PoolingParams)
    convert     RequestOutput -> ChatCompletion / Completion bodies and streaming chunks
    responses   /v1/responses: the body as a chat request (response_objects: the Response, whole and streamed)
    embeddings  PoolingRequestOutputs -> the embedding response (float or base64)
    scores      /v1/score, /v1/rerank, /v1/classify: bodies and responses (cross-encoders, classifiers)
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
from overnight.openai_api.embeddings import embedding_response
from overnight.openai_api.errors import ApiError, error_body
from overnight.openai_api.inputs import (
    EngineInputs,
    check_model,
    check_prompt_length,
    check_task,
    prepare,
    served_names,
)
from overnight.openai_api.protocol import (
    ROUTES,
    AnyRequest,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    EmbeddingRequest,
    OpenAIRequest,
    StreamOptions,
    parse_request,
)
from overnight.openai_api.responses import RESPONSES_URL, ResponsesRequest  # registers the route
from overnight.openai_api.scores import (  # registers the routes
    ClassificationRequest,
    RerankRequest,
    ScoreRequest,
    scoring_response,
)

__all__ = [
    "RESPONSES_URL",
    "ROUTES",
    "AnyRequest",
    "ApiError",
    "ChatCompletionRequest",
    "ClassificationRequest",
    "RerankRequest",
    "ScoreRequest",
    "scoring_response",
    "ChatMessage",
    "ChatStream",
    "CompletionRequest",
    "CompletionStream",
    "EmbeddingRequest",
    "EngineInputs",
    "OpenAIRequest",
    "ResponsesRequest",
    "StreamOptions",
    "chat_completion",
    "check_model",
    "check_prompt_length",
    "check_task",
    "completion",
    "embedding_response",
    "error_body",
    "finish_reason",
    "new_id",
    "parse_request",
    "prepare",
    "served_names",
    "usage",
    "usage_of",
]
