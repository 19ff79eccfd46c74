"""Chat outputs read as messages without a model: reasoning_content beside content, tool_calls with
finish_reason "tool_calls", whole (ChatCompletion) and streamed (chunks at every cut of the text), both
validated by the official `openai` client's types; and the option names against the parser registries."""

from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from overnight.openai_api.convert import ChatStream, chat_completion
from overnight.options import REASONING_PARSER_NAMES, TOOL_CALL_PARSER_NAMES, ChatOptions
from overnight.outputs import CompletionOutput, RequestOutput
from overnight.reasoning import REASONING_PARSERS
from overnight.sampling_params import SamplingParams
from overnight.tool_calls import TOOL_PARSERS
from overnight.tool_calls.message import plan_message

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
TEXT = (
    "<think>\nThe user wants the weather; I should call the tool.\n</think>\n\n"
    "Checking.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
)
OPTIONS = ChatOptions(reasoning_parser="qwen3", enable_auto_tool_choice=True, tool_call_parser="hermes")


def _plan():
    plan, _ = plan_message(OPTIONS, SamplingParams(), "<|im_start|>assistant\n", TOOLS, "auto")
    return plan


def _out(text: str, reason: str | None = "stop", delta: bool = False) -> RequestOutput:
    return RequestOutput(
        "r",
        None,
        [1, 2],
        [CompletionOutput(0, text, [3], None, None, reason)],
        reason is not None,
        delta=delta,
    )


def test_option_names_match_the_registries():
    assert set(REASONING_PARSER_NAMES) == set(REASONING_PARSERS)
    assert set(TOOL_CALL_PARSER_NAMES) == set(TOOL_PARSERS)
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ChatOptions(enable_auto_tool_choice=True)


def test_whole_message():
    body = ChatCompletion.model_validate(chat_completion(_out(TEXT), "m", plan=_plan()))
    choice = body.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    assert choice.message.reasoning_content == "The user wants the weather; I should call the tool."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}
    plain, _ = plan_message(ChatOptions(reasoning_parser="qwen3"), SamplingParams(), None)
    body = chat_completion(_out("<think>a</think>b"), "m", plan=plain)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "b", "reasoning_content": "a"}
    assert body["choices"][0]["finish_reason"] == "stop"


def _stream(pieces: list[str]) -> tuple[str, str, dict, str | None]:
    stream = ChatStream("m", plan=_plan())
    content, reasoning, calls, finish = [], [], {}, None
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        for chunk in stream.chunks(_out(piece, "stop" if last else None, delta=True)):
            c = ChatCompletionChunk.model_validate(chunk).choices[0]
            finish = c.finish_reason or finish
            content.append(c.delta.content or "")
            reasoning.append(chunk["choices"][0]["delta"].get("reasoning_content", ""))
            for d in c.delta.tool_calls or []:
                if d.index in calls:
                    calls[d.index]["arguments"] += d.function.arguments
                else:
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": d.function.arguments}
    return "".join(content), "".join(reasoning), calls, finish


def test_every_cut_of_a_stream_gives_the_whole_message():
    whole = chat_completion(_out(TEXT), "m", plan=_plan())["choices"][0]["message"]
    for i in range(0, len(TEXT) + 1, 2):
        content, reasoning, calls, finish = _stream([TEXT[:i], TEXT[i:]])
        assert (content, reasoning) == (whole["content"], whole["reasoning_content"]), i
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]
        ]
        assert finish == "tool_calls"
    content, reasoning, calls, _ = _stream(list(TEXT))
    assert content == whole["content"] and len(calls) == 1


def test_tool_choice_without_tools():
    from overnight.openai_api.errors import ApiError
    from overnight.openai_api.protocol import parse_request

    msgs = [{"role": "user", "content": "hi"}]
    for choice in ("auto", "none"):  # what clients send by default: nothing to choose, nothing changes
        parse_request("/v1/chat/completions", {"messages": msgs, "tool_choice": choice})
    with pytest.raises(ApiError, match="'required' needs tools") as info:
        parse_request("/v1/chat/completions", {"messages": msgs, "tool_choice": "required"})
    assert info.value.param == "tool_choice"


def test_forced_calls_get_the_tools_grammar_and_refuse_what_it_cannot_enforce():
    from overnight.tool_calls.forced import ToolError

    weather = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": weather}}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    plan, params = plan_message(None, SamplingParams(), None, tools, named)
    schema = params.structured_outputs.json
    assert schema["properties"] == {"name": {"const": "get_weather"}, "arguments": weather} and plan.named
    _, params = plan_message(None, SamplingParams(), None, tools, "required", parallel_tool_calls=False)
    assert params.structured_outputs.json["maxItems"] == 1
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}]
    with pytest.raises(ToolError, match=r"tools\[0\].function.parameters: uses 'not'"):
        plan_message(None, SamplingParams(), None, bad, "required")
    plan, params = plan_message(None, SamplingParams(), None, bad, "none")  # no grammar: nothing to enforce
    assert plan.tools is None and params.structured_outputs is None


def test_llm_takes_the_chat_options_and_checks_them_before_loading():
    from overnight import LLM

    chat, rest = ChatOptions.split_kwargs({"reasoning_parser": "qwen3", "dtype": "float32"})
    assert chat == ChatOptions(reasoning_parser="qwen3") and rest == {"dtype": "float32"}
    with pytest.raises(ValueError, match="unknown reasoning parser 'nope'"):
        LLM(reasoning_parser="nope")
    with pytest.raises(ValueError, match="--tool-call-parser"):
        LLM(enable_auto_tool_choice=True)
