"""POST /v1/responses (OpenAI's Responses API): the request, read as a chat request, and the Response
object made of the chat answer.

A Responses body becomes a ChatCompletionRequest (as_chat): `instructions` a system message; `input`
text a user message, or items: messages (input_text / output_text parts), `function_call` items an
assistant's tool_calls, `function_call_output` items tool messages; flat function tools nested as chat
takes them; `text.format` a response_format; `max_output_tokens` max_completion_tokens;
`reasoning.effort` a chat-template variable (reasoning_effort). So the template, the parsers, the
grammar of a forced call and every check are the chat route's. No state is kept: `store: true`,
`previous_response_id` and `background` are refused by name.

The answer becomes output items: `reasoning` (with a reasoning parser: its text as the summary),
`message` with one `output_text` part, `function_call` per tool call; usage in input / output tokens.

Registers itself in protocol.ROUTES (this package's __init__ imports it, so any import of the package does).
"""

from __future__ import annotations

import time
import uuid
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
from overnight.outputs import RequestOutput
from overnight.tool_calls.message import MessageDelta, MessagePlan

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


# -- the Response object --------------------------------------------------------------------------


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_object(
    req: ResponsesRequest,
    chat_body: dict[str, Any],
    *,
    response_id: str | None = None,
    created: int | None = None,
) -> dict[str, Any]:
    """The Response of `req` from the ChatCompletion its chat request got (one choice)."""
    choice = chat_body["choices"][0]
    message = choice["message"]
    output: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        output.append(reasoning_item(message["reasoning_content"]))
    if message.get("content"):
        output.append(message_item(message["content"]))
    for call in message.get("tool_calls") or []:
        output.append(function_call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))
    usage = chat_body["usage"]
    incomplete = choice["finish_reason"] == "length"
    return response_shell(
        req,
        chat_body["model"],
        response_id=response_id,
        created=created if created is not None else chat_body.get("created"),
        status="incomplete" if incomplete else "completed",
        output=output,
        usage=response_usage(usage["prompt_tokens"], usage["completion_tokens"]),
    )


def response_usage(input_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }


def response_shell(
    req: ResponsesRequest,
    model: str,
    *,
    response_id: str | None,
    created: int | None,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
) -> dict[str, Any]:
    """A Response with its request's settings echoed, as OpenAI returns them."""
    fmt = (req.text or {}).get("format") or {"type": "text"}
    return {
        "id": response_id or _item_id("resp"),
        "object": "response",
        "created_at": created if created is not None else int(time.time()),
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": model,
        "output": output,
        "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
        "previous_response_id": None,
        "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None},
        "store": False,
        "temperature": req.temperature if req.temperature is not None else 1.0,
        "text": {"format": fmt},
        "tool_choice": req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none"),
        "tools": req.tools or [],
        "top_p": req.top_p if req.top_p is not None else 1.0,
        "truncation": req.truncation or "disabled",
        "usage": usage,
        "user": req.user,
        "metadata": req.metadata or {},
    }


def reasoning_item(text: str, item_id: str | None = None) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id or _item_id("rs"),
        "summary": [{"type": "summary_text", "text": text}],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": "completed",
    }


