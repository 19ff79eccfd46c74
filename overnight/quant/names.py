"""Matching checkpoint module names against a quantization_config's ignore lists."""

from __future__ import annotations

import re


def module_matches(module: str, patterns: tuple[str, ...]) -> bool:
    """Whether a module name matches one of `patterns`: a name or dotted suffix of one
    ("mlp.gate" matches model.layers.3.mlp.gate), or "re:" and a regular expression of the whole name."""
    for entry in patterns:
        if entry.startswith("re:"):
            if re.match(entry[3:], module):
                return True
        elif module == entry or module.endswith("." + entry):
            return True
    return False
