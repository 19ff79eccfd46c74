"""Forced tool calls, and structured outputs after reasoning, on the embedded default model (SmolLM2-135M, CPU): a named tool_choice and
"required" make calls whose arguments parse and validate against the tool's schema, through LLM.chat,
run-batch (chat and /v1/responses lines, next to bad lines that each get an error line naming the
problem) and the server through the official `openai` client (streamed and not, chat and responses)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from overnight import LLM, SamplingParams
from overnight.errors import InvalidRequestError
from overnight.options import ChatOptions
from overnight.server.background import BackgroundServer
from overnight.server.cli import ServerOptions, make_app
from tests.test_run_batch import read_jsonl, run_cli, write_jsonl

pytestmark = pytest.mark.slow  # runs the real model

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather forecast", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def assert_valid_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", max_model_len=1024, max_num_seqs=8)


TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n<think>\n"
)


def test_structured_output_constrains_the_answer_not_the_reasoning(llm):
    """A template that opens the reasoning block in the prompt: the output starts inside it, is read as
    reasoning, and is not held to the JSON grammar, which waits for </think> (the small model never
    writes it). A template that closes the block (thinking off) gets JSON from the first token."""
    from overnight import StructuredOutputsParams

    before = (
        llm.chat_options
    )  # this test's engine reads chat with a reasoning parser (LLM(reasoning_parser=))
    llm.chat_options = ChatOptions(reasoning_parser="qwen3")
    try:
        _reasoning_checks(llm, StructuredOutputsParams)
    finally:
        llm.chat_options = before


def _reasoning_checks(llm, StructuredOutputsParams):
    ask = [{"role": "user", "content": "Name a city."}]
    free = llm.chat(
        ask, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False, chat_template=TEMPLATE
    )[0]
    json_params = SamplingParams(
        temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(json_object=True)
    )
    gated = llm.chat(ask, json_params, use_tqdm=False, chat_template=TEMPLATE)[0]
    assert gated.outputs[0].token_ids == free.outputs[0].token_ids  # the grammar did not touch it
    assert gated.outputs[0].reasoning_content and gated.outputs[0].text == ""
    closed = llm.chat(ask, json_params, use_tqdm=False, chat_template=TEMPLATE + "\n</think>\n\n")[0].outputs[
        0
    ]
    assert closed.reasoning_content is None and closed.text.startswith("{")


def test_llm_chat_forced_calls(llm):
    params = SamplingParams(temperature=0, max_tokens=64)
    named, required = (
        llm.chat([ASK, ASK], [params, params], use_tqdm=False, tools=TOOLS, tool_choice=NAMED)[0],
        llm.chat(ASK, params, use_tqdm=False, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)[
            0
        ],
    )
    (call,) = named.outputs[0].tool_calls
    assert call.name == "get_weather" and call.id.startswith("call_") and named.outputs[0].text == ""
    assert_valid_call(call.name, call.arguments)
    assert named.outputs[0].finish_reason == "stop"
    (call,) = required.outputs[0].tool_calls
    assert_valid_call(call.name, call.arguments)
    # A later turn: the call and its result go back through the template.
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    out = llm.chat(
        history, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False, tools=TOOLS, tool_choice="none"
    )
    assert out[0].outputs[0].tool_calls is None and out[0].outputs[0].token_ids
    with pytest.raises(InvalidRequestError, match="--enable-auto-tool-choice"):
        llm.chat(ASK, params, use_tqdm=False, tools=TOOLS)  # "auto" by default
    with pytest.raises(InvalidRequestError, match="tool_call_id"):
        llm.chat(ASK + [{"role": "tool", "content": "x"}], params, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="'nope'"):
        llm.chat(
            ASK,
            params,
            use_tqdm=False,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )


def _line(cid: str, body: dict, url: str = "/v1/chat/completions") -> dict:
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


def test_run_batch_tool_lines_responses_lines_and_bad_lines(tmp_path):
    chat = {"messages": ASK, "tools": TOOLS, "temperature": 0, "max_completion_tokens": 64}
    lines = [
        _line("named", {**chat, "tool_choice": NAMED}),
        _line("required", {**chat, "tool_choice": "required", "parallel_tool_calls": False}),
        _line(
            "resp-call",
            {
                "input": ASK[0]["content"],
                "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER}],
                "tool_choice": {"type": "function", "name": "get_weather"},
                "max_output_tokens": 64,
                "temperature": 0,
            },
            "/v1/responses",
        ),
        _line(
            "resp-text",
            {"input": "Say hi.", "instructions": "Be brief.", "max_output_tokens": 8},
            "/v1/responses",
        ),
        _line("unknown-tool", {**chat, "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
        _line(
            "bad-schema",
            {
                **chat,
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
            },
        ),
        _line("auto", chat),
        _line("no-call-id", {"messages": ASK + [{"role": "tool", "content": "21 C"}]}),
        _line("store", {"input": "x", "store": True}, "/v1/responses"),
    ]
    src, out, err, summary = (tmp_path / n for n in ("in.jsonl", "out.jsonl", "err.jsonl", "summary.json"))
    write_jsonl(src, lines)
    code = run_cli(
        [
            "-i",
            str(src),
            "-o",
            str(out),
            "--error-file",
            str(err),
            "--summary-json",
            str(summary),
            "--dtype",
            "float32",
            "--max-model-len",
            "1024",
            "--no-progress",
        ]
    )
    assert code == 0
    ok = {r["custom_id"]: r["response"]["body"] for r in read_jsonl(out)}
    assert set(ok) == {"named", "required", "resp-call", "resp-text"}
    for cid in ("named", "required"):
        choice = ok[cid]["choices"][0]
        assert choice["finish_reason"] == ("stop" if cid == "named" else "tool_calls")
        assert choice["message"]["content"] is None
        for call in choice["message"]["tool_calls"]:
            assert call["type"] == "function" and call["id"].startswith("call_")
            assert_valid_call(call["function"]["name"], call["function"]["arguments"])
    (item,) = ok["resp-call"]["output"]
    assert item["type"] == "function_call" and item["name"] == "get_weather"
    assert_valid_call(item["name"], item["arguments"])
    text = openai.types.responses.Response.model_validate(ok["resp-text"])
    assert text.output_text and text.usage.output_tokens <= 8
    errors = {r["custom_id"]: r["error"]["message"] for r in read_jsonl(err)}
    assert "'nope', which is not in tools" in errors["unknown-tool"]
    assert "tools[0].function.parameters" in errors["bad-schema"]
    assert "--enable-auto-tool-choice" in errors["auto"]
    assert "tool_call_id" in errors["no-call-id"]
    assert "store" in errors["store"]
    counts = json.loads(summary.read_text())["request_counts"]
    assert counts == {"total": 9, "completed": 4, "failed": 5}


@pytest.fixture(scope="module")
def client(llm):
    # The module's engine, now behind the server (the offline tests above ran first).
    chat = ChatOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")
    with BackgroundServer(make_app(llm.engine, ServerOptions(), chat=chat)) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_server_forced_calls_whole_and_streamed(client):
    model = client.models.list().data[0].id
    r = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=0, max_completion_tokens=64
    )
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and r.choices[0].finish_reason == "stop"
    assert_valid_call(call.function.name, call.function.arguments)
    stream = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_completion_tokens=64,
        stream=True,
    )
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for d in choice.delta.tool_calls or []:
            if d.index not in calls:
                assert d.id.startswith("call_") and d.type == "function" and d.function.name
                calls[d.index] = {"name": d.function.name, "arguments": d.function.arguments or ""}
            else:
                assert d.id is None and not d.function.name
                calls[d.index]["arguments"] += d.function.arguments
    assert finish == "tool_calls" and len(calls) == 1
    assert_valid_call(calls[0]["name"], calls[0]["arguments"])
    # "auto" with --tool-call-parser: the small model answers in text; the parser finds no call.
    auto = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_completion_tokens=8)
    assert auto.choices[0].finish_reason in ("stop", "length")


def test_server_responses(client):
    model = client.models.list().data[0].id
    r = client.responses.create(model=model, input="Say hi.", instructions="Be brief.", max_output_tokens=8)
    assert r.output_text and r.status in ("completed", "incomplete") and r.usage.output_tokens <= 8
    r = client.responses.create(
        model=model,
        input=ASK[0]["content"],
        tools=[{"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=64,
        temperature=0,
    )
    (item,) = r.output
    assert item.type == "function_call"
    assert_valid_call(item.name, item.arguments)
    events = list(client.responses.create(model=model, input="Say hi.", max_output_tokens=8, stream=True))
    assert events[0].type == "response.created" and events[-1].type in (
        "response.completed",
        "response.incomplete",
    )
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas and deltas == events[-1].response.output_text


@pytest.mark.parametrize(
    "extra,words",
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "tools[0].function.parameters",
        ),
        ({"messages": ASK + [{"role": "tool", "content": "x"}]}, "tool_call_id"),
    ],
)
def test_server_bad_tool_requests_are_400s(client, extra, words):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**{"model": "x", "messages": ASK, "max_completion_tokens": 4, **extra})
    assert words in info.value.message
