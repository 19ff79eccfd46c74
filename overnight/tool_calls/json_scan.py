"""A JSON scanner that reads as far as a text goes: where a value ends, or that it has not ended yet.

Tool-call parsers slice the model's own text of a call's arguments out of the output, so a streamed
call's argument fragments are exactly the characters the model wrote and their concatenation is the
final `arguments` string. While a value is incomplete, every character of it seen so far belongs to it
(a number may still grow, a string or object may still close), so a prefix never has to be taken back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_WS = " \t\r\n"


class Malformed(ValueError):
    """Text that no continuation can make valid JSON."""


def skip_ws(t: str, i: int) -> int:
    while i < len(t) and t[i] in _WS:
        i += 1
    return i


def string_end(t: str, i: int) -> int | None:
    """t[i] is '"': the index after the closing quote, or None if the text ends inside the string."""
    j = i + 1
    while j < len(t):
        ch = t[j]
        if ch == "\\":
            j += 2
            continue
        if ch == '"':
            return j + 1
        j += 1
    return None


def value_end(t: str, i: int) -> int | None:
    """The index after the JSON value starting at t[i], or None if the text ends first."""
    ch = t[i]
    if ch == '"':
        return string_end(t, i)
    if ch in "{[":
        depth = 0
        j = i
        while j < len(t):
            ch = t[j]
            if ch == '"':
                e = string_end(t, j)
                if e is None:
                    return None
                j = e
                continue
            if ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    if ch in "}],:":
        raise Malformed(f"unexpected {ch!r} at {i}")
    j = i  # a number or literal: ends where a delimiter starts; at the end of the text it may grow
    while j < len(t) and t[j] not in ",}]" + _WS:
        j += 1
    return j if j < len(t) else None


@dataclass
class Member:
    key: str
    start: int  # of the value
    end: int | None  # None: the value continues past the text


def object_members(t: str, i: int) -> tuple[list[Member], int | None]:
    """t[i] is '{': its members as far as the text goes, and the index after its '}' (None: open)."""
    members: list[Member] = []
    j = skip_ws(t, i + 1)
    if j < len(t) and t[j] == "}":
        return members, j + 1
    while j < len(t):
        if t[j] != '"':
            raise Malformed(f"expected a key at {j}")
        ke = string_end(t, j)
        if ke is None:
            return members, None
        key = json.loads(t[j:ke])
        j = skip_ws(t, ke)
        if j >= len(t):
            return members, None
        if t[j] != ":":
            raise Malformed(f"expected ':' at {j}")
        j = skip_ws(t, j + 1)
        if j >= len(t):
            return members, None
        ve = value_end(t, j)
        members.append(Member(key, j, ve))
        if ve is None:
            return members, None
        j = skip_ws(t, ve)
        if j >= len(t):
            return members, None
        if t[j] == "}":
            return members, j + 1
        if t[j] != ",":
            raise Malformed(f"expected ',' or '}}' at {j}")
        j = skip_ws(t, j + 1)
    return members, None


def string_value(t: str, m: Member) -> str | None:
    """A complete string member's value (None while open, or when it is not a string)."""
    if m.end is None or t[m.start] != '"':
        return None
    value = json.loads(t[m.start : m.end])
    return value if isinstance(value, str) else None
