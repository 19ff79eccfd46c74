"""The Response object of /v1/responses, whole and streamed, made of its chat request's answer.

Output items: `reasoning` (with a reasoning parser: its text as the summary), `message` with one
`output_text` part, a `function_call` per tool call; usage in input / output tokens. The request's
settings are echoed as OpenAI echoes them; nothing is stored (`store` is false).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from overnight.openai_api.responses import ResponsesRequest
from overnight.outputs import RequestOutput
from overnight.tool_calls.message import MessageDelta, MessagePlan


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
