"""Request bodies of the OpenAI API (/v1/chat/completions, /v1/completions, /v1/embeddings) as pydantic
models.

Shared by `overnight run-batch` and `overnight serve`. Field names, defaults and ranges follow the OpenAI
API, plus the sampling extras users pass to vLLM (top_k, min_p, repetition_penalty, ignore_eos,
min_tokens, ...). Unknown fields are ignored, so bodies written for other servers still load; known
fields that would change the answer in a way we cannot honour (echo, suffix, logit_bias, tools, ...)
are refused rather than silently dropped.

Numbers are strict: `"0.5"` or `true` where a number belongs is an error, not a guess.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from overnight.entrypoints.prompts import render_conversation
from overnight.errors import InvalidRequestError
from overnight.openai_api.errors import ApiError
from overnight.pooling_params import PoolingParams
from overnight.sampling_params import SamplingParams

if TYPE_CHECKING:
    from overnight.tokenizer.tokenizer import Tokenizer

Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]  # strict float still takes an int (2 -> 2.0)
Bool = Annotated[bool, Strict()]
TokenIds = Annotated[list[Annotated[int, Strict(), Field(ge=0)]], Field(min_length=1)]

# The default max_tokens of /v1/completions in the OpenAI API; chat has none (up to the context).
COMPLETION_DEFAULT_MAX_TOKENS = 16
MAX_LOGPROBS = 20


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class StreamOptions(_Body):
    include_usage: Bool = False


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _text_parts_only(self) -> ChatMessage:
        if isinstance(self.content, list):
            for part in self.content:
                if part.get("type") != "text":
                    raise ValueError(
                        f"content part of type {part.get('type')!r} is not supported: only text parts"
                    )
                TextPart.model_validate(part)
        return self

    def text(self) -> str:
        """The content as one string; text parts are joined with newlines."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part["text"] for part in self.content)


