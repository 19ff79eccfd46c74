"""An output as the assistant message it is: reasoning, answer text and tool calls, whole or streamed.

A request's MessagePlan is made where its prompt is (plan_message: the chat entry points of the server,
run-batch and LLM.chat): which reasoning parser reads it and whether the output starts inside a block,
which tool parser reads calls (none, a --tool-call-parser for "auto", ForcedParser for a named or
"required" tool_choice), and what that changes in its SamplingParams (the grammar of a forced call; the
grammar of a structured output starting after the reasoning; special tokens kept for parsers whose
markers are special tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from overnight.reasoning.parsers import ReasoningParser, ReasoningStream, get_reasoning_parser
from overnight.tool_calls.forced import (
    ToolError,
    check_enforceable,
    check_tools,
    forced_schema,
    harmony_call_tag,
    named_choice,
)
from overnight.tool_calls.formats import TOOL_PARSERS, ForcedParser, ToolParser
from overnight.tool_calls.stream import ToolCall, ToolCallStream, parse_tool_calls

if TYPE_CHECKING:
    from overnight.options import ChatOptions
    from overnight.reasoning.harmony import TextStream as HarmonyStream
    from overnight.sampling_params import SamplingParams

AUTO_FLAGS = "--enable-auto-tool-choice and --tool-call-parser NAME"


@dataclass
class Message:
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class MessagePlan:
    reasoning: ReasoningParser | None = None
    starts_in_reasoning: bool = False
    tools: ToolParser | None = None  # None: no calls are read ("none", or no tools)
    named: bool = False  # a named tool_choice: OpenAI reports finish_reason "stop" for it
    # gpt-oss's harmony format (reasoning/harmony.py): the channels say what is reasoning, answer and
    # tool call, so harmony replaces both parsers; read_calls: tools were given (and not "none").
    harmony: bool = False
    read_calls: bool = False

    @property
    def is_plain(self) -> bool:
        return self.reasoning is None and self.tools is None and not self.harmony

    def parse(self, text: str) -> Message:
        if self.harmony:
            from overnight.reasoning.harmony import parse_text

            reply = parse_text(text)
            read = [ToolCall(c.name, c.arguments, c.id) for c in reply.tool_calls] if self.read_calls else []
            return Message(reply.content or None if read else reply.content, reply.reasoning_content, read)
        reasoning = None
        if self.reasoning is not None:
            reasoning, text = self.reasoning.split(text, self.starts_in_reasoning)
        calls: list[ToolCall] = []
        if self.tools is not None:
            text, calls = parse_tool_calls(self.tools, text)
        content: str | None = text
        if not text and (calls or reasoning is not None):
            content = None
        return Message(content, reasoning, calls)

    def finish_reason(self, reason: str | None, message: Message | None) -> str | None:
        """OpenAI's: "tool_calls" when the model stopped after calling tools (not for a named choice)."""
        if reason == "stop" and message is not None and message.tool_calls and not self.named:
            return "tool_calls"
        return reason

    def stream(self) -> MessageStream:
        return MessageStream(self)


@dataclass
class MessageDelta:
    content: str = ""
    reasoning_content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning_content or self.tool_calls)


class MessageStream:
    """Text deltas in, message deltas out: reasoning first, then the answer, which the tool parser
    reads when there is one. finish() flushes what was held back."""

    def __init__(self, plan: MessagePlan) -> None:
        self.plan = plan
        self._harmony: HarmonyStream | None = None
        if plan.harmony:
            from overnight.reasoning.harmony import TextStream

            self._harmony = TextStream()
            self._harmony_calls: list[ToolCall] = []
        self._reasoning: ReasoningStream | None = (
            plan.reasoning.stream(plan.starts_in_reasoning) if plan.reasoning is not None else None
        )
        self._tools = ToolCallStream(plan.tools) if plan.tools is not None else None

    @property
    def has_calls(self) -> bool:
        return bool(self.calls)

    @property
    def calls(self) -> list[ToolCall]:
        """The calls sent so far (all of them after finish())."""
        if self._harmony is not None:
            return self._harmony_calls
        return self._tools.calls if self._tools is not None else []

    def feed(self, text: str) -> MessageDelta:
        return self._step(text, final=False)

    def finish(self) -> MessageDelta:
        return self._step("", final=True)

    def _step(self, text: str, final: bool) -> MessageDelta:
        if self._harmony is not None:
            return self._harmony_step(text, final)
        out = MessageDelta()
        if self._reasoning is not None:
            out.reasoning_content, text = self._reasoning.finish() if final else self._reasoning.feed(text)
        if self._tools is None:
            out.content = text
            return out
        content, calls = self._tools.feed(text) if text else ("", [])
        out.content, out.tool_calls = content, calls
        if final:
            more, more_calls = self._tools.finish()
            out.content += more
            out.tool_calls = out.tool_calls + more_calls
        return out

    def _harmony_step(self, text: str, final: bool) -> MessageDelta:
        assert self._harmony is not None
        step = self._harmony.finish() if final else self._harmony.feed(text)
        out = MessageDelta(step.content, step.reasoning)
        if self.plan.read_calls:
            for call in step.calls:  # a harmony call arrives whole, when its message ends
                i = len(self._harmony_calls)
                self._harmony_calls.append(ToolCall(call.name, call.arguments, call.id))
                out.tool_calls.append(
                    {
                        "index": i,
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": ""},
                    }
                )
                out.tool_calls.append({"index": i, "function": {"arguments": call.arguments}})
        return out


