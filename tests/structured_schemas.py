"""JSON schemas for the structured-output tests on the default model: nested objects, enums, arrays,
numbers and integers with bounds, patterns. Strings are bounded (maxLength, patterns), so a small model
always reaches the end of the grammar within a few dozen tokens."""

from __future__ import annotations

import json
from typing import Any

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 16},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
            },
        },
        "required": ["name", "age", "address"],
    },
    "product": {
        "type": "object",
        "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
            "price": {"type": "number", "minimum": 0, "maximum": 1000},
            "tags": {
                "type": "array",
                "items": {"enum": ["new", "sale", "eco"]},
                "minItems": 1,
                "maxItems": 3,
            },
        },
        "required": ["sku", "price", "tags"],
    },
    "event": {
        "type": "object",
        "properties": {
            "kind": {"enum": ["meeting", "call", "trip"]},
            "attendees": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "maxLength": 10},
                        "role": {"enum": ["host", "guest"]},
                    },
                    "required": ["name", "role"],
                },
                "maxItems": 2,
            },
            "confirmed": {"type": "boolean"},
        },
        "required": ["kind", "attendees", "confirmed"],
    },
    "review": {
        "type": "object",
        "properties": {
            "rating": {"type": "integer", "minimum": 1, "maximum": 5},
            "sentiment": {"enum": ["positive", "neutral", "negative"]},
            "summary": {"type": "string", "maxLength": 30},
            "scores": {
                "type": "object",
                "properties": {
                    "quality": {"type": "number", "minimum": 0, "maximum": 10},
                    "value": {"type": "number", "exclusiveMinimum": 0, "maximum": 10},
                },
                "required": ["quality", "value"],
            },
        },
        "required": ["rating", "sentiment", "summary", "scores"],
    },
}


def assert_valid(text: str, schema: dict[str, Any]) -> Any:
    """The parsed JSON of text, which must validate against schema."""
    import jsonschema

    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value
