"""/v1/responses without a model: the body read as a chat request (input items, instructions, flat tools,
text.format), what is refused by name (store, previous_response_id, non-function tools, image parts),
and the Response object and stream events, validated by the official `openai` client's own types."""

from __future__ import annotations

import json

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from overnight.openai_api.convert import response_body
from overnight.openai_api.errors import ApiError
from overnight.openai_api.protocol import ChatCompletionRequest, parse_request
from overnight.openai_api.response_objects import ResponseStream
from overnight.openai_api.responses import RESPONSES_URL, ResponsesRequest
from overnight.options import ChatOptions
from overnight.outputs import CompletionOutput, RequestOutput
from overnight.sampling_params import SamplingParams
from overnight.tool_calls.message import plan_message

TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def parse(body) -> ResponsesRequest:
    req = parse_request(RESPONSES_URL, body)
    assert isinstance(req, ResponsesRequest)
    return req


def test_text_input_and_settings_become_a_chat_request():
    req = parse(
        {
            "model": "m",
            "input": "Hi there",
            "instructions": "Be brief.",
            "max_output_tokens": 20,
            "temperature": 0,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
            "reasoning": {"effort": "low"},
        }
    )
    chat = req.as_chat()
    assert isinstance(chat, ChatCompletionRequest)
    assert chat.conversation() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
    ]
    params = chat.to_sampling_params()
    assert params.max_tokens == 20 and params.temperature == 0
    assert params.structured_outputs.json == {"type": "object"}
    assert chat.chat_template_kwargs == {"reasoning_effort": "low"}


def test_items_with_calls_and_their_outputs_become_turns():
    req = parse(
        {
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]},
                {
                    "type": "function_call",
                    "call_id": "call_1",
                    "name": "get_weather",
                    "arguments": '{"city": "Oslo"}',
                },
                {
                    "type": "function_call",
                    "call_id": "call_2",
                    "name": "get_weather",
                    "arguments": '{"city": "Rome"}',
                },
                {"type": "function_call_output", "call_id": "call_1", "output": "-3 C"},
                {"type": "function_call_output", "call_id": "call_2", "output": "18 C"},
            ],
            "tools": [TOOL],
            "tool_choice": {"type": "function", "name": "get_weather"},
        }
    )
    chat = req.as_chat()
    conv = chat.conversation()
    assert [m["role"] for m in conv] == ["user", "assistant", "tool", "tool"]
    assert [c["function"]["arguments"] for c in conv[1]["tool_calls"]] == [{"city": "Oslo"}, {"city": "Rome"}]
    assert conv[2]["tool_call_id"] == "call_1" and conv[3]["content"] == "18 C"
    assert chat.tools == [{"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize(
    "body,param,words",
    [
        ({"input": "x", "store": True}, "store", "store"),
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id", "previous_response_id"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "only function tools"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input",
            "input_image",
        ),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input", "tool_call_id"),
        (
            {"input": "x", "tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}},
            "tool_choice",
            "'nope'",
        ),
        ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text", "schema"),
        ({"input": ""}, "input", "empty"),
    ],
)
def test_refused_bodies_name_the_problem(body, param, words):
    with pytest.raises(ApiError) as info:
        parse(body)
    assert words in info.value.message and info.value.param == param


def _output(text: str, reason: str = "stop", n_tokens: int = 5) -> RequestOutput:
    return RequestOutput(
        "r", "prompt", [1, 2, 3], [CompletionOutput(0, text, list(range(n_tokens)), None, None, reason)], True
    )


def test_the_response_object_is_what_the_client_parses():
    req = parse({"input": "Hi", "instructions": "Be brief."})
    body = response_body(req, [_output("Hello! How can I help?")], "tiny")
    r = Response.model_validate(body)
    assert r.output_text == "Hello! How can I help?" and r.status == "completed" and r.object == "response"
    assert r.usage.input_tokens == 3 and r.usage.output_tokens == 5 and r.usage.total_tokens == 8
    assert json.loads(json.dumps(body)) == body
    cut = Response.model_validate(response_body(req, [_output("Hel", "length")], "tiny"))
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


def test_reasoning_and_calls_become_output_items():
    req = parse({"input": "Weather in Oslo?", "tools": [TOOL], "tool_choice": "auto"})
    chat = ChatOptions(reasoning_parser="qwen3", enable_auto_tool_choice=True, tool_call_parser="hermes")
    plan, _ = plan_message(chat, SamplingParams(), "<|im_start|>assistant\n", req.as_chat().tools, "auto")
    text = '<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    r = Response.model_validate(response_body(req, [_output(text)], "tiny", plan=plan))
    kinds = [item.type for item in r.output]
    assert kinds == ["reasoning", "function_call"]
    assert r.output[0].summary[0].text == "The user wants weather."
    call = r.output[1]
    assert (
        call.name == "get_weather"
        and json.loads(call.arguments) == {"city": "Oslo"}
        and call.call_id.startswith("call_")
    )


def test_stream_events_parse_and_end_with_the_whole_response():
    req = parse({"input": "Hi", "stream": True})
    chat = ChatOptions(reasoning_parser="qwen3")
    plan, _ = plan_message(chat, SamplingParams(), "<|im_start|>assistant\n")
    stream = ResponseStream(req, "tiny", "resp_1", plan)
    events = stream.start()
    pieces = ["<think>\nhm", "m\n</th", "ink>\n\nHel", "lo", "!"]
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        delta = RequestOutput(
            "r",
            None,
            [1, 2],
            [CompletionOutput(0, piece, [7], None, None, "stop" if last else None)],
            last,
            delta=True,
        )
        events += stream.chunks(delta)
    events += stream.final_chunks()
    adapter = TypeAdapter(ResponseStreamEvent)
    parsed = [adapter.validate_python(e) for e in events]
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    kinds = [e.type for e in parsed]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    text = "".join(e.delta for e in parsed if e.type == "response.output_text.delta")
    assert text == "Hello!"
    final = parsed[-1].response
    assert final.output_text == "Hello!" and final.output[0].type == "reasoning"
    assert final.usage.output_tokens == len(pieces)
