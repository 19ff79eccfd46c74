"""Prompts of pooling requests as token ids: strings tokenized many at a time (the Rust tokenizer
batches them), and the truncation rule: a prompt longer than the model's context is refused unless
truncate_prompt_tokens asks for it to be cut (-1: to max_model_len), as vLLM does.

Truncation cuts on the tokenizer's truncation side (the end, for most), keeping the special tokens the
tokenizer adds (BERT's [CLS] ... [SEP], an embedding model's closing EOS); token-id prompts are cut on
the same side.

A score prompt is a text pair joined by the tokenizer (score_pairs, tokenize_pairs); too long a pair is
cut longest text first, as transformers' longest_first truncation and sentence-transformers'
CrossEncoder do. An LM made a reranker by hf_overrides (classifier_from_token) joins a pair as one text,
first + second, as vLLM does (Tokenizer.pairs_as_text), cut on the truncation side.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from overnight.entrypoints.prompts import PromptType, tokenize_prompt
from overnight.errors import InvalidRequestError

if TYPE_CHECKING:
    from overnight.tokenizer.tokenizer import Tokenizer

# Strings tokenized per call: large enough to spread over the tokenizer's threads, small enough that a
# streamed input is not held.
TOKENIZE_CHUNK = 512


def truncation_length(truncate_prompt_tokens: int | None, max_model_len: int) -> int | None:
    """The length prompts are cut to, or None (no cut: too long is an error)."""
    k = truncate_prompt_tokens
    if k is None:
        return None
    if k == -1:
        return max_model_len
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise InvalidRequestError(f"truncate_prompt_tokens must be -1 or an integer >= 1, got {k!r}")
    if k > max_model_len:
        raise InvalidRequestError(
            f"truncate_prompt_tokens ({k}) is more than this model's maximum context length ({max_model_len})"
        )
    return k


def truncate_ids(ids: list[int], length: int | None, side: str = "right") -> list[int]:
    if length is None or len(ids) <= length:
        return ids
    return ids[:length] if side == "right" else ids[len(ids) - length :]


def tokenize_for_pooling(
    prompts: Iterable[PromptType],
    tokenizer: Tokenizer | None,
    max_model_len: int,
    truncate_prompt_tokens: int | None = None,
) -> Iterator[tuple[str | None, list[int]]]:
    """(text, token ids) of each prompt, in order, read lazily. An unreadable prompt raises
    InvalidRequestError naming its index."""
    length = truncation_length(truncate_prompt_tokens, max_model_len)
    side = tokenizer.truncation_side if tokenizer is not None else "right"
    chunk: list[PromptType] = []
    start = 0
    for prompt in prompts:
        chunk.append(prompt)
        if len(chunk) == TOKENIZE_CHUNK:
            yield from _tokenize_chunk(chunk, start, tokenizer, length, side)
            start += len(chunk)
            chunk = []
    yield from _tokenize_chunk(chunk, start, tokenizer, length, side)


def _tokenize_chunk(
    chunk: list[PromptType], start: int, tokenizer: Tokenizer | None, length: int | None, side: str
) -> Iterator[tuple[str | None, list[int]]]:
    texts = [_text_of(p) for p in chunk]
    to_encode = [t for t in texts if t is not None]
    encoded = iter(tokenizer.encode_batch(to_encode, max_length=length) if to_encode and tokenizer else [])
    for i, (prompt, text) in enumerate(zip(chunk, texts)):
        try:
            if text is not None and tokenizer is not None:
                yield text, next(encoded)
                continue
            text, ids = tokenize_prompt(prompt, tokenizer)  # token ids, or the error that names the form
            yield text, truncate_ids(ids, length, side)
        except InvalidRequestError as e:
            raise InvalidRequestError(f"prompt {start + i}: {e}") from None


def _text_of(prompt: PromptType) -> str | None:
    """The text to tokenize, for a prompt given as text (a string, or a dict with only "prompt")."""
    if isinstance(prompt, str):
        return prompt
    if (
        isinstance(prompt, dict)
        and "prompt_token_ids" not in prompt
        and isinstance(prompt.get("prompt"), str)
    ):
        return prompt["prompt"]
    return None


def score_pairs(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """The pairs a score request names, as vLLM reads text_1 / text_2: one text against one or many,
    or two lists of the same length, pair by pair (a list of one text counts as one text)."""
    firsts = [text_1] if isinstance(text_1, str) else list(text_1)
    seconds = [text_2] if isinstance(text_2, str) else list(text_2)
    for what, texts in (("text_1", firsts), ("text_2", seconds)):
        if not texts:
            raise InvalidRequestError(f"{what} is empty: give at least one text")
        bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
        if bad is not None:
            raise InvalidRequestError(f"{what}[{bad}] is not a string (pairs are scored from text)")
    if len(firsts) == 1:
        return [(firsts[0], t) for t in seconds]
    if len(firsts) != len(seconds):
        raise InvalidRequestError(
            f"text_1 has {len(firsts)} texts and text_2 has {len(seconds)}: give one text_1 to score "
            "against every text_2, or as many of each (scored pair by pair)"
        )
    return list(zip(firsts, seconds))


def tokenize_pairs(
    pairs: Iterable[tuple[str, str]],
    tokenizer: Tokenizer | None,
    max_model_len: int,
    truncate_prompt_tokens: int | None = None,
) -> Iterator[list[int]]:
    """Each pair as one prompt, joined by the tokenizer as its cross-encoder reads a pair (BERT:
    [CLS] a [SEP] b [SEP]), read lazily in chunks; truncation cuts the longer text first."""
    if tokenizer is None:
        raise InvalidRequestError(
            "scoring text pairs needs the model's tokenizer (skip_tokenizer_init is set)"
        )
    length = truncation_length(truncate_prompt_tokens, max_model_len)
    chunk: list[tuple[str, str]] = []
    for pair in pairs:
        chunk.append(pair)
        if len(chunk) == TOKENIZE_CHUNK:
            yield from tokenizer.encode_pairs([a for a, _ in chunk], [b for _, b in chunk], length)
            chunk = []
    if chunk:
        yield from tokenizer.encode_pairs([a for a, _ in chunk], [b for _, b in chunk], length)


def checked_pairs(pairs: Iterable[tuple[str, str]]) -> Iterator[tuple[str, str]]:
    """The pairs of a streamed score job, each checked as it is read (InvalidRequestError naming it)."""
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(isinstance(t, str) for t in pair)):
            raise InvalidRequestError(f"pair {i}: expected (text_1, text_2), two strings, got {pair!r}")
        yield pair[0], pair[1]
