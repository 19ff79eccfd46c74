"""Tool calls: the parsers of the formats models write them in (formats.py), OpenAI's call objects whole
and streamed (stream.py), and the grammar that forces a call for a named or "required" tool_choice
(forced.py).

    parser = get_tool_parser("hermes", tools)      # the names --tool-call-parser takes
    content, calls = parse_tool_calls(parser, text)
    stream = ToolCallStream(parser)                 # feed(delta) -> (content delta, tool_calls deltas)
"""

from typing import Any

from overnight.tool_calls.formats import TOOL_PARSERS, ForcedParser, ToolParser
from overnight.tool_calls.stream import ToolCall, ToolCallStream, new_call_id, parse_tool_calls


def get_tool_parser(name: str, tools: list[dict[str, Any]] | None = None) -> ToolParser:
    """The parser of that name for these tools; ValueError naming the known ones otherwise."""
    cls = TOOL_PARSERS.get(name)
    if cls is None:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}")
    return cls(tools)


__all__ = [
    "TOOL_PARSERS",
    "ForcedParser",
    "ToolCall",
    "ToolCallStream",
    "ToolParser",
    "get_tool_parser",
    "new_call_id",
    "parse_tool_calls",
]
