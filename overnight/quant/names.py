"""Matching checkpoint module names against a quantization_config's ignore lists."""

from __future__ import annotations

import functools
import re


def module_matches(module: str, patterns: tuple[str, ...]) -> bool:
    """Whether a module name matches one of `patterns`: a name or dotted suffix of one
    ("mlp.gate" matches model.layers.3.mlp.gate), or "re:" and a regular expression of the whole name."""
    names, regexes = _compiled(patterns)
    if module in names or any(r.match(module) for r in regexes):
        return True
    return any(module.endswith("." + entry) for entry in names)


@functools.lru_cache(maxsize=64)
def _compiled(patterns: tuple[str, ...]) -> tuple[frozenset[str], tuple[re.Pattern[str], ...]]:
    """(the plain names, the "re:" entries compiled, as one alternation where they combine): a published
    ignore list may hold hundreds of entries (Meta's 405B FP8 lists every layer's attention), more than
    re's own cache, and every linear layer is matched against it while building and while estimating
    the weights (loader/fit.py)."""
    names = frozenset(p for p in patterns if not p.startswith("re:"))
    regexes = [p[3:] for p in patterns if p.startswith("re:")]
    if not regexes:
        return names, ()
    try:  # re.match of an alternation: whether any alternative matches at the start
        return names, (re.compile("|".join(f"(?:{r})" for r in regexes)),)
    except re.error:  # an entry with global inline flags ("(?i)...") cannot sit inside a group
        return names, tuple(re.compile(r) for r in regexes)
