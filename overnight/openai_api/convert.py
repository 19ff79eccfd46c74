"""Our RequestOutputs as the exact response objects of the OpenAI API, as JSON-ready dicts.

    chat_completion(out, model)         -> ChatCompletion        ("chat.completion")
    completion([out, ...], model)       -> Completion            ("text_completion"), one output per prompt
    ChatStream / CompletionStream       -> streaming chunks      ("chat.completion.chunk" / "text_completion")

Choices of a completion with several prompts are numbered prompt-major: prompt p, sample j has index
p * n + j, the order the OpenAI API uses.

finish_reason: our "stop" and "length" pass through. "abort" becomes "stop": the OpenAI schema (and the
official client's types) allow only stop / length / content_filter / tool_calls, and an aborted request is
one nobody is waiting for any more (a closed connection, a shutdown), so what matters is that any body we
do send stays valid. run-batch never writes an aborted request as a success.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from overnight.openai_api.protocol import ChatCompletionRequest, OpenAIRequest
from overnight.openai_api.response_objects import response_object
from overnight.openai_api.responses import ResponsesRequest
from overnight.outputs import Logprob, PromptLogprobs, RequestOutput, SampleLogprobs
from overnight.tool_calls.message import MessagePlan, MessageStream

if TYPE_CHECKING:
    from overnight.tokenizer.tokenizer import Tokenizer

# JSON has no -inf; a token the model gives no chance is reported with this logprob instead.
_MIN_LOGPROB = -9999.0


def new_id(prefix: str) -> str:
    """ "chatcmpl-<hex>", "cmpl-<hex>", "batch_req-<hex>", ..."""
    return f"{prefix}-{uuid.uuid4().hex}"


def finish_reason(reason: str | None) -> str | None:
    if reason is None:
        return None
    return "length" if reason == "length" else "stop"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def usage_of(outputs: Sequence[RequestOutput]) -> dict[str, int]:
    """Each prompt's tokens count once, however many samples (n) it has."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return usage(prompt, completion)


# -- whole responses -----------------------------------------------------------------------------


def chat_message(
    text: str, reason: str | None, plan: MessagePlan | None
) -> tuple[dict[str, Any], str | None]:
    """(message, finish_reason) of one choice: its text as the plan reads it (reasoning_content when a
    reasoning parser is on, tool_calls when calls are read)."""
    if plan is None:
        return {"role": "assistant", "content": text}, finish_reason(reason)
    parsed = plan.parse(text)
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if plan.reasoning is not None:
        message["reasoning_content"] = parsed.reasoning_content
    if parsed.tool_calls:
        message["tool_calls"] = [call.as_json() for call in parsed.tool_calls]
    return message, plan.finish_reason(finish_reason(reason), parsed)


def chat_completion(
    output: RequestOutput,
    model: str,
    *,
    response_id: str | None = None,
    created: int | None = None,
    num_logprobs: int | None = None,
    plan: MessagePlan | None = None,
) -> dict[str, Any]:
    """A ChatCompletion body. num_logprobs is the request's top_logprobs (0 when logprobs is true
    without it); the choices carry logprobs when the outputs have them."""
    choices = []
    for c in sorted(output.outputs, key=lambda c: c.index):
        message, reason = chat_message(c.text, c.finish_reason, plan)
        choices.append(
            {
                "index": c.index,
                "message": message,
                "logprobs": (
                    _chat_logprobs(c.logprobs, num_logprobs or 0, c.token_ids)
                    if c.logprobs is not None
                    else None
                ),
                "finish_reason": reason,
            }
        )
    body = {
        "id": response_id or new_id("chatcmpl"),
        "object": "chat.completion",
        "created": created if created is not None else int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage_of([output]),
    }
    if output.prompt_logprobs is not None:  # vLLM's extra, at the top level for chat
        body["prompt_logprobs"] = prompt_logprobs_json(output.prompt_logprobs)
    return body


