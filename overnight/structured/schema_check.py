"""Which JSON schema keywords the grammar engine cannot enforce.

xgrammar builds a grammar from the keywords it knows and silently drops the others, so an output could
then break the schema it was constrained by. A schema using one of those is refused up front, naming the
keyword and where it is. Annotations (title, description, default, examples, ...) constrain nothing and
pass. `oneOf` is generated as `anyOf`: its branches are assumed disjoint (as pydantic's unions are).
`format` passes: the formats xgrammar knows are enforced, unknown ones are annotations in JSON Schema.
Patterns are matched whole, which is stricter than JSON Schema's search, never looser.
"""

from __future__ import annotations

from typing import Any

# Keywords that constrain a value and that the grammar would ignore.
UNSUPPORTED = frozenset(
    {
        "not",
        "if",
        "then",
        "else",
        "contains",
        "minContains",
        "maxContains",
        "dependentRequired",
        "dependentSchemas",
        "dependencies",
        "$dynamicRef",
        "$recursiveRef",
    }
)
# Keywords whose value is one subschema / a list of them / a map of them.
_ONE = ("items", "additionalProperties", "propertyNames", "unevaluatedProperties", "unevaluatedItems")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions")


def unsupported_keyword(schema: Any) -> str | None:
    """'<keyword>' at <JSON pointer> for the first keyword the grammar cannot enforce; None when every
    keyword is supported."""
    return _walk(schema, "")


def _walk(schema: Any, path: str) -> str | None:
    if not isinstance(schema, dict):
        return None  # true/false schemas, or a malformed one the compiler reports itself
    where = path or "/"
    for key in schema:
        if key in UNSUPPORTED:
            return f"{key!r} at {where}"
    if schema.get("uniqueItems") is True:
        return f"'uniqueItems' at {where}"
    if "multipleOf" in schema and schema.get("type") != "integer":
        return f"'multipleOf' on a non-integer at {where}"
    if len(schema.get("allOf") or ()) > 1:
        return f"'allOf' with more than one subschema at {where}"
    for key in _ONE:
        if key in schema:
            found = _walk(schema[key], f"{path}/{key}")
            if found:
                return found
    for key in _LIST:
        subs = schema.get(key)
        if isinstance(subs, list):
            for i, sub in enumerate(subs):
                found = _walk(sub, f"{path}/{key}/{i}")
                if found:
                    return found
    for key in _MAP:
        subs = schema.get(key)
        if isinstance(subs, dict):
            for name, sub in subs.items():
                found = _walk(sub, f"{path}/{key}/{_escape(str(name))}")
                if found:
                    return found
    return None


def _escape(name: str) -> str:
    """A JSON pointer token (RFC 6901)."""
    return name.replace("~", "~0").replace("/", "~1")
