"""Request bodies of the OpenAI API (/v1/chat/completions, /v1/completions, /v1/embeddings) as pydantic
models.

Shared by `overnight run-batch` and `overnight serve`. Field names, defaults and ranges follow the OpenAI
API, plus the sampling extras users pass to vLLM (top_k, min_p, repetition_penalty, ignore_eos,
min_tokens, logit_bias, allowed_token_ids, bad_words, prompt_logprobs, truncate_prompt_tokens, ...).
Unknown fields are ignored, so bodies written for other servers still load; the fields of the OpenAI API
and of vLLM that would change the answer in a way we do not honour (UNSUPPORTED_FIELDS: suffix, beam
search, tools outside chat, ...) are refused with a 400 naming the field rather than silently dropped.
Chat takes function tools (tools, tool_choice: overnight/tool_calls) and reasoning (overnight/reasoning).

Numbers are strict: `"0.5"` or `true` where a number belongs is an error, not a guess.

Structured outputs come from OpenAI's `response_format` (json_object, json_schema) or vLLM's extra fields
(`structured_outputs`, and the older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`);
a body may set at most one constraint.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from overnight.entrypoints.prompts import ChatRole, render_conversation
from overnight.errors import InvalidRequestError
from overnight.openai_api.errors import ApiError
from overnight.pooling_params import PoolingParams
from overnight.sampling_params import SamplingParams, StructuredOutputsParams
from overnight.tool_calls.forced import ToolError, check_tools, named_choice

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
    # vLLM's extension: every chunk carries the usage so far, so a client sees how many tokens a chunk
    # holds without asking for logprobs (a chunk holds several when the server merged steps).
    continuous_usage_stats: Bool = False


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ImageUrl(_Body):
    url: str  # data: URI, file:// URL or path (--allowed-local-media-path), http(s) (--allow-media-urls)
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the image processor decides


class ImageUrlPart(_Body):
    type: Literal["image_url"]
    image_url: ImageUrl


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text, as the API returned it


class AssistantToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: ChatRole  # the roles LLM.chat takes too (entrypoints/prompts.py)
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    reasoning_content: str | None = None  # an assistant's earlier reasoning (templates may show it)

    @model_validator(mode="after")
    def _text_parts_only(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id (the id of the call it answers)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"only an assistant message may hold tool_calls, not a {self.role} message")
        if self.content is None and self.role != "assistant":
            raise ValueError(
                f"content: a {self.role} message needs content (only an assistant's may be null)"
            )
        if isinstance(self.content, list):
            for part in self.content:
                if part.get("type") == "image_url":
                    ImageUrlPart.model_validate(part)
                    continue
                if part.get("type") != "text":
                    raise ValueError(
                        f"content part of type {part.get('type')!r} is not supported: only text and "
                        "image_url parts"
                    )
                TextPart.model_validate(part)
        return self

    @property
    def has_images(self) -> bool:
        return isinstance(self.content, list) and any(p.get("type") == "image_url" for p in self.content)

    def text(self) -> str:
        """The content as one string; text parts are joined with newlines."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part["text"] for part in self.content if part.get("type") == "text")


class JsonSchemaFormat(_Body):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: Bool | None = None  # the schema is always enforced strictly


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_json_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("a json_schema response format needs json_schema.schema")
        return self