class _SamplingFields(_Body):
    """Fields both endpoints share."""

    model: str | None = None
    n: Int = Field(1, ge=1, le=128)
    temperature: Float | None = Field(None, ge=0.0, le=2.0)
    top_p: Float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: Int | None = None
    presence_penalty: Float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: Float = Field(0.0, ge=-2.0, le=2.0)
    user: str | None = None
    stream: Bool = False
    stream_options: StreamOptions | None = None
    # Extras users pass to vLLM-style servers.
    top_k: Int | None = Field(None, ge=-1)
    min_p: Float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: Float = Field(1.0, gt=0.0, le=2.0)
    ignore_eos: Bool = False
    min_tokens: Int = Field(0, ge=0)
    stop_token_ids: list[Annotated[int, Strict(), Field(ge=0)]] | None = None
    include_stop_str_in_output: Bool = False
    skip_special_tokens: Bool = True
    # Known OpenAI fields we cannot honour: refused when set to anything but their neutral value.
    logit_bias: dict[str, float] | None = None

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(
        cls, v: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):
            raise ValueError("only allowed when stream is true")
        return v

    @field_validator("stop")
    @classmethod
    def _stops_not_empty(cls, v: str | list[str] | None) -> str | list[str] | None:
        if v == "" or (isinstance(v, list) and any(s == "" for s in v)):
            raise ValueError("stop strings must not be empty")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v:
            raise ValueError("not supported")
        return v

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises InvalidRequestError where fields conflict (min_tokens above max_tokens)."""
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
        )


class ChatCompletionRequest(_SamplingFields):
    """The body of POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_tokens: Int | None = Field(None, ge=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: Bool = False
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # Extras: how the chat template is applied.
    add_generation_prompt: Bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    @field_validator("messages")
    @classmethod
    def _messages_not_empty(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if not v:
            raise ValueError("must not be empty")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("needs logprobs set to true")
        return v

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v: list[Any] | None) -> list[Any] | None:
        if v:
            raise ValueError("not supported")
        return v

    @field_validator("response_format")
    @classmethod
    def _text_format_only(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v and v.get("type", "text") != "text":
            raise ValueError("only the text format is supported")
        return v

    @property
    def max_output_tokens(self) -> int | None:
        """max_completion_tokens wins over the older max_tokens; None means up to the context."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """Top logprobs per token (0: only the sampled token's), or None when logprobs are off."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def to_sampling_params(self) -> SamplingParams:
        return self._params(self.max_output_tokens, self.num_logprobs)

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as {"role", "content": str} dicts for the chat template."""
        conv: list[dict[str, Any]] = []
        for m in self.messages:
            msg: dict[str, Any] = {"role": m.role, "content": m.text()}
            if m.name is not None:
                msg["name"] = m.name
            conv.append(msg)
        return conv

    def engine_prompts(self, tokenizer: Tokenizer | None) -> list[tuple[str | None, list[int]]]:
        """The one prompt (text, token ids) the chat template makes of the messages."""
        text, ids = render_conversation(
            self.conversation(),
            tokenizer,
            add_generation_prompt=self.add_generation_prompt,
            **(self.chat_template_kwargs or {}),
        )
        return [(text, ids)]


class CompletionRequest(_SamplingFields):
    """The body of POST /v1/completions. A list prompt gives one choice per prompt (times n)."""

    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: Int | None = Field(COMPLETION_DEFAULT_MAX_TOKENS, ge=1)
    logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: Bool = False
    suffix: str | None = None
    best_of: Int | None = Field(None, ge=1)

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("must not be an empty list")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("not supported")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("not supported")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and v != info.data.get("n", 1):
            raise ValueError("only best_of equal to n is supported")
        return v

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    def to_sampling_params(self) -> SamplingParams:
        return self._params(self.max_tokens, self.logprobs)

    def prompt_list(self) -> list[str | list[int]]:
        """The prompts, one per engine request, in order."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def engine_prompts(self, tokenizer: Tokenizer | None) -> list[tuple[str | None, list[int]]]:
        out: list[tuple[str | None, list[int]]] = []
        for p in self.prompt_list():
            if isinstance(p, str):
                if tokenizer is None:
                    raise InvalidRequestError("text prompts need a tokenizer (skip_tokenizer_init is set)")
                out.append((p, tokenizer.encode(p)))
            else:
                out.append((None, p))
        return out


class EmbeddingRequest(_Body):
    """The body of POST /v1/embeddings: one vector per input (a string, a list of strings, token ids,
    or a list of token-id lists)."""

    model: str | None = None
    input: str | list[str] | TokenIds | list[TokenIds]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int | None = Field(None, ge=1)  # Matryoshka: only for models trained for it
    user: str | None = None
    # Extras users pass to vLLM: cut inputs to this many tokens (-1: to the context) instead of refusing
    # the longer ones; override the model's normalization.
    truncate_prompt_tokens: Int | None = Field(None, ge=-1)
    normalize: Bool | None = None

    @field_validator("input")
    @classmethod
    def _input_not_empty(cls, v: Any) -> Any:
        if v == "" or (isinstance(v, list) and (not v or any(x == "" or x == [] for x in v))):
            raise ValueError("must not be empty, nor hold an empty string or list")
        return v

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncation_is_positive(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError("must be -1 (the context length) or at least 1")
        return v

    def to_pooling_params(self) -> PoolingParams:
        return PoolingParams(dimensions=self.dimensions, normalize=self.normalize)

    def input_list(self) -> list[str | list[int]]:
        """The inputs, one vector each, in order."""
        v = self.input
        if isinstance(v, str):
            return [v]
        if v and isinstance(v[0], int):
            return [list(v)]  # type: ignore[arg-type]
        return list(v)  # type: ignore[arg-type]


OpenAIRequest = ChatCompletionRequest | CompletionRequest  # generation requests
AnyRequest = OpenAIRequest | EmbeddingRequest

# url -> body model; the routes run-batch accepts and the server mounts.
ROUTES: dict[str, type[ChatCompletionRequest] | type[CompletionRequest] | type[EmbeddingRequest]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/embeddings": EmbeddingRequest,
}


def parse_request(url: str, body: Any) -> AnyRequest:
    """The body of a request to `url`, validated. Raises ApiError: unsupported_url, or invalid_request
    with a readable message and the offending field as `param`."""
    model_cls = ROUTES.get(url)
    if model_cls is None:
        raise ApiError("unsupported_url", f"unsupported url {url!r}: use one of {', '.join(ROUTES)}", "url")
    if not isinstance(body, dict):
        raise ApiError("invalid_request", "the request body must be a JSON object", "body")
    try:
        return model_cls.model_validate(body)
    except ValidationError as e:
        message, param = describe_validation_error(e)
        raise ApiError("invalid_request", message, param) from None


def describe_validation_error(e: ValidationError) -> tuple[str, str | None]:
    """One line naming the first problem and the field it is in (the error object's `param`)."""
    errors = e.errors(include_url=False)
    first = errors[0]
    raw_loc = [str(x) for x in first.get("loc", ())]
    # Union members add their type to the location (prompt.str, prompt.list[...]): keep field names only.
    loc = [x for x in raw_loc if not _is_type_tag(x)]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    if first.get("type") == "missing":
        msg = "field required"
    elif len(raw_loc) > len(loc) and loc and loc[-1] in _UNION_HINTS and first.get("type") != "value_error":
        msg = _UNION_HINTS[loc[-1]]  # pydantic reports only the first union member's complaint
    return (f"{param}: {msg}" if param else msg), (loc[0] if loc else None)


_UNION_HINTS = {
    "prompt": "must be a string, a list of strings, a list of token ids, or a list of lists of token ids",
    "input": "must be a string, a list of strings, a list of token ids, or a list of lists of token ids",
    "stop": "must be a string or a list of strings",
    "content": "must be a string or a list of text parts",
}


def _is_type_tag(part: str) -> bool:
    return part in {"str", "int", "float", "bool"} or part.startswith(
        ("list[", "dict[", "constrained-", "function-", "json-or-python[")
    )
