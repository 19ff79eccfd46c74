"""How chat bodies reach the chat template: chat_template_kwargs (enable_thinking), tools,
add_generation_prompt and continue_final_message, earlier tool calls and tool results; and the
400s for the combinations that make no sense. A synthetic tokenizer with a small template of its own."""

from __future__ import annotations

import pytest

from overnight.openai_api.errors import ApiError
from overnight.openai_api.protocol import parse_request
from overnight.tokenizer.synthetic import save_synthetic_tokenizer_folder
from overnight.tokenizer.tokenizer import Tokenizer

TEMPLATE = (
    "{% if tools %}[tools: {% for t in tools %}{{ t.function.name }} {% endfor %}]{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}(call {{ c.id }} {{ c.function.name }} {{ c.function.arguments | tojson }})"
    "{% endfor %}{% if m.tool_call_id %}(for {{ m.tool_call_id }}){% endif %}</{{ m.role }}>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
CHAT = "/v1/chat/completions"
USER = {"role": "user", "content": "Weather in Oslo?"}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    from transformers import AutoTokenizer

    folder = save_synthetic_tokenizer_folder(tmp_path_factory.mktemp("tok"), 400, {399: "<|endoftext|>"})
    hf = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    hf.chat_template = TEMPLATE
    return Tokenizer(hf, (399,))


def prompt(tokenizer, **body) -> str:
    req = parse_request(CHAT, {"messages": [USER], **body})
    return req.engine_prompts(tokenizer)[0][0]


def test_template_variables_and_tools_reach_the_template(tokenizer):
    assert prompt(tokenizer).endswith("<user>Weather in Oslo?</user><assistant>")
    assert prompt(tokenizer, chat_template_kwargs={"enable_thinking": False}).endswith(
        "<think>\n\n</think>\n\n"
    )
    assert prompt(tokenizer, tools=TOOLS, tool_choice="none").startswith("[tools: get_weather ]")
    assert prompt(tokenizer, add_generation_prompt=False).endswith("</user>")


def test_earlier_calls_and_results_reach_the_template(tokenizer):
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    }
    messages = [
        USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"},
    ]
    text = parse_request(CHAT, {"messages": messages}).engine_prompts(tokenizer)[0][0]
    assert (
        '<assistant>(call call_1 get_weather {"city": "Oslo"})</assistant>' in text
    )  # arguments as a mapping
    assert "<tool>-3 C(for call_1)</tool>" in text


def test_continue_final_message_continues_the_assistants_text(tokenizer):
    messages = [USER, {"role": "assistant", "content": "It is"}]
    text = parse_request(CHAT, {"messages": messages, "continue_final_message": True}).engine_prompts(
        tokenizer
    )[0][0]
    assert text.endswith("<assistant>It is")


@pytest.mark.parametrize(
    "body,param,words",
    [
        (
            {"messages": [USER], "continue_final_message": True},
            None,
            "the last message to be the assistant's",
        ),
        (
            {
                "messages": [USER, {"role": "assistant", "content": "x"}],
                "continue_final_message": True,
                "add_generation_prompt": True,
            },
            None,
            "cannot both be true",
        ),
        ({"messages": [USER, {"role": "tool", "content": "x"}]}, "messages", "tool_call_id"),
        (
            {
                "messages": [USER],
                "tools": TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "x"}},
            },
            "tool_choice",
            "'x'",
        ),
        (
            {
                "messages": [USER],
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
            },
            "tools",
            "tools[0].function.parameters",
        ),
        ({"messages": [USER], "tools": [{"type": "retrieval"}]}, "tools", "only function tools"),
    ],
)
def test_bad_combinations_are_400s(body, param, words):
    with pytest.raises(ApiError) as info:
        parse_request(CHAT, body)
    assert words in info.value.message and info.value.param == param