# vLLM's structured_outputs body keys: ours, and ones that change nothing here.
_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace")
_STRUCTURED_IGNORED = ("disable_fallback", "disable_additional_properties")  # strict schemas already
# The older vLLM fields: body field -> StructuredOutputsParams field.
_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


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
    # Structured outputs (at most one of these).
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[Annotated[str, Strict()]] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None  # refused: whitespace is compact or free, not a pattern
    spaces_between_special_tokens: Bool = True
    logit_bias: dict[str, Float] | None = None  # token id (as a string) -> bias in [-100, 100]
    allowed_token_ids: list[Annotated[int, Strict(), Field(ge=0)]] | None = Field(None, min_length=1)
    bad_words: list[str] | None = None
    prompt_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    truncate_prompt_tokens: Int | None = Field(None, ge=-1)
    add_special_tokens: Bool | None = None  # None: the route's default (completions yes, chat no)

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

    @field_validator("guided_whitespace_pattern")
    @classmethod
    def _no_whitespace_pattern(cls, v: str | None) -> str | None:
        if v is not None:
            raise ValueError(
                "not supported (structured_outputs.disable_any_whitespace picks compact or free)"
            )
        return v

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"keys must be token ids written as strings, got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"bias {bias} of token {key} is outside [-100, 100]")
        return v

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate_positive(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError("must be -1 (keep what fits the context) or at least 1")
        return v

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs_not_streamed(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and info.data.get("stream"):
            raise ValueError("not available with stream=true")
        return v

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk: asked with include_usage, as vLLM reads the pair."""
        return bool(self.include_usage and self.stream_options and self.stream_options.continuous_usage_stats)

    def structured(self) -> StructuredOutputsParams | None:
        """The one structured-output constraint the body sets, if any. Raises InvalidRequestError (its
        `param` naming the field) for two at once or a malformed one; whether the grammar compiles is
        the engine's check."""
        given: list[tuple[str, dict[str, Any]]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            assert rf.json_schema is not None
            given.append(("response_format", {"json": rf.json_schema.schema_}))
        if self.structured_outputs is not None:
            so = self.structured_outputs
            unknown = sorted(set(so) - set(_STRUCTURED_KEYS) - set(_STRUCTURED_IGNORED))
            if unknown:
                raise _param_error(
                    "structured_outputs",
                    f"unsupported key {unknown[0]!r} (known: {', '.join(_STRUCTURED_KEYS)})",
                )
            given.append(("structured_outputs", {k: v for k, v in so.items() if k in _STRUCTURED_KEYS}))
        for name, kind in _GUIDED.items():
            value = getattr(self, name)
            if value is not None:
                given.append((name, {kind: value}))
        if not given:
            return None
        if len(given) > 1:
            names = " and ".join(name for name, _ in given)
            raise _param_error(given[1][0], f"only one structured output constraint may be set, got {names}")
        name, kwargs = given[0]
        try:
            return StructuredOutputsParams(**kwargs)
        except InvalidRequestError as e:
            raise _param_error(name, str(e)) from None

    def _params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        best_of: int | None = None,
    ) -> SamplingParams:
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
            structured_outputs=self.structured(),
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            best_of=best_of,
        )

    def explicit_max_tokens(self) -> tuple[str, int] | None:
        """(field name, value) of the output limit the body sets itself; None when it leaves it to the
        context (chat) or the API's default (completions' 16), which never fail the context check."""
        return None


def _param_error(param: str, message: str) -> InvalidRequestError:
    e = InvalidRequestError(f"{param}: {message}")
    e.param = param  # type: ignore[attr-defined]  # read by ApiError.from_exception
    return e


class ChatCompletionRequest(_SamplingFields):
    """The body of POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_tokens: Int | None = Field(None, ge=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: Bool = False
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # Extras: how the chat template is applied.
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False  # the output continues the last (assistant) message
    chat_template_kwargs: dict[str, Any] | None = None
    # Function tools (overnight/tool_calls): rendered by the chat template; tool_choice decides whether
    # calls are read ("auto"), forced by a grammar (named, "required") or not read ("none").
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: Bool | None = None  # "required" may call several tools either way
    # OpenAI's reasoning effort: a chat-template variable (gpt-oss renders it into its system message).
    reasoning_effort: Literal["low", "medium", "high"] | None = None

    @model_validator(mode="after")
    def _tools_are_well_formed(self) -> ChatCompletionRequest:
        # An ApiError (not a ValueError) leaves pydantic as it is: its message names the tool and field.
        try:
            if self.tools:
                check_tools(self.tools)
                named_choice("auto" if self.tool_choice is None else self.tool_choice, self.tools)
            elif self.tool_choice is not None and self.tool_choice not in ("none", "auto"):
                raise ToolError("tool_choice", f"{self.tool_choice!r} needs tools to choose from")
        except ToolError as e:
            raise ApiError("invalid_request", str(e), e.param.split("[")[0].split(".")[0]) from None
        return self

    @model_validator(mode="after")
    def _continue_final_message(self) -> ChatCompletionRequest:
        if self.continue_final_message:
            if "add_generation_prompt" in self.model_fields_set and self.add_generation_prompt:
                raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
            self.add_generation_prompt = False
            if self.messages and self.messages[-1].role != "assistant":
                raise ValueError("continue_final_message needs the last message to be the assistant's")
        return self

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

    @property
    def max_output_tokens(self) -> int | None:
        """max_completion_tokens wins over the older max_tokens; None means up to the context."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def explicit_max_tokens(self) -> tuple[str, int] | None:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        if self.max_tokens is not None:
            return "max_tokens", self.max_tokens
        return None

    @property
    def num_logprobs(self) -> int | None:
        """Top logprobs per token (0: only the sampled token's), or None when logprobs are off."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def to_sampling_params(self) -> SamplingParams:
        return self._params(self.max_output_tokens, self.num_logprobs)

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as {"role", "content": str} dicts for the chat template."""
        return conversation_of(self.messages)

    def engine_prompts(self, tokenizer: Tokenizer | None) -> list[tuple[str | None, list[int]]]:
        """The one prompt (text, token ids) the chat template makes of the messages."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", self.reasoning_effort)
        if self.tools:
            kwargs["tools"] = self.tools
        if self.continue_final_message:
            kwargs["continue_final_message"] = True
        text, ids = render_conversation(
            self.conversation(),
            tokenizer,
            add_generation_prompt=self.add_generation_prompt,
            **kwargs,
        )
        if self.add_special_tokens and tokenizer is not None:
            ids = tokenizer.encode(text, add_special_tokens=True)
        return [(text, ids)]


class CompletionRequest(_SamplingFields):
    """The body of POST /v1/completions. A list prompt gives one choice per prompt (times n)."""

    prompt: str | list[str] | TokenIds | list[TokenIds]
    echo: Bool = False  # (before max_tokens: its check reads echo)
    # 0 only with echo: the prompt's own logprobs, nothing generated (scoring, perplexity).
    max_tokens: Int | None = Field(COMPLETION_DEFAULT_MAX_TOKENS, ge=0)
    logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: Int | None = Field(None, ge=1, le=128)

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("must not be an empty list")
        return v

    @field_validator("echo")
    @classmethod
    def _echo_not_streamed(cls, v: bool, info: ValidationInfo) -> bool:
        if v and info.data.get("stream"):
            raise ValueError("not available with stream=true")
        return v

    @field_validator("max_tokens")
    @classmethod
    def _zero_only_with_echo(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v == 0 and not info.data.get("echo"):
            raise ValueError("0 is allowed only with echo (to score the prompt)")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of_at_least_n(cls, v: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if v is not None and v < n:
            raise ValueError(f"must be at least n ({n}), got {v}")
        if v is not None and v > n and info.data.get("stream"):
            raise ValueError("above n is not available with stream=true")
        return v

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def prompt_only(self) -> bool:
        """echo with max_tokens 0: the answer is the prompt (and its logprobs); one token is sampled
        and dropped, as the engine always samples at least one."""
        return self.echo and self.max_tokens == 0

    def explicit_max_tokens(self) -> tuple[str, int] | None:
        if "max_tokens" in self.model_fields_set and self.max_tokens:
            return "max_tokens", self.max_tokens
        return None

    def to_sampling_params(self) -> SamplingParams:
        # echo with logprobs reports the prompt's tokens too: their logprobs are prompt logprobs.
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            prompt_logprobs = max(self.logprobs, prompt_logprobs or 0)
        return self._params(
            1 if self.prompt_only else self.max_tokens,
            self.logprobs,
            prompt_logprobs=prompt_logprobs,
            best_of=self.best_of,
        )

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
        special = True if self.add_special_tokens is None else self.add_special_tokens
        for p in self.prompt_list():
            if isinstance(p, str):
                if tokenizer is None:
                    raise InvalidRequestError("text prompts need a tokenizer (skip_tokenizer_init is set)")
                out.append((p, tokenizer.encode(p, add_special_tokens=special)))
            else:
                # echo shows the prompt: a token-id prompt's text is its decoding
                text = tokenizer.decode(p, skip_special_tokens=False) if self.echo and tokenizer else None
                out.append((text, p))
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
        return PoolingParams(dimensions=self.dimensions, normalize=self.normalize, task="embed")

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


# Fields of the OpenAI API and of vLLM's extra body that would change the answer in a way this engine
# does not honour, with the values that change nothing (None always does). Set to anything else, each is
# a 400 naming it: a user must not believe output is constrained or tool-called when it is not. A field
# a route declares itself (completions' echo, best_of) is that route's own. Any field not listed here and
# not declared is ignored, as the OpenAI API ignores what it does not know. The structured-output fields
# (response_format, structured_outputs, guided_*) are declared and honoured.
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "tools": ([],),  # chat's are declared (overnight/tool_calls); these entries refuse them elsewhere
    "tool_choice": ("none", "auto"),
    "parallel_tool_calls": (True, False),
    "continue_final_message": (False,),
    "functions": ([],),  # the deprecated form of tools
    "function_call": ("none", "auto"),
    "suffix": ("",),
    "echo": (False,),  # chat's echo (completions' is declared)
    "best_of": (1,),  # chat has none
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "web_search_options": (),
    "use_beam_search": (False,),
    "length_penalty": (1.0,),
    "guided_decoding_backend": (),
    "logits_processors": ([],),
    "return_tokens_as_token_ids": (False,),
    "documents": ([],),
    "chat_template": (),
    "mm_processor_kwargs": ({},),
    "priority": (0,),
    "vllm_xargs": ({},),
    "kv_transfer_params": (),
}


def _declared(model_cls: type[BaseModel]) -> set[str]:
    """The body keys a route declares: its fields, and their alias choices (a field vLLM has renamed)."""
    names = set(model_cls.model_fields)
    for info in model_cls.model_fields.values():
        alias = info.validation_alias
        if isinstance(alias, AliasChoices):
            names.update(c for c in alias.choices if isinstance(c, str))
    return names


def _refuse_unsupported(body: dict[str, Any], model_cls: type[BaseModel]) -> None:
    declared = _declared(model_cls)
    for name, value in body.items():
        neutral = UNSUPPORTED_FIELDS.get(name)
        if neutral is None or name in declared or value is None:
            continue
        # (True == 1 in Python: a bool must meet a bool, so `priority: false` is not taken for 0.)
        if not any(value == n and isinstance(value, bool) == isinstance(n, bool) for n in neutral):
            raise ApiError("invalid_request", f"{name}: not supported by this server", name)


def check_text(value: Any, path: str = "") -> None:
    """Raise ApiError naming the field whose text holds a lone surrogate: JSON's \\ud800 escapes decode
    to one, and no tokenizer can encode it (it is not Unicode text)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            where = path or "body"
            raise ApiError(
                "invalid_request",
                f"{where}: the text holds a lone surrogate (\\u{ord(value[e.start]):04x} at character "
                f"{e.start}), which is not valid Unicode",
                where.split(".")[0].split("[")[0] or None,
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_text(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_text(item, f"{path}[{i}]")


def conversation_of(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as {"role", "content": str} dicts for the chat template."""
    conv: list[dict[str, Any]] = []
    for m in messages:
        # Image parts stay parts (the template writes each as the model's image placeholder).
        content: Any = m.content if m.has_images else m.text()
        msg: dict[str, Any] = {"role": m.role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    # Templates write arguments with tojson: a mapping, as transformers documents it.
                    "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)},
                }
                for c in m.tool_calls
            ]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None:
            msg["reasoning_content"] = m.reasoning_content
        conv.append(msg)
    return conv


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_request(url: str, body: Any) -> AnyRequest:
    """The body of a request to `url`, validated. Raises ApiError: unsupported_url, or invalid_request
    with a readable message and the offending field as `param`."""
    model_cls = ROUTES.get(url)
    if model_cls is None:
        raise ApiError("unsupported_url", f"unsupported url {url!r}: use one of {', '.join(ROUTES)}", "url")
    if not isinstance(body, dict):
        raise ApiError("invalid_request", "the request body must be a JSON object", "body")
    _refuse_unsupported(body, model_cls)
    check_text(body)
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