def plan_message(
    options: ChatOptions | None,
    params: SamplingParams,
    prompt: str | None,
    tools: Any = None,
    tool_choice: Any = None,
    parallel_tool_calls: bool | None = None,
) -> tuple[MessagePlan, SamplingParams]:
    """The plan of one chat request and its SamplingParams with what the plan needs. Raises ToolError
    (its `param` naming the field) for malformed tools, a choice naming no tool, or "auto" on an engine
    started without the auto tool-choice options."""
    from overnight.reasoning.harmony import is_harmony_prompt
    from overnight.sampling_params import StructuredOutputsParams

    if is_harmony_prompt(prompt):
        return _plan_harmony(params, tools, tool_choice)
    reasoning = None
    if options is not None and options.reasoning_parser:
        reasoning = get_reasoning_parser(options.reasoning_parser)
    parser: ToolParser | None = None
    named = False
    resolved = _resolve_tool_choice(tools, tool_choice, params)
    if resolved is not None:
        tools, choice, name = resolved
        if name is not None or choice == "required":
            schema = forced_schema(tools, name, parallel=parallel_tool_calls is not False)
            params = replace(params, structured_outputs=StructuredOutputsParams(json=schema))
            parser, named = ForcedParser(tools), name is not None
        elif choice == "auto":
            if options is None or not options.enable_auto_tool_choice or not options.tool_call_parser:
                raise ToolError(
                    "tool_choice",
                    f'"auto" tool choice needs the engine started with {AUTO_FLAGS} '
                    "(LLM(enable_auto_tool_choice=True, tool_call_parser=NAME)); or send tool_choice "
                    '"none", "required" or a named function',
                )
            parser = TOOL_PARSERS[options.tool_call_parser](tools)
            if parser.needs_special_tokens and params.skip_special_tokens:
                params = replace(params, skip_special_tokens=False)
    starts = reasoning.starts_in_reasoning(prompt) if reasoning is not None else False
    plan = MessagePlan(reasoning, starts, parser, named)
    if (
        reasoning is not None
        and params.structured_outputs is not None
        and not reasoning.closed_in_prompt(prompt)
    ):
        # The grammar constrains the answer: it starts after the end of the reasoning.
        params = replace(
            params, structured_outputs=replace(params.structured_outputs, start_after=reasoning.end)
        )
    return plan, params


def _resolve_tool_choice(
    tools: Any, tool_choice: Any, params: SamplingParams
) -> tuple[list[dict[str, Any]], Any, str | None] | None:
    """(the checked tools, the tool_choice ("auto" when unset), the function it names or None), or
    None for a request without tools. ToolError for malformed tools, a choice naming no tool, a
    tool_choice other than "none" / "auto" without tools, and a forced call (named or "required")
    that its grammar cannot enforce or that comes with another structured output."""
    if tools is None or (isinstance(tools, list) and not tools):
        if tool_choice is not None and tool_choice not in ("none", "auto"):
            raise ToolError("tool_choice", f"{tool_choice!r} needs tools to choose from")
        return None
    checked = check_tools(tools)
    choice = "auto" if tool_choice is None else tool_choice
    name = named_choice(choice, checked)
    if name is not None or choice == "required":
        if params.structured_outputs is not None:
            raise ToolError(
                "tool_choice", "a forced tool call cannot be combined with another structured output"
            )
        check_enforceable(checked, name)
    return checked, choice, name


def _plan_harmony(params: SamplingParams, tools: Any, tool_choice: Any) -> tuple[MessagePlan, SamplingParams]:
    """A gpt-oss chat request: the harmony channels split the output (their markers are special tokens,
    so they are kept in the text); a structured output constrains the final answer, after its channel
    header; tool calls are the commentary messages addressed to functions.NAME, whatever the engine's
    tool-call options (the format marks them unambiguously). A named or "required" tool_choice constrains
    the whole reply with harmony_call_tag (tool_calls/forced.py): free analysis, then one call."""
    from overnight.reasoning.harmony import FINAL_MARKER
    from overnight.sampling_params import StructuredOutputsParams

    read_calls = named = False
    forced: dict[str, Any] | None = None  # the structural tag of a named or "required" call
    resolved = _resolve_tool_choice(tools, tool_choice, params)
    if resolved is not None:
        tools, choice, name = resolved
        if name is not None or choice == "required":
            forced, named = harmony_call_tag(tools, name), name is not None
        read_calls = choice != "none"
    params = replace(params, skip_special_tokens=False)
    if forced is not None:  # the whole reply, from its first token (a call after optional analysis)
        params = replace(params, structured_outputs=StructuredOutputsParams(structural_tag=forced))
    elif params.structured_outputs is not None:
        params = replace(
            params, structured_outputs=replace(params.structured_outputs, start_after=FINAL_MARKER)
        )
    return MessagePlan(harmony=True, read_calls=read_calls, named=named), params
