"""Tool-call parsers against outputs in each format as its documentation shows them (Qwen's function
calling guide for Hermes, Meta's Llama 3.1 prompt format, Mistral's function calling docs, Qwen3-Coder's
chat template), whole and streamed: for every cut of the text, the streamed deltas put together (answer
text, and per call its name and argument fragments) equal the whole-text parse."""

from __future__ import annotations

import json

import pytest

from overnight.tool_calls import ForcedParser, ToolCallStream, get_tool_parser, parse_tool_calls

WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]

HERMES = (
    "Let me check both.\n\n"
    "<tool_call>\n"
    '{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA", "unit": "celsius"}}\n'
    "</tool_call>\n"
    "<tool_call>\n"
    '{"name": "get_temperature_date", "arguments": {"location": "San Francisco, CA, USA", "date": "2024-10-01", '
    '"unit": "celsius"}}\n'
    "</tool_call>"
)
LLAMA3 = '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", "unit": "Fahrenheit"}}'
LLAMA3_TAG = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_weather", "parameters": {"city": "Rome"}}'
MISTRAL_ARRAY = (
    '[TOOL_CALLS][{"name": "get_current_weather", "arguments": {"location": "Paris, France", "format": "celsius"}}, '
    '{"name": "get_current_weather", "arguments": {"location": "Lyon, France", "format": "celsius"}}]'
)
MISTRAL_ARGS = '[TOOL_CALLS]get_current_weather[ARGS]{"location": "Paris, France", "format": "celsius"}'
QWEN3_CODER = (
    "I will look it up.\n"
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nBeijing\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)

CASES = [
    # (parser, text, content, [(name, arguments as parsed JSON)])
    (
        "hermes",
        HERMES,
        "Let me check both.",
        [
            ("get_current_temperature", {"location": "San Francisco, CA, USA", "unit": "celsius"}),
            (
                "get_temperature_date",
                {"location": "San Francisco, CA, USA", "date": "2024-10-01", "unit": "celsius"},
            ),
        ],
    ),
    ("hermes", "No tools needed: it is 4.", "No tools needed: it is 4.", []),
    ("hermes", "a <tool_c and more", "a <tool_c and more", []),
    (
        "llama3_json",
        LLAMA3,
        "",
        [("get_current_conditions", {"location": "San Francisco, CA", "unit": "Fahrenheit"})],
    ),
    ("llama3_json", LLAMA3_TAG, "", [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]),
    ("llama3_json", "The weather is fine.", "The weather is fine.", []),
    ("llama3_json", '{"answer": 4}', '{"answer": 4}', []),
    (
        "mistral",
        MISTRAL_ARRAY,
        "",
        [
            ("get_current_weather", {"location": "Paris, France", "format": "celsius"}),
            ("get_current_weather", {"location": "Lyon, France", "format": "celsius"}),
        ],
    ),
    (
        "mistral",
        MISTRAL_ARGS,
        "",
        [("get_current_weather", {"location": "Paris, France", "format": "celsius"})],
    ),
    (
        "mistral",
        "Sure. " + MISTRAL_ARGS + MISTRAL_ARGS.replace("Paris", "Nice"),
        "Sure.",
        [
            ("get_current_weather", {"location": "Paris, France", "format": "celsius"}),
            ("get_current_weather", {"location": "Nice, France", "format": "celsius"}),
        ],
    ),
    ("qwen3_coder", QWEN3_CODER, "I will look it up.", [("get_weather", {"city": "Beijing", "days": 3})]),
]


def _parser(name):
    return get_tool_parser(name, WEATHER_TOOLS)


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_whole_parse(name, text, content, calls):
    got_content, got = parse_tool_calls(_parser(name), text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert all(c.id.startswith("call_") and len(c.id) > 10 for c in got)
    assert len({c.id for c in got}) == len(got)


def _streamed(parser, pieces):
    stream = ToolCallStream(parser)
    content = []
    calls: dict[int, dict] = {}
    for delta in [*(stream.feed(p) for p in pieces), stream.finish()]:
        text, tool_deltas = delta
        content.append(text)
        for d in tool_deltas:
            if d["index"] not in calls:
                assert "id" in d and d["type"] == "function" and d["function"]["name"]
                assert d["index"] == len(calls)  # indexes in order, each started once
                calls[d["index"]] = {"name": d["function"]["name"], "arguments": d["function"]["arguments"]}
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                calls[d["index"]]["arguments"] += d["function"]["arguments"]
    return "".join(content), [(c["name"], c["arguments"]) for c in calls.values()]


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_every_cut_streams_the_whole_parse(name, text, content, calls):
    whole_content, whole = parse_tool_calls(_parser(name), text)
    expected = (whole_content, [(c.name, c.arguments) for c in whole])
    for i in range(len(text) + 1):
        assert _streamed(_parser(name), [text[:i], text[i:]]) == expected, i
    for i in range(0, len(text) + 1, 5):
        for j in range(i, len(text) + 1, 7):
            assert _streamed(_parser(name), [text[:i], text[i:j], text[j:]]) == expected, (i, j)
    assert _streamed(_parser(name), list(text)) == expected


def test_stream_sends_the_name_before_the_arguments_finish():
    stream = ToolCallStream(_parser("hermes"))
    assert stream.feed('<tool_call>\n{"name": "get_wea') == ("", [])
    _, deltas = stream.feed('ther", "arguments": {"ci')
    assert deltas == [
        {
            "index": 0,
            "id": deltas[0]["id"],
            "type": "function",
            "function": {"name": "get_weather", "arguments": ""},
        },
        {"index": 0, "function": {"arguments": '{"ci'}},
    ]
    assert stream.feed('ty": "Oslo"}}\n</tool_call>') == (
        "",
        [{"index": 0, "function": {"arguments": 'ty": "Oslo"}'}}],
    )


@pytest.mark.parametrize(
    "text,calls",
    [
        ('{"name":"get_weather","arguments":{"city":"Oslo"}}', [("get_weather", {"city": "Oslo"})]),
        (
            '[{"name":"get_weather","arguments":{"city":"Oslo"}},{"name":"get_weather","arguments":{"city":"Bergen","days":2}}]',
            [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Bergen", "days": 2})],
        ),
    ],
)
def test_forced_calls_whole_and_streamed(text, calls):
    content, got = parse_tool_calls(ForcedParser(WEATHER_TOOLS), text)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in got] == calls
    for i in range(len(text) + 1):
        assert _streamed(ForcedParser(WEATHER_TOOLS), [text[:i], text[i:]]) == (
            "",
            [(c.name, c.arguments) for c in got],
        )


def test_mistral_keeps_special_tokens_and_unknown_names_are_refused():
    assert get_tool_parser("mistral").needs_special_tokens
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("nope")
