"""Function tools as OpenAI's API takes them, checked; and the JSON schema that forces a call.

A named tool_choice ({"type": "function", "function": {"name": "f"}}) constrains the output to
`{"name": "f", "arguments": <f's parameters>}`; "required" to a non-empty list of such objects, any tool
each. The grammar (structured outputs, xgrammar) then makes the arguments parse and validate against
the tool's schema whatever the model, and ForcedParser reads the calls back.
"""

from __future__ import annotations

import re
from typing import Any

from overnight.structured.schema_check import unsupported_keyword

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
TOOL_CHOICES = ("none", "auto", "required")


class ToolError(ValueError):
    """A malformed tool or tool_choice; `param` names where (tools[1].function.parameters)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """The tools, each {"type": "function", "function": {"name", "description"?, "parameters"?}}."""
    if not isinstance(tools, list):
        raise ToolError("tools", "must be a list of tools")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise ToolError(where, "must be an object")
        if tool.get("type") != "function":
            raise ToolError(f"{where}.type", f"only function tools are supported, got {tool.get('type')!r}")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ToolError(f"{where}.function", "must be an object with a name")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ToolError(
                f"{where}.function.name", f"must be 1-64 letters, digits, '_', '-' or '.', got {name!r}"
            )
        if name in names:
            raise ToolError(f"{where}.function.name", f"{name!r} is defined twice")
        names.add(name)
        check_parameters(fn.get("parameters"), f"{where}.function.parameters")
    return tools


def check_parameters(schema: Any, where: str) -> None:
    """A function's parameters are a JSON schema of an object (absent: no parameters)."""
    if schema is None:
        return
    if not isinstance(schema, dict):
        raise ToolError(where, f"must be a JSON schema object, got {type(schema).__name__}")
    kind = schema.get("type", "object")
    if kind != "object":
        raise ToolError(where, f'must describe an object ("type": "object"), got type {kind!r}')
    props = schema.get("properties", {})
    if not isinstance(props, dict) or not all(isinstance(p, dict | bool) for p in props.values()):
        raise ToolError(f"{where}.properties", "must map each parameter name to a JSON schema")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ToolError(f"{where}.required", "must be a list of parameter names")
    for name, sub in props.items():
        if isinstance(sub, dict) and not isinstance(sub.get("type", ""), str | list):
            raise ToolError(f"{where}.properties.{name}.type", "must be a type name or a list of them")


def named_choice(tool_choice: Any, tools: list[dict[str, Any]]) -> str | None:
    """The function a tool_choice names (None for "none" / "auto" / "required"); ToolError for an unknown
    name or shape."""
    if isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICES:
            raise ToolError(
                "tool_choice",
                f"must be one of {', '.join(TOOL_CHOICES)} or a named function, got {tool_choice!r}",
            )
        return None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function":
        raise ToolError("tool_choice", 'a named choice is {"type": "function", "function": {"name": ...}}')
    fn = tool_choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else tool_choice.get("name")  # Responses' flat shape
    if not isinstance(name, str):
        raise ToolError("tool_choice", "the named function needs a name")
    known = [t["function"]["name"] for t in tools]
    if name not in known:
        raise ToolError(
            "tool_choice",
            f"names the function {name!r}, which is not in tools ({', '.join(known) or 'none'})",
        )
    return name


def check_enforceable(tools: list[dict[str, Any]], name: str | None) -> None:
    """The parameters of the tools a forced call may use hold no keyword the grammar cannot enforce
    (the arguments would then not be sure to validate): ToolError naming the tool and the keyword."""
    for i, tool in enumerate(tools):
        fn = tool["function"]
        if name is not None and fn["name"] != name:
            continue
        found = unsupported_keyword(fn.get("parameters") or {})
        if found:
            raise ToolError(
                f"tools[{i}].function.parameters",
                f"uses {found}, a keyword a forced call's grammar cannot enforce",
            )


def _call_schema(tool: dict[str, Any]) -> dict[str, Any]:
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def forced_schema(tools: list[dict[str, Any]], name: str | None, parallel: bool = True) -> dict[str, Any]:
    """The JSON schema of the output: one call of `name`, or ("required": name None) a list of calls
    (of one call when parallel_tool_calls is false)."""
    if name is not None:
        return _call_schema(next(t for t in tools if t["function"]["name"] == name))
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"anyOf": [_call_schema(t) for t in tools]},
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


# -- gpt-oss (harmony): the forced call as a structural tag ---------------------------------------------
#
# A harmony tool call is a commentary message addressed to functions.NAME, its arguments JSON, ended by
# <|call|> (a stop token: the grammar ends before it). The model writes the recipient after the channel;
# openai-harmony's renderer puts it in the role header; both read back the same (reasoning/harmony.py):
#
#     <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{args}<|call|>
#      to=functions.NAME<|channel|>commentary <|constrain|>json<|message|>{args}<|call|>
#
# The prompt ends in "<|start|>assistant", so a reply may first reason freely in analysis messages (each
# "<|channel|>analysis<|message|>...<|end|><|start|>assistant"), as harmony allows and as vLLM's and
# xgrammar's harmony tags do; it must then call. Markers are matched as their special tokens; the
# analysis text may hold any token but a marker. Inside the JSON arguments the grammar works on text and
# cannot exclude a token, so a string value may hold a marker token (its text is valid JSON); a model
# trained on harmony does not write one there, and the reply would not read back if it did.
HARMONY_MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>")


def _token(marker: str) -> dict[str, Any]:
    return {"type": "token", "token": marker}


def _text(value: str) -> dict[str, Any]:
    return {"type": "const_string", "value": value}


def _sequence(*elements: dict[str, Any]) -> dict[str, Any]:
    return {"type": "sequence", "elements": list(elements)}


def _harmony_call(tool: dict[str, Any]) -> list[dict[str, Any]]:
    fn = tool["function"]
    to = f"to=functions.{fn['name']}"
    # Runs of whitespace capped at one character: `{"city": "Paris"}` as harmony renders it, while a small
    # model cannot loop on newlines until max_tokens (why JSON outputs default to compact, sampling_params).
    args = {
        "type": "json_schema",
        "json_schema": fn.get("parameters") or {"type": "object"},
        "max_whitespace_cnt": 1,
    }
    space = {"type": "optional", "content": _text(" ")}
    body = [space, _token("<|constrain|>"), _text("json"), _token("<|message|>"), args]
    return [
        _sequence(_token("<|channel|>"), _text(f"commentary {to}"), *body),
        _sequence(_text(f" {to}"), _token("<|channel|>"), _text("commentary"), *body),
    ]


def harmony_call_tag(tools: list[dict[str, Any]], name: str | None) -> dict[str, Any]:
    """The structural tag of a harmony reply that ends in one call of `name` (None: of any tool)."""
    analysis = _sequence(
        _token("<|channel|>"),
        _text("analysis"),
        _token("<|message|>"),
        {"type": "any_tokens", "exclude_tokens": list(HARMONY_MARKERS)},
        _token("<|end|>"),
        _token("<|start|>"),
        _text("assistant"),
    )
    calls = [c for t in tools if name is None or t["function"]["name"] == name for c in _harmony_call(t)]
    return {
        "type": "structural_tag",
        "format": _sequence({"type": "star", "content": analysis}, {"type": "or", "elements": calls}),
    }
