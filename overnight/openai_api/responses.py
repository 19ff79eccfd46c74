"""POST /v1/responses (OpenAI's Responses API): the request, read as a chat request, and the Response
object made of the chat answer.

A Responses body becomes a ChatCompletionRequest (as_chat): `instructions` a system message; `input`
text a user message, or items: messages (input_text / output_text parts), `function_call` items an
assistant's tool_calls, `function_call_output` items tool messages; flat function tools nested as chat
takes them; `text.format` a response_format; `max_output_tokens` max_completion_tokens;
`reasoning.effort` a chat-template variable (reasoning_effort). So the template, the parsers, the
grammar of a forced call and every check are the chat route's. No state is kept: `store: true`,
`previous_response_id` and `background` are refused by name.

The answer becomes a Response object (response_objects.py).

Registers itself in protocol.ROUTES (this package's __init__ imports it, so any import of the package does).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PrivateAttr, ValidationError, model_validator

from overnight.openai_api.errors import ApiError
from overnight.openai_api.protocol import (
    ROUTES,
    Bool,
    ChatCompletionRequest,
    Float,
    Int,
    _Body,
    describe_validation_error,
)

RESPONSES_URL = "/v1/responses"
_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text")


class ResponsesRequest(_Body):
    """The body of POST /v1/responses."""

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: Int | None = Field(None, ge=1)
    temperature: Float | None = Field(None, ge=0.0, le=2.0)
    top_p: Float | None = Field(None, gt=0.0, le=1.0)
    reasoning: dict[str, Any] | None = None  # {"effort": ..., "summary": ...}
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: Bool | None = None
    store: Bool | None = None
    previous_response_id: str | None = None
    background: Bool | None = None
    stream: Bool = False
    metadata: dict[str, Any] | None = None
    user: str | None = None
    truncation: Literal["disabled", "auto"] | None = None
    # vLLM-style sampling extras pass through to the chat request.
    seed: Int | None = None
    top_k: Int | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    _chat: ChatCompletionRequest | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _no_state(self) -> ResponsesRequest:
        # ApiErrors leave pydantic as they are, with the field they name.
        if self.store:
            raise ApiError(
                "invalid_request",
                "store: true is not supported: this server keeps no responses (send store: false)",
                "store",
            )
        if self.previous_response_id is not None:
            raise ApiError(
                "invalid_request",
                "previous_response_id is not supported: no responses are stored; send the conversation in input",
                "previous_response_id",
            )
        if self.background:
            raise ApiError("invalid_request", "background: not supported", "background")
        if self.input == "" or self.input == []:
            raise ApiError("invalid_request", "input: must not be empty", "input")
        self.as_chat()  # every check of the chat request it becomes, now (ApiError naming the field)
        return self

    @property
    def include_usage(self) -> bool:
        return False

    @property
    def continuous_usage(self) -> bool:
        return False

    def as_chat(self) -> ChatCompletionRequest:
        """The chat request this body asks; ApiError naming the field (input, tools, text) otherwise."""
        if self._chat is None:
            self._chat = self._build_chat()
        return self._chat

    def _build_chat(self) -> ChatCompletionRequest:
        body: dict[str, Any] = {"messages": _messages(self.instructions, self.input), "n": 1}
        for name in ("model", "temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty", "user"):
            value = getattr(self, name)
            if value is not None:
                body[name] = value
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        kwargs = dict(self.chat_template_kwargs or {})
        effort = (self.reasoning or {}).get("effort")
        if effort is not None:
            kwargs.setdefault("reasoning_effort", effort)
        if kwargs:
            body["chat_template_kwargs"] = kwargs
        fmt = (self.text or {}).get("format")
        if fmt is not None:
            body["response_format"] = _response_format(fmt)
        if self.tools:
            body["tools"] = [_chat_tool(i, t) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(self.tool_choice)
        if self.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = self.parallel_tool_calls
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            message, param = describe_validation_error(e)
            if param == "messages":
                message, param = "input" + message[len("messages") :], "input"
            raise ApiError("invalid_request", message, param) from None


def _messages(instructions: str | None, items: str | list[Any]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
        return messages
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ApiError("invalid_request", f"{where}: must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise ApiError(
                    "invalid_request",
                    f"{where}.role: must be one of {', '.join(_ROLES)}, got {role!r}",
                    "input",
                )
            messages.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id") or item.get("id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item.get("call_id"),
                    "content": output if isinstance(output, str) else _text(output, where),
                }
            )
        elif kind == "reasoning":
            continue  # earlier reasoning: templates drop it from history
        else:
            raise ApiError(
                "invalid_request",
                f"{where}.type: {kind!r} items are not supported (message, function_call, function_call_output)",
                "input",
            )
    return messages


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ApiError(
                    "invalid_request",
                    f"{where}.content[{j}]: only text parts are supported, got {kind!r}",
                    "input",
                )
            texts.append(str(part.get("text", "")))
        return "\n".join(texts)
    raise ApiError("invalid_request", f"{where}.content: must be a string or a list of text parts", "input")


def _response_format(fmt: Any) -> dict[str, Any]:
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise ApiError(
            "invalid_request", "text.format.type: must be text, json_object or json_schema", "text"
        )
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    if not isinstance(fmt.get("schema"), dict):
        raise ApiError("invalid_request", "text.format.schema: a json_schema format needs a schema", "text")
    return {
        "type": "json_schema",
        "json_schema": {
            "name": fmt.get("name", "response"),
            "schema": fmt["schema"],
            "strict": fmt.get("strict"),
        },
    }


def _chat_tool(i: int, tool: Any) -> Any:
    """Responses' flat function tool -> chat's nested one (a nested one passes as it is)."""
    if not isinstance(tool, dict) or "function" in tool:
        return tool
    if tool.get("type") != "function":
        raise ApiError(
            "invalid_request",
            f"tools[{i}].type: only function tools are supported, got {tool.get('type')!r}",
            "tools",
        )
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": fn}


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


ROUTES[RESPONSES_URL] = ResponsesRequest  # type: ignore[assignment]
