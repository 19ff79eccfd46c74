"""gpt-oss's harmony format (overnight/reasoning/harmony.py): prompts rendered from OpenAI messages equal
openai-harmony's own rendering of the same conversation, and generated tokens split into reasoning,
answer and tool calls, whole and token by token. The encoding's vocabulary comes from the package that
ships it (no download)."""

from __future__ import annotations

import pytest

pytest.importorskip("openai_harmony")

from openai_harmony import (  # noqa: E402
    Author,
    Conversation,
    DeveloperContent,
    Message,
    ReasoningEffort,
    Role,
    SystemContent,
    ToolDescription,
)

from overnight.reasoning.harmony import ReplyStream, encoding, parse_reply, render_prompt  # noqa: E402

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def _theirs(messages: list, effort: ReasoningEffort) -> list[int]:
    system = Message.from_role_and_content(Role.SYSTEM, SystemContent.new().with_reasoning_effort(effort))
    convo = Conversation.from_messages([system, *messages])
    return list(encoding().render_conversation_for_completion(convo, Role.ASSISTANT))


@pytest.mark.parametrize("effort", ["low", "medium", "high"])
def test_system_developer_user_assistant_turns(effort):
    ours = render_prompt(
        [
            {"role": "system", "content": "Answer in French."},
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Bonjour."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "And "}, {"type": "text", "text": "again?"}],
            },
        ],
        reasoning_effort=effort,
    )
    developer = DeveloperContent.new().with_instructions("Answer in French.\n\nBe brief.")
    theirs = _theirs(
        [
            Message.from_role_and_content(Role.DEVELOPER, developer),
            Message.from_role_and_content(Role.USER, "Hi"),
            Message.from_role_and_content(Role.ASSISTANT, "Bonjour.").with_channel("final"),
            Message.from_role_and_content(Role.USER, "And again?"),
        ],
        ReasoningEffort(effort.capitalize()),
    )
    assert ours == theirs
    assert f"Reasoning: {effort}" in encoding().decode_utf8(ours)


def test_tools_calls_and_results():
    ours = render_prompt(
        [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        tools=[WEATHER],
    )
    fn = WEATHER["function"]
    developer = DeveloperContent.new().with_function_tools(
        [ToolDescription.new(fn["name"], fn["description"], fn["parameters"])]
    )
    call = (
        Message.from_role_and_content(Role.ASSISTANT, '{"city": "Paris"}')
        .with_channel("commentary")
        .with_recipient("functions.get_weather")
        .with_content_type("<|constrain|>json")
    )
    result = (
        Message.from_author_and_content(Author.new(Role.TOOL, "functions.get_weather"), "sunny")
        .with_channel("commentary")
        .with_recipient("assistant")
    )
    theirs = _theirs(
        [
            Message.from_role_and_content(Role.DEVELOPER, developer),
            Message.from_role_and_content(Role.USER, "Weather in Paris?"),
            call,
            result,
        ],
        ReasoningEffort.MEDIUM,
    )
    assert ours == theirs


def test_bad_messages_refused():
    with pytest.raises(ValueError, match="reasoning_effort"):
        render_prompt([{"role": "user", "content": "x"}], reasoning_effort="extreme")
    with pytest.raises(ValueError, match="tool_call_id"):
        render_prompt([{"role": "tool", "tool_call_id": "nope", "content": "x"}])
    with pytest.raises(ValueError, match="role"):
        render_prompt([{"role": "robot", "content": "x"}])


REPLY = (
    "<|channel|>analysis<|message|>The user greets; answer briefly.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello there!<|return|>"
)
CALL = (
    "<|channel|>analysis<|message|>Need the weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris"}<|call|>'
)


def _tokens(text: str) -> list[int]:
    return list(encoding().encode(text, allowed_special="all"))


