"""Reasoning parsers: a thinking model's output split into its reasoning and its answer.

    parser = get_reasoning_parser("qwen3")          # the registry, by the names --reasoning-parser takes
    reasoning, content = parser.split(text, starts_in_reasoning=...)
    stream = parser.stream(starts_in_reasoning=...) # feed(delta) -> (reasoning delta, content delta)

Whole-text and streaming splits agree: the deltas of a stream, concatenated, equal the whole-text split of
the concatenated text, wherever the text was cut (tests/test_reasoning_parsers.py checks every cut).
Pure Python, no tokenizer: the server, run-batch and LLM.chat share it.
"""

from overnight.reasoning.parsers import (
    REASONING_PARSERS,
    ReasoningParser,
    ReasoningStream,
    get_reasoning_parser,
)

__all__ = ["REASONING_PARSERS", "ReasoningParser", "ReasoningStream", "get_reasoning_parser"]
