"""StructuredOutputsParams -> a compiled xgrammar grammar, for one tokenizer and model vocabulary.

Compiling happens where a request is validated (Engine.validate, before it is queued), so a schema or
regex that does not compile is that request's InvalidRequestError, never a failure inside a step. The
compiled grammars stay in an LRU keyed by StructuredOutputsParams.key (kind, canonical spec, whitespace):
a batch file that repeats one schema on every line compiles it once, and the runner's lookup when the
request is first sampled is a hit. Failures are cached too, so 10,000 lines with one bad schema compile it
once. Thread-safe: the server validates on its event loop while the engine thread steps.

Special tokens (<|im_start|>, <jupyter_code>, ...) are blanked from the vocabulary the grammar sees, so a
grammar never lets one stand for its literal text inside a string; stop tokens are allowed only where
the grammar may end, and ids past the tokenizer's vocabulary (a model's padded logits) never. A structural
tag is the exception: it names special tokens on purpose (harmony's <|channel|>, <|message|>), so it is
compiled against a second vocabulary view where special tokens keep their text (stop tokens excepted,
which xgrammar handles as the grammar's end).
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from overnight.errors import InvalidRequestError
from overnight.sampling_params import StructuredOutputsParams
from overnight.structured.schema_check import unsupported_keyword

if TYPE_CHECKING:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerBase

    from overnight.loader.source import ModelSource
    from overnight.tokenizer.tokenizer import Tokenizer

log = logging.getLogger("overnight")

DEFAULT_CAPACITY = 256  # compiled grammars kept; a JSON schema's is tens of KB to a few MB
# "[07:43:08] /project/cpp/regex_converter.cc:94: " in front of xgrammar's messages
_CPP_PREFIX = re.compile(r"^\s*\[[0-9:]+\] \S+:\d+: ")
_WHAT = {
    "json": "JSON schema",
    "json_object": "JSON object grammar",
    "structural_tag": "structural tag",
    "regex": "regex",
    "choice": "choice list",
    "grammar": "grammar",
}


def _import_xgrammar():
    try:
        import xgrammar
    except ImportError as e:  # a dependency of the package; missing only in a hand-made environment
        raise InvalidRequestError(f"structured outputs need the xgrammar package ({e})") from None
    return xgrammar


class GrammarCompiler:
    """Compiles and caches grammars. The tokenizer is read on the first compile (building the grammar
    engine's vocabulary takes a fraction of a second), so an engine that never sees a structured
    request pays nothing."""

    def __init__(
        self,
        load_tokenizer: Callable[[], PreTrainedTokenizerBase],
        vocab_size: int,
        stop_token_ids: Sequence[int],
        capacity: int = DEFAULT_CAPACITY,
    ) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size  # the model's: the width of the logits and of every mask
        self.stop_token_ids = tuple(stop_token_ids)
        self.capacity = capacity
        self._compiler: xgr.GrammarCompiler | None = None
        self._tag_compiler: xgr.GrammarCompiler | None = None  # special tokens visible (structural tags)
        self._hf: Any = None  # the tokenizer, once token_text needs it
        self._cache: OrderedDict[tuple, xgr.CompiledGrammar | str] = OrderedDict()
        self._lock = threading.Lock()
        self._init_lock = threading.Lock()
        self.num_compiled = 0  # cache misses (tests and logs read it)

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, vocab_size: int) -> GrammarCompiler:
        return cls(lambda: tokenizer.hf, vocab_size, tokenizer.eos_token_ids)

    @classmethod
    def for_source(cls, source: ModelSource) -> GrammarCompiler:
        """One that loads the source's tokenizer itself on first use (a tensor parallel rank)."""

        def load() -> PreTrainedTokenizerBase:
            from overnight.tokenizer.tokenizer import load_tokenizer

            return load_tokenizer(source).hf

        return cls(load, source.arch.vocab_size, source.eos_token_ids)

    # -- compiling --------------------------------------------------------------------------------

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar of these params; InvalidRequestError naming the problem otherwise."""
        key = params.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
        if hit is None:
            # Compiled outside the lock: two threads may compile one spec twice, never wait on each other.
            hit = self._compile(params)
            with self._lock:
                self._cache[key] = hit
                self.num_compiled += 1
                while len(self._cache) > self.capacity:
                    self._cache.popitem(last=False)
        if isinstance(hit, str):
            raise InvalidRequestError(hit)
        return hit

    def matcher(self, params: StructuredOutputsParams) -> xgr.GrammarMatcher:
        """A fresh matcher at the start of the grammar (one per sequence: n > 1 children each get one)."""
        xgr = _import_xgrammar()
        return xgr.GrammarMatcher(self.compile(params))

    def token_text(self, token_id: int) -> str:
        """A token's text (special tokens included), for a grammar that waits for a marker."""
        with self._init_lock:
            if self._hf is None:
                self._hf = self._load_tokenizer()
        return self._hf.decode([token_id], skip_special_tokens=False)

    def _compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar | str:
        """The grammar, or the message of why it cannot be built."""
        kind, spec, compact = params.key
        if kind == "json":
            found = unsupported_keyword(json.loads(spec))
            if found:
                return f"the JSON schema uses {found}, a keyword structured outputs cannot enforce"
        compiler = self._engine(special_tokens=kind == "structural_tag")
        try:
            if kind == "structural_tag":
                return compiler.compile_structural_tag(spec)
            if kind == "json":
                return compiler.compile_json_schema(spec, any_whitespace=not compact, strict_mode=True)
            if kind == "json_object":
                # Any object: strict mode would forbid every property of {"type": "object"}.
                return compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=not compact, strict_mode=False
                )
            if kind == "regex":
                return compiler.compile_regex(spec)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(json.loads(spec)))
            return compiler.compile_grammar(spec)
        except (RuntimeError, ValueError, TypeError) as e:
            message = _CPP_PREFIX.sub("", str(e)).strip().splitlines()
            return f"the {_WHAT[kind]} cannot be compiled: {message[0] if message else type(e).__name__}"

    def _engine(self, special_tokens: bool = False) -> xgr.GrammarCompiler:
        """xgrammar's compiler; special_tokens: the one whose vocabulary shows special tokens' text."""
        with self._init_lock:
            made = self._tag_compiler if special_tokens else self._compiler
            if made is None:
                xgr = _import_xgrammar()
                if self._hf is None:
                    self._hf = self._load_tokenizer()
                info = tokenizer_info(self._hf, self.vocab_size, self.stop_token_ids, special_tokens)
                # Our LRU bounds memory; xgrammar's own cache would grow with every distinct schema.
                made = xgr.GrammarCompiler(info, max_threads=min(8, os.cpu_count() or 1), cache_enabled=False)
                if special_tokens:
                    self._tag_compiler = made
                else:
                    self._compiler = made
            return made


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of the strings (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def tokenizer_info(
    hf: Any, vocab_size: int, stop_token_ids: Sequence[int], special_tokens: bool = False
) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary: the tokenizer's decoded tokens with special tokens blanked
    (an empty token is one the grammar never allows), padded or cut to the model's vocab_size.
    special_tokens: special tokens keep their text (a grammar may then name them), stop tokens only
    are blanked."""
    xgr = _import_xgrammar()
    stops = list(stop_token_ids) or None
    detected = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=stops)
    special = set(getattr(hf, "all_special_ids", []) or [])
    for tid, added in (getattr(hf, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            special.add(tid)
    special = {t for t in special if 0 <= t < vocab_size}
    if special_tokens:
        special &= set(detected.stop_token_ids)
    elif not special:
        return detected
    encoded: list[str] = [""] * vocab_size
    for token, tid in hf.get_vocab().items():
        if 0 <= tid < vocab_size and tid not in special:
            encoded[tid] = token
    return xgr.TokenizerInfo(
        encoded,
        detected.vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=detected.stop_token_ids,
        add_prefix_space=detected.add_prefix_space,
    )