def test_reply_split_whole_and_streamed():
    tokens = _tokens(REPLY)
    reply = parse_reply(tokens)
    assert (reply.reasoning_content, reply.content, reply.tool_calls) == (
        "The user greets; answer briefly.",
        "Hello there!",
        [],
    )
    stream = ReplyStream()
    deltas = [stream.feed(t) for t in tokens]
    assert "".join(r for r, _ in deltas) == reply.reasoning_content
    assert "".join(c for _, c in deltas) == reply.content
    # cut short inside the answer: what came so far
    cut = parse_reply(tokens[: tokens.index(_tokens("<|return|>")[0]) - 1])
    assert cut.reasoning_content == reply.reasoning_content and reply.content.startswith(cut.content)
    assert cut.content


def test_reply_with_a_tool_call():
    reply = parse_reply(_tokens(CALL))
    assert reply.reasoning_content == "Need the weather."
    assert reply.content == ""
    assert [(c.name, c.arguments) for c in reply.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    assert reply.tool_calls[0].id.startswith("call_")


# -- the chat entry points' side: a harmony prompt is recognised, its reply read from detokenized text ---


def _decoded(text_with_specials: str) -> str:
    """What the detokenizer hands the chat layer with special tokens kept: the tokens decoded back."""
    return encoding().decode_utf8(_tokens(text_with_specials))


def test_chat_plan_recognises_harmony_and_reads_the_reply():
    from overnight.reasoning.harmony import is_harmony_prompt
    from overnight.sampling_params import SamplingParams, StructuredOutputsParams
    from overnight.tool_calls.message import plan_message

    prompt = encoding().decode_utf8(render_prompt([{"role": "user", "content": "Hi"}], "high"))
    assert is_harmony_prompt(prompt) and not is_harmony_prompt("<|im_start|>assistant\n")
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object"}))
    plan, params = plan_message(None, params, prompt)
    assert plan.harmony and not params.skip_special_tokens
    assert (
        params.structured_outputs.start_after == "<|channel|>final<|message|>"
    )  # the answer, not the reasoning
    message = plan.parse(_decoded(REPLY))
    assert (message.reasoning_content, message.content, message.tool_calls) == (
        "The user greets; answer briefly.",
        "Hello there!",
        [],
    )


def test_chat_stream_adds_up_at_every_cut():
    from overnight.sampling_params import SamplingParams
    from overnight.tool_calls.message import plan_message

    prompt = encoding().decode_utf8(render_prompt([{"role": "user", "content": "Weather?"}], tools=[WEATHER]))
    plan, _ = plan_message(None, SamplingParams(), prompt, tools=[WEATHER], tool_choice="auto")
    text = _decoded(CALL)
    whole = plan.parse(text)
    assert [(c.name, c.arguments) for c in whole.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    for cut in range(1, len(text)):
        stream = plan.stream()
        deltas = [stream.feed(text[:cut]), stream.feed(text[cut:]), stream.finish()]
        assert "".join(d.reasoning_content for d in deltas) == whole.reasoning_content
        assert "".join(d.content for d in deltas) == (whole.content or "")
        named = [c["function"]["name"] for d in deltas for c in d.tool_calls if "id" in c]
        args = "".join(c["function"]["arguments"] for d in deltas for c in d.tool_calls)
        assert named == ["get_weather"] and args == '{"city": "Paris"}'


def test_forced_tool_choice_constrains_the_whole_harmony_reply():
    from overnight.sampling_params import SamplingParams
    from overnight.tool_calls.message import plan_message

    prompt = encoding().decode_utf8(render_prompt([{"role": "user", "content": "x"}], tools=[WEATHER]))
    plan, params = plan_message(None, SamplingParams(), prompt, tools=[WEATHER], tool_choice="required")
    so = params.structured_outputs
    assert plan.harmony and plan.read_calls and so.structural_tag is not None and so.start_after is None
    # (the grammar itself: test_harmony_tool_choice.py)


def test_render_conversation_uses_harmony_for_a_harmony_tokenizer():
    from overnight.entrypoints.prompts import render_conversation

    class HarmonyTokenizer:  # what render_conversation reads of a gpt-oss tokenizer
        is_harmony = True

        def decode(self, ids, skip_special_tokens=True):
            return encoding().decode_utf8(ids)

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text, ids = render_conversation(messages, HarmonyTokenizer(), reasoning_effort="low")
    assert ids == render_prompt(messages, "low") and text.endswith("<|start|>assistant")
