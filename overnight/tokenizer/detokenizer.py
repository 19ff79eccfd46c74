"""Incremental detokenization: the text delta of each newly generated token, in O(1) per token.

Decoding all output ids after every step costs O(length) per token. Instead only a short window of recent
tokens is decoded, twice:

    ids:   ... | prefix_offset ....... read_offset ....... len(ids) |
                 `-- already emitted --'  `-- not yet emitted --'

    prefix_text = decode(ids[prefix_offset:read_offset])
    new_text    = decode(ids[prefix_offset:])
    delta       = new_text[len(prefix_text):]

The already-emitted tokens in the window give the new ones their left context, so decoders that treat the
first token specially (a SentencePiece leading space) and merges across token edges come out as in a full
decode. While new_text ends in U+FFFD the newest tokens end inside a UTF-8 character (byte-level BPE splits
emoji and CJK across tokens): nothing is emitted and the window grows until the character is complete.

The window starts on the last few prompt tokens, so the first output token is decoded with its left
context too. For byte-level BPE this changes nothing: the deltas add up to decode(output ids). For a
SentencePiece tokenizer the first output token keeps its leading space (a decode of the output alone
strips it), so prompt + output text reads right.
"""

from __future__ import annotations

from overnight.tokenizer.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# Prompt tokens kept as left context for the first output token.
_PROMPT_CONTEXT = 5
# One UTF-8 character spans at most 4 bytes, so at most 4 tokens. A tail still incomplete after this many
# tokens is a genuinely invalid byte sequence (or a real U+FFFD) and is emitted as is, which bounds the
# window and so the cost per token.
_MAX_PENDING = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_ids[-_PROMPT_CONTEXT:])
        self._ids = context  # context tokens, then every output token
        self._num_context = len(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        self._chunks: list[str] = []

    @property
    def token_ids(self) -> list[int]:
        """The output ids appended so far."""
        return self._ids[self._num_context :]

    @property
    def text(self) -> str:
        """All output text emitted so far (held-back bytes excluded until finish())."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def append(self, new_ids: list[int]) -> str:
        """Add output tokens; return the text they complete (possibly empty)."""
        deltas = []
        for token_id in new_ids:
            self._ids.append(token_id)
            deltas.append(self._step(flush=False))
        return "".join(deltas)

    def finish(self) -> str:
        """Emit whatever is held back, an incomplete character included (as U+FFFD)."""
        return self._step(flush=True) if self._read_offset < len(self._ids) else ""

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self._ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def _step(self, flush: bool) -> str:
        new_text = self._decode(self._prefix_offset, len(self._ids))
        complete = len(new_text) > len(self._prefix_text) and not new_text.endswith(_REPLACEMENT)
        if not (complete or flush or len(self._ids) - self._read_offset >= _MAX_PENDING):
            return ""
        delta = new_text[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        if delta:
            self._chunks.append(delta)
        return delta
