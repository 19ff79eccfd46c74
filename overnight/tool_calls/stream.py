"""Tool calls as OpenAI's objects, whole and streamed.

Whole: `message.tool_calls = [{"id": "call_...", "type": "function", "function": {"name", "arguments"}}]`.
Streamed as OpenAI streams them: a call's first delta carries its index, id, type, name and empty
arguments; later deltas carry argument fragments under the same index. ToolCallStream re-reads the text so
far at each delta and sends what grew (formats.py: a parse only grows), so the fragments of a call
concatenated equal its whole `arguments`.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from overnight.tool_calls.formats import Parsed, ToolParser


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON string, as OpenAI's API carries it
    id: str = field(default_factory=new_call_id)

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def parse_tool_calls(parser: ToolParser, text: str) -> tuple[str, list[ToolCall]]:
    """(answer text, calls) of a whole output. Calls without a name (cut off) are left out."""
    parsed = parser.parse(text, final=True)
    return parsed.content, [ToolCall(c.name, c.arguments) for c in parsed.calls if c.name]


@dataclass
class ToolCallStream:
    parser: ToolParser
    text: str = ""
    _content_sent: int = 0
    _ids: list[str] = field(default_factory=list)  # per call started
    _args_sent: list[int] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)  # as sent so far, for the final message

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        """(answer text delta, tool_calls deltas) for a delta of the text."""
        self.text += delta
        return self._diff(self.parser.parse(self.text, final=False))

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        return self._diff(self.parser.parse(self.text, final=True))

    def _diff(self, parsed: Parsed) -> tuple[str, list[dict[str, Any]]]:
        content = parsed.content[self._content_sent :]
        self._content_sent = max(self._content_sent, len(parsed.content))
        deltas: list[dict[str, Any]] = []
        for i, call in enumerate(parsed.calls):
            if call.name is None:
                break  # later calls wait for this one's name: indexes go out in order
            if i == len(self._ids):
                call_id = new_call_id()
                self._ids.append(call_id)
                self._args_sent.append(len(call.arguments))
                self.calls.append(ToolCall(call.name, call.arguments, call_id))
                deltas.append(
                    {
                        "index": i,
                        "id": call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": ""},
                    }
                )
                if call.arguments:
                    deltas.append({"index": i, "function": {"arguments": call.arguments}})
                continue
            grown = call.arguments[self._args_sent[i] :]
            if grown:
                self._args_sent[i] = len(call.arguments)
                self.calls[i].arguments = call.arguments
                deltas.append({"index": i, "function": {"arguments": grown}})
        return content, deltas