def completion(
    outputs: Sequence[RequestOutput],
    model: str,
    *,
    response_id: str | None = None,
    created: int | None = None,
    echo: bool = False,
    prompt_only: bool = False,
    with_prompt_logprobs: bool = False,
    token_text: Callable[[int], str] | None = None,
) -> dict[str, Any]:
    """A Completion body for one output per prompt, in prompt order.

    echo: each choice's text (and logprobs) starts with its prompt's; prompt_only: the choice is the
    prompt alone (max_tokens 0: the one token the engine sampled is dropped). with_prompt_logprobs adds
    vLLM's `prompt_logprobs` to each choice. token_text names the first prompt token in echoed logprobs
    (nothing predicts it, so it has no Logprob that carries its text)."""
    choices = []
    for p, out in enumerate(outputs):
        n = len(out.outputs)
        for c in sorted(out.outputs, key=lambda c: c.index):
            text, lps, token_ids = c.text, c.logprobs, c.token_ids
            if prompt_only:
                text, lps, token_ids = "", ([] if lps is not None else None), []
            logprobs = None
            if lps is not None:
                offset = 0
                if echo:
                    logprobs, offset = _echo_logprobs(out, token_text)
                body, _ = _completion_logprobs(lps, token_ids, offset)
                logprobs = _join_logprobs(logprobs, body) if logprobs else body
            choice: dict[str, Any] = {
                "index": p * n + c.index,
                "text": (out.prompt or "") + text if echo else text,
                "logprobs": logprobs,
                "finish_reason": finish_reason(c.finish_reason),
            }
            if with_prompt_logprobs:
                choice["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
            choices.append(choice)
    return {
        "id": response_id or new_id("cmpl"),
        "object": "text_completion",
        "created": created if created is not None else int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(sum(len(o.prompt_token_ids) for o in outputs), 0)
        if prompt_only
        else usage_of(outputs),
    }


def response_body(
    req: OpenAIRequest | ResponsesRequest,
    outputs: Sequence[RequestOutput],
    model: str,
    *,
    response_id: str | None = None,
    created: int | None = None,
    tokenizer: Tokenizer | None = None,
    plan: MessagePlan | None = None,
) -> dict[str, Any]:
    """The whole response to `req` (chat: one output; completions: one per prompt; responses: the
    Response object of its chat answer)."""
    if isinstance(req, ResponsesRequest):
        chat = chat_completion(outputs[0], model, created=created, plan=plan)
        return response_object(req, chat, response_id=response_id, created=created)
    if isinstance(req, ChatCompletionRequest):
        return chat_completion(
            outputs[0],
            model,
            response_id=response_id,
            created=created,
            num_logprobs=req.num_logprobs,
            plan=plan,
        )

    def token_text(tid: int) -> str:
        assert tokenizer is not None
        return tokenizer.decode([tid], skip_special_tokens=False)

    return completion(
        outputs,
        model,
        response_id=response_id,
        created=created,
        echo=req.echo,
        prompt_only=req.prompt_only,
        with_prompt_logprobs=req.prompt_logprobs is not None,
        token_text=token_text if tokenizer is not None else None,
    )


def prompt_logprobs_json(plp: PromptLogprobs | None) -> list[dict[str, Any] | None] | None:
    """vLLM's prompt_logprobs: per prompt token, {token id: {logprob, rank, decoded_token}} (None first)."""
    if plp is None:
        return None
    return [
        None
        if step is None
        else {
            str(tid): {"logprob": _value(lp), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for tid, lp in step.items()
        }
        for step in plp
    ]


def _echo_logprobs(out: RequestOutput, token_text: Callable[[int], str] | None) -> tuple[dict[str, Any], int]:
    """The legacy logprobs object of the prompt tokens (the first has a null logprob), and the text
    offset after them."""
    ids = out.prompt_token_ids
    plp = out.prompt_logprobs or [None] * len(ids)
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = 0
    for tid, step in zip(ids, plp):
        if step is None or tid not in step:
            text = token_text(tid) if token_text is not None else f"token_id:{tid}"
            values.append(None)
            tops.append(None)
        else:
            lp = step[tid]
            text = _token_text(tid, lp)
            values.append(_value(lp))
            tops.append(
                {_token_text(i, x): _value(x) for i, x in sorted(step.items(), key=lambda kv: kv[1].rank)}
            )
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}, offset


def _join_logprobs(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    return {key: first[key] + second[key] for key in first}


# -- logprobs ------------------------------------------------------------------------------------


def _token_text(token_id: int, lp: Logprob) -> str:
    return lp.decoded_token if lp.decoded_token is not None else f"token_id:{token_id}"


def _value(lp: Logprob) -> float:
    v = lp.logprob
    return v if v >= _MIN_LOGPROB else _MIN_LOGPROB  # also maps NaN, which compares false


def _sampled(step: dict[int, Logprob], token_id: int | None) -> tuple[int, Logprob]:
    """The sampled token's entry: the one at token_id, else (ids lost) the top-ranked."""
    if token_id is not None and token_id in step:
        return token_id, step[token_id]
    return min(step.items(), key=lambda kv: kv[1].rank)


def _chat_logprobs(
    logprobs: SampleLogprobs, k: int, token_ids: Sequence[int] | None = None
) -> dict[str, Any]:
    content = []
    for pos, step in enumerate(logprobs):
        tid, lp = _sampled(step, token_ids[pos] if token_ids else None)
        text = _token_text(tid, lp)
        top = sorted(((i, x) for i, x in step.items() if x.rank <= k), key=lambda kv: kv[1].rank)
        content.append(
            {
                "token": text,
                "logprob": _value(lp),
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [
                    {
                        "token": (t := _token_text(i, x)),
                        "logprob": _value(x),
                        "bytes": list(t.encode("utf-8")),
                    }
                    for i, x in top
                ],
            }
        )
    return {"content": content}


def _completion_logprobs(
    logprobs: SampleLogprobs, token_ids: Sequence[int] | None = None, offset: int = 0
) -> tuple[dict[str, Any], int]:
    """The legacy logprobs object, and the text offset after its last token (for the next chunk)."""
    tokens: list[str] = []
    values: list[float] = []
    tops: list[dict[str, float]] = []
    offsets: list[int] = []
    for pos, step in enumerate(logprobs):
        tid, lp = _sampled(step, token_ids[pos] if token_ids else None)
        text = _token_text(tid, lp)
        tokens.append(text)
        values.append(_value(lp))
        # The top-k by rank, plus the sampled token when it ranks lower.
        tops.append(
            {_token_text(i, x): _value(x) for i, x in sorted(step.items(), key=lambda kv: kv[1].rank)}
        )
        offsets.append(offset)
        offset += len(text)
    body = {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
    return body, offset


# -- streaming -----------------------------------------------------------------------------------


class _Stream:
    """Chunk state of one streaming response: which choices have started, tokens counted so far."""

    def __init__(
        self,
        model: str,
        response_id: str,
        include_usage: bool,
        created: int | None,
        continuous_usage: bool = False,
    ) -> None:
        self.model = model
        self.id = response_id
        self.created = created if created is not None else int(time.time())
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage  # every chunk carries the usage so far
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self._counted_prompts: set[int] = set()

    def _count(self, prompt_index: int, out: RequestOutput) -> None:
        if prompt_index not in self._counted_prompts:
            self._counted_prompts.add(prompt_index)
            self.prompt_tokens += len(out.prompt_token_ids)
        self.completion_tokens += sum(len(c.token_ids) for c in out.outputs)

    def _chunk(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.continuous_usage:
            chunk["usage"] = usage(self.prompt_tokens, self.completion_tokens)
        elif self.include_usage:
            chunk["usage"] = None
        return chunk

    def usage_chunk(self, obj: str) -> dict[str, Any] | None:
        """The last chunk when include_usage is set: no choices, the whole response's usage."""
        if not self.include_usage:
            return None
        chunk = self._chunk(obj, [])
        chunk["usage"] = usage(self.prompt_tokens, self.completion_tokens)
        return chunk


class ChatStream(_Stream):
    """Streaming chat: feed each delta RequestOutput (stream=True) to chunks(); send the chunks as SSE
    `data: {json}` lines, then final_chunks(), then `data: [DONE]`."""

    OBJECT = "chat.completion.chunk"

    def __init__(
        self,
        model: str,
        *,
        response_id: str | None = None,
        include_usage: bool = False,
        num_logprobs: int | None = None,
        created: int | None = None,
        continuous_usage: bool = False,
        plan: MessagePlan | None = None,
    ) -> None:
        super().__init__(model, response_id or new_id("chatcmpl"), include_usage, created, continuous_usage)
        self.num_logprobs = num_logprobs
        self.plan = plan
        self._started: set[int] = set()
        self._messages: dict[int, MessageStream] = {}  # per choice, with a plan

    def chunks(self, delta: RequestOutput) -> list[dict[str, Any]]:
        self._count(0, delta)
        out = []
        for c in delta.outputs:
            message: dict[str, Any] = {}
            if c.index not in self._started:  # the first chunk of a choice names the role
                self._started.add(c.index)
                message["role"] = "assistant"
            reason = finish_reason(c.finish_reason)
            if self.plan is None:
                if c.text or "role" in message:
                    message["content"] = c.text
            else:
                reason = self._read(c.index, c.text, reason, message)
            lps = None
            if c.logprobs is not None and self.num_logprobs is not None:
                lps = _chat_logprobs(c.logprobs, self.num_logprobs, c.token_ids)
            # Tool calls go out one delta a chunk, as OpenAI sends them: a call's first (id, name,
            # empty arguments), then its argument fragments; the choice's other fields come first.
            calls = message.pop("tool_calls", [])
            parts = [message] if message or not calls else []
            parts += [{"tool_calls": [call]} for call in calls]
            if not parts and (lps is not None or reason is not None):
                parts = [message]
            for i, part in enumerate(parts):
                last = i == len(parts) - 1
                out.append(
                    self._chunk(
                        self.OBJECT,
                        [
                            {
                                "index": c.index,
                                "delta": part,
                                "logprobs": lps if i == 0 else None,
                                "finish_reason": reason if last else None,
                            }
                        ],
                    )
                )
        return out

    def _read(self, index: int, text: str, reason: str | None, message: dict[str, Any]) -> str | None:
        """Fills `message` with what the plan reads of this text delta; the finish_reason to send."""
        assert self.plan is not None
        stream = self._messages.get(index)
        if stream is None:
            stream = self._messages[index] = self.plan.stream()
        d = stream.feed(text) if text else None
        if reason is not None:
            last = stream.finish()
            if d is None:
                d = last
            else:
                d.content += last.content
                d.reasoning_content += last.reasoning_content
                d.tool_calls = d.tool_calls + last.tool_calls
        if d is not None:
            if d.reasoning_content:
                message["reasoning_content"] = d.reasoning_content
            if d.content or "role" in message:
                message["content"] = d.content
            if d.tool_calls:
                message["tool_calls"] = d.tool_calls
        elif "role" in message:
            message["content"] = ""
        if reason == "stop" and stream.has_calls and not self.plan.named:
            return "tool_calls"
        return reason

    def final_chunks(self) -> list[dict[str, Any]]:
        chunk = self.usage_chunk(self.OBJECT)
        return [chunk] if chunk else []


class CompletionStream(_Stream):
    """Streaming completions: feed each delta RequestOutput with the index of its prompt (0 for a
    single prompt) and the request's n."""

    OBJECT = "text_completion"

    def __init__(
        self,
        model: str,
        *,
        response_id: str | None = None,
        include_usage: bool = False,
        n: int = 1,
        created: int | None = None,
        continuous_usage: bool = False,
    ) -> None:
        super().__init__(model, response_id or new_id("cmpl"), include_usage, created, continuous_usage)
        self.n = n
        self._offsets: dict[int, int] = {}

    def chunks(self, prompt_index: int, delta: RequestOutput) -> list[dict[str, Any]]:
        self._count(prompt_index, delta)
        out = []
        for c in delta.outputs:
            index = prompt_index * self.n + c.index
            lps = None
            if c.logprobs is not None:
                lps, self._offsets[index] = _completion_logprobs(
                    c.logprobs, c.token_ids, self._offsets.get(index, 0)
                )
            reason = finish_reason(c.finish_reason)
            # A step that produced tokens sends a chunk even when they show no text yet (held back
            # for a stop string, or no tokenizer): clients see each token arrive.
            if not c.text and not c.token_ids and lps is None and reason is None:
                continue
            out.append(
                self._chunk(
                    self.OBJECT, [{"index": index, "text": c.text, "logprobs": lps, "finish_reason": reason}]
                )
            )
        return out

    def final_chunks(self) -> list[dict[str, Any]]:
        chunk = self.usage_chunk(self.OBJECT)
        return [chunk] if chunk else []
