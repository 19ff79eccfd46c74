"""The tool-call formats models write, each read by one parser:

    hermes         <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>     (Hermes, Qwen2.5, Qwen3)
    llama3_json    {"name": "f", "parameters": {...}}, after <|python_tag|> or bare; several joined by ';'
    mistral        [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]  or  [TOOL_CALLS]f[ARGS]{...}
    qwen3_coder    <tool_call>\\n<function=f>\\n<parameter=p>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>
    forced         {"name": "f", "arguments": {...}} or a list of them: what the grammar of a named or
                   "required" tool_choice lets a model write

parse(text, final) reads a prefix of an output: the answer text before the calls and the calls as far as
they go. The result only grows as the text does (a prefix's content and each call's name and arguments
are prefixes of the longer text's), which is what lets ToolCallStream send differences: final=False holds
back what the rest of the text could still change (trailing whitespace, a marker's first characters).
A call's `arguments` is the model's own text of the arguments object (qwen3_coder: the JSON of the
parameters, converted by the tool's schema types).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from overnight.reasoning.parsers import partial_suffix
from overnight.tool_calls.json_scan import Malformed, object_members, skip_ws, string_value, value_end


@dataclass
class PartialCall:
    name: str | None = None  # None until the name is complete
    arguments: str = ""


@dataclass
class Parsed:
    content: str
    calls: list[PartialCall] = field(default_factory=list)


def _held_content(text: str, marker: str, final: bool) -> str:
    """Answer text with no marker seen: all of it at the end; before, without what a marker (or the
    whitespace that precedes calls, stripped then) could still claim."""
    if final:
        return text
    return text[: len(text) - partial_suffix(text, marker)].rstrip()


def _call_of(t: str, start: int, args_keys: tuple[str, ...], final: bool) -> tuple[PartialCall, int | None]:
    """The call in the JSON object at t[start] and the index after it (None: still open)."""
    members, end = object_members(t, start)
    call = PartialCall()
    for m in members:
        if m.key == "name":
            call.name = string_value(t, m)
        elif m.key in args_keys:
            call.arguments = t[m.start : m.end] if m.end is not None else t[m.start :]
    if call.arguments == "" and (end is not None or final) and call.name is not None:
        call.arguments = "{}"  # a call without arguments
    return call, end


class ToolParser:
    name = ""
    # Its markers are special tokens the detokenizer would drop: requests keep special tokens in the text.
    needs_special_tokens = False

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = {
            t["function"]["name"]: t["function"].get("parameters") or {}
            for t in (tools or [])
            if "function" in t
        }

    def parse(self, text: str, final: bool = True) -> Parsed:
        raise NotImplementedError


class HermesParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool = True) -> Parsed:
        first = text.find(self.START)
        if first < 0:
            return Parsed(_held_content(text, self.START, final))
        out = Parsed(text[:first].rstrip())
        i = first
        while i >= 0:
            body = i + len(self.START)
            end = self._block(text, body, out, final)
            if end is None:
                break
            i = text.find(self.START, end)
        return out

    def _block(self, t: str, i: int, out: Parsed, final: bool) -> int | None:
        """Reads one call's body from t[i]; the index after its block, None while it is open."""
        j = skip_ws(t, i)
        if j >= len(t):
            return None
        try:
            if t[j] != "{":
                raise Malformed("a call is a JSON object")
            call, end = _call_of(t, j, ("arguments", "parameters"), final)
        except Malformed:
            return None  # not a call we can read: it and what follows are dropped
        out.calls.append(call)
        if end is None:
            return None
        close = t.find(self.END, end)
        return None if close < 0 else close + len(self.END)


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str, final: bool = True) -> Parsed:
        lead = text.lstrip()
        if lead.startswith(self.TAG):
            lead = lead[len(self.TAG) :].lstrip()
        elif not lead.startswith("{"):
            if not final and (lead == "" or self.TAG.startswith(lead)):
                return Parsed("")
            return Parsed(text)
        calls: list[PartialCall] = []
        i = 0
        try:
            while i < len(lead) and lead[i] == "{":
                call, end = _call_of(lead, i, ("parameters", "arguments"), final)
                calls.append(call)
                if end is None:
                    break
                i = skip_ws(lead, end)
                if i < len(lead) and lead[i] == ";":
                    i = skip_ws(lead, i + 1)
        except Malformed:
            pass
        if not any(c.name for c in calls):
            # JSON that names no function is an answer, not a call: known only at the end.
            return Parsed(text if final else "")
        return Parsed("", calls)


class MistralParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True
    MARK, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def parse(self, text: str, final: bool = True) -> Parsed:
        first = text.find(self.MARK)
        if first < 0:
            return Parsed(_held_content(text, self.MARK, final))
        out = Parsed(text[:first].rstrip())
        i = first
        try:
            while i >= 0:
                j = skip_ws(text, i + len(self.MARK))
                if j >= len(text):
                    break
                end = self._array(text, j, out, final) if text[j] == "[" else self._named(text, j, out, final)
                if end is None:
                    break
                i = text.find(self.MARK, end)
        except Malformed:
            pass
        return out

    def _array(self, t: str, i: int, out: Parsed, final: bool) -> int | None:
        j = skip_ws(t, i + 1)
        while j < len(t):
            if t[j] == "]":
                return j + 1
            if t[j] != "{":
                raise Malformed("a call is a JSON object")
            call, end = _call_of(t, j, ("arguments", "parameters"), final)
            out.calls.append(call)
            if end is None:
                return None
            j = skip_ws(t, end)
            if j < len(t) and t[j] == ",":
                j = skip_ws(t, j + 1)
        return None

    def _named(self, t: str, i: int, out: Parsed, final: bool) -> int | None:
        """name[ARGS]{...} (and name{...}, as some templates write it)."""
        a, b = t.find(self.ARGS, i), t.find("{", i)
        if a >= 0 and (b < 0 or a < b):
            name, j = t[i:a].strip(), a + len(self.ARGS)
        elif b >= 0:
            name, j = t[i:b].strip(), b
        else:
            if final and t[i:].strip():
                out.calls.append(PartialCall(t[i:].strip(), "{}"))
            return None
        call = PartialCall(name)
        out.calls.append(call)
        j = skip_ws(t, j)
        if j >= len(t):
            if final:
                call.arguments = "{}"
            return None
        end = value_end(t, j)
        call.arguments = t[j:end] if end is not None else t[j:]
        return end


class Qwen3CoderParser(ToolParser):
    name = "qwen3_coder"
    START, END = "<tool_call>", "</tool_call>"
    FUNC, FUNC_END = "<function=", "</function>"
    PARAM, PARAM_END = "<parameter=", "</parameter>"

    def parse(self, text: str, final: bool = True) -> Parsed:
        first = text.find(self.START)
        if first < 0:
            return Parsed(_held_content(text, self.START, final))
        out = Parsed(text[:first].rstrip())
        i = first
        while i >= 0:
            end = self._block(text, i + len(self.START), out, final)
            if end is None:
                break
            i = text.find(self.START, end)
        return out

    def _block(self, t: str, i: int, out: Parsed, final: bool) -> int | None:
        f = t.find(self.FUNC, i)
        if f < 0:
            return None
        gt = t.find(">", f)
        if gt < 0:
            return None
        call = PartialCall(t[f + len(self.FUNC) : gt].strip())
        out.calls.append(call)
        types = (self.tools.get(call.name) or {}).get("properties") or {}
        parts: list[str] = []
        j = gt + 1
        closed = None
        while True:
            p, fe = t.find(self.PARAM, j), t.find(self.FUNC_END, j)
            if fe >= 0 and (p < 0 or fe < p):
                closed = fe + len(self.FUNC_END)
                break
            if p < 0:
                break
            pgt = t.find(">", p)
            if pgt < 0:
                break
            pe = t.find(self.PARAM_END, pgt)
            if pe < 0:
                break
            key = t[p + len(self.PARAM) : pgt].strip()
            raw = t[pgt + 1 : pe]
            raw = raw[1:] if raw.startswith("\n") else raw
            raw = raw[:-1] if raw.endswith("\n") else raw
            value = _typed(raw, types.get(key) or {})
            parts.append(f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}")
            j = pe + len(self.PARAM_END)
        call.arguments = "{" + ", ".join(parts) + ("}" if closed is not None or final else "")
        if closed is None:
            return None
        close = t.find(self.END, closed)
        return None if close < 0 else close + len(self.END)


def _typed(raw: str, schema: dict[str, Any]) -> Any:
    """A parameter's text as the value its schema's type says (text when it does not parse)."""
    kind = schema.get("type")
    if kind == "string":
        return raw
    try:
        value = json.loads(raw)
    except ValueError:
        if kind == "boolean" and raw.strip().lower() in ("true", "false"):
            return raw.strip().lower() == "true"
        return raw
    if kind in ("integer", "number") and isinstance(value, bool):
        return raw
    return value


class ForcedParser(ToolParser):
    """What a named or "required" tool_choice's grammar lets the model write: no answer text."""

    name = "forced"

    def parse(self, text: str, final: bool = True) -> Parsed:
        out = Parsed("")
        j = skip_ws(text, 0)
        if j >= len(text):
            return out
        try:
            if text[j] == "{":
                call, _ = _call_of(text, j, ("arguments",), final)
                out.calls.append(call)
            elif text[j] == "[":
                j = skip_ws(text, j + 1)
                while j < len(text) and text[j] == "{":
                    call, end = _call_of(text, j, ("arguments",), final)
                    out.calls.append(call)
                    if end is None:
                        break
                    j = skip_ws(text, end)
                    if j < len(text) and text[j] == ",":
                        j = skip_ws(text, j + 1)
        except Malformed:
            pass
        return out


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser, Qwen3CoderParser)
}
TOOL_PARSERS["qwen"] = HermesParser  # Qwen2.5 / Qwen3 write Hermes' format