def message_item(text: str, item_id: str | None = None, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id or _item_id("msg"),
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def function_call_item(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": _item_id("fc"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": "completed",
    }


# -- streaming ------------------------------------------------------------------------------------


class ResponseStream:
    """A streamed Response as OpenAI's events: response.created, response.in_progress; per output item
    response.output_item.added ... .done (a message's text as response.output_text.delta events
    between response.content_part.added and .done; reasoning and function calls whole when they end);
    then response.completed with the whole Response. Feed each delta RequestOutput to chunks()."""

    def __init__(
        self, req: ResponsesRequest, model: str, response_id: str, plan: MessagePlan | None = None
    ) -> None:
        self.req = req
        self.model = model
        self.id = response_id
        self.created = int(time.time())
        self.plan = plan or MessagePlan()
        self._message = self.plan.stream()
        self._seq = 0
        self.output: list[dict[str, Any]] = []
        self._reasoning: list[str] = []
        self._text: list[str] | None = None  # the open message's text, once it started
        self._msg_id = _item_id("msg")
        self._prompt_tokens = 0
        self._output_tokens = 0
        self._incomplete = False

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self._seq += 1
        return {"type": kind, "sequence_number": self._seq - 1, **fields}

    def _shell(self, status: str) -> dict[str, Any]:
        usage = response_usage(self._prompt_tokens, self._output_tokens) if status != "in_progress" else None
        return response_shell(
            self.req,
            self.model,
            response_id=self.id,
            created=self.created,
            status=status,
            output=list(self.output),
            usage=usage,
        )

    def start(self) -> list[dict[str, Any]]:
        shell = self._shell("in_progress")
        return [
            self._event("response.created", response=shell),
            self._event("response.in_progress", response=shell),
        ]

    def chunks(self, delta: RequestOutput) -> list[dict[str, Any]]:
        if not self._prompt_tokens:
            self._prompt_tokens = len(delta.prompt_token_ids)
        events: list[dict[str, Any]] = []
        for c in delta.outputs:
            self._output_tokens += len(c.token_ids)
            d = self._message.feed(c.text) if c.text else MessageDelta()
            events += self._apply(d)
            if c.finish_reason is not None:
                self._incomplete = c.finish_reason == "length"
                events += self._apply(self._message.finish(), final=True)
        return events

    def _apply(self, d: MessageDelta, final: bool = False) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if d.reasoning_content:
            self._reasoning.append(d.reasoning_content)
        reasoning_over = final or d.content or d.tool_calls
        if self._reasoning and reasoning_over:
            events += self._whole_item(reasoning_item("".join(self._reasoning)))
            self._reasoning = []
        if d.content:
            if self._text is None:
                self._text = []
                index = len(self.output)
                events.append(
                    self._event(
                        "response.output_item.added",
                        output_index=index,
                        item={**message_item("", self._msg_id, "in_progress"), "content": []},
                    )
                )
                events.append(
                    self._event(
                        "response.content_part.added",
                        item_id=self._msg_id,
                        output_index=index,
                        content_index=0,
                        part={"type": "output_text", "text": "", "annotations": []},
                    )
                )
                self.output.append(message_item("", self._msg_id, "in_progress"))
            self._text.append(d.content)
            events.append(
                self._event(
                    "response.output_text.delta",
                    item_id=self._msg_id,
                    output_index=self._message_index,
                    content_index=0,
                    delta=d.content,
                    logprobs=[],
                )
            )
        if final:
            if self._text is not None:
                events += self._close_message()
            for call in self._message.calls:
                events += self._whole_item(function_call_item(call.id, call.name, call.arguments))
        return events

    @property
    def _message_index(self) -> int:
        return next(i for i, item in enumerate(self.output) if item.get("id") == self._msg_id)

    def _close_message(self) -> list[dict[str, Any]]:
        assert self._text is not None
        text, index = "".join(self._text), self._message_index
        item = message_item(text, self._msg_id)
        self.output[index] = item
        part = item["content"][0]
        return [
            self._event(
                "response.output_text.done",
                item_id=self._msg_id,
                output_index=index,
                content_index=0,
                text=text,
                logprobs=[],
            ),
            self._event(
                "response.content_part.done",
                item_id=self._msg_id,
                output_index=index,
                content_index=0,
                part=part,
            ),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def _whole_item(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        index = len(self.output)
        self.output.append(item)
        return [
            self._event(
                "response.output_item.added", output_index=index, item={**item, "status": "in_progress"}
            ),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def final_chunks(self) -> list[dict[str, Any]]:
        status = "incomplete" if self._incomplete else "completed"
        kind = "response.incomplete" if self._incomplete else "response.completed"
        return [self._event(kind, response=self._shell(status))]
