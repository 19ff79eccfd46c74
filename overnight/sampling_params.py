"""SamplingParams and StructuredOutputsParams: field names and defaults as users know them from vLLM's
offline classes."""

from __future__ import annotations

import json as _json
from dataclasses import dataclass, field, replace
from typing import Any

from overnight.errors import InvalidRequestError

_GREEDY_EPS = 1e-5
# Fields validate() holds to a type before it compares them (the ranges are checked there).
_NUMBER_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
_BOOL_FIELDS = (
    "include_stop_str_in_output",
    "ignore_eos",
    "detokenize",
    "skip_special_tokens",
    "spaces_between_special_tokens",
)
_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """Constrains a request's output to a JSON schema, a regular expression, one of a list of strings, an
    EBNF grammar (root rule `root`), or any JSON object. Exactly one kind is set.

    Pure data, so requests pickle to other processes as they are; the compiled grammar is looked up by
    `key` in each process's cache (overnight/structured/compiler.py), never carried here."""

    json: dict[str, Any] | str | None = None  # a JSON schema, as a dict or its JSON text
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # JSON kinds. True, or None (the default): no whitespace outside strings but the separators of
    # `{"a": 1, "b": [1, 2]}`. False: any whitespace JSON allows. The default differs from vLLM's on
    # purpose: small models given free whitespace often emit newlines until max_tokens cuts the JSON.
    disable_any_whitespace: bool | None = None
    # The constraint starts after this text appears in the output (a reasoning parser's end marker:
    # the reasoning is free, the answer constrained); None: from the first token. Not part of `key`.
    start_after: str | None = None
    # An xgrammar structural tag ({"type": "structural_tag", "format": ...}, as a dict or its JSON text):
    # formats of type "token" match one token by its text, special tokens included (the harmony format's
    # forced tool call, tool_calls/forced.py). Python API only: the OpenAI bodies do not take it.
    structural_tag: dict[str, Any] | str | None = None
    key: tuple[str, str, bool] = field(init=False, repr=False, compare=False, default=("", "", True))

    def __post_init__(self) -> None:
        if self.disable_any_whitespace is not None and not isinstance(self.disable_any_whitespace, bool):
            raise InvalidRequestError(
                f"disable_any_whitespace must be a boolean, got {self.disable_any_whitespace!r}"
            )
        self.key = (self.kind, self._canonical_spec(), self.disable_any_whitespace is not False)

    @property
    def kind(self) -> str:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            what = ", ".join(given) if given else "none"
            raise InvalidRequestError(
                f"structured outputs take exactly one of {', '.join(_KINDS)}; got {what}"
            )
        return given[0]

    def _canonical_spec(self) -> str:
        """The constraint as one string: equal strings compile to the same grammar. Key order inside a
        schema is kept (it is the order the properties are generated in)."""
        kind = self.kind
        if kind == "structural_tag":
            return _canonical_object(self.structural_tag, "the structural tag")
        if kind == "json":
            return _canonical_object(self.json, "the JSON schema")
        if kind == "choice":
            choice = self.choice
            if not isinstance(choice, list | tuple) or not choice:
                raise InvalidRequestError("choice must be a non-empty list of strings")
            if any(not isinstance(c, str) or not c for c in choice):
                raise InvalidRequestError("every choice must be a non-empty string")
            return _json.dumps(list(choice), ensure_ascii=False)
        if kind == "json_object":
            if self.json_object is not True:
                raise InvalidRequestError(f"json_object must be true, got {self.json_object!r}")
            return ""
        text = getattr(self, kind)
        if not isinstance(text, str) or not text:
            raise InvalidRequestError(f"{kind} must be a non-empty string")
        return text


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None  # per request: the same seed gives the same text whatever else is batched
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None  # number of top logprobs per generated token (0: only the sampled one)
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # a dict of its fields is converted
    # Sample best_of completions, return the n with the highest cumulative logprob (None: best_of = n).
    best_of: int | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    allowed_token_ids: list[int] | None = None  # only these may be drawn
    # Words never generated: a word's last token is banned where the output already ends with the rest.
    bad_words: list[str] | None = None
    # Top logprobs per prompt token (0: only the prompt token's own); the first token has none.
    prompt_logprobs: int | None = None
    # Keep only the last k prompt tokens (-1: as many as leave room for one output token).
    truncate_prompt_tokens: int | None = None
    stop_strings: list[str] = field(init=False, default_factory=list, repr=False)
    # bad_words as token ids, set by the engine (which has the tokenizer): with_bad_words_tokenized().
    bad_words_token_ids: list[list[int]] = field(init=False, default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):  # as sampling params arrive from config or Ray Data
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:
                raise InvalidRequestError(f"structured_outputs: {e}") from None
        if isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            self.stop_strings = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        def bad(msg: str) -> None:
            raise InvalidRequestError(msg)

        for name in _NUMBER_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                bad(f"{name} must be a number, got {value!r}")
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                bad(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.n, int) or self.n < 1:
            bad(f"n must be an integer >= 1, got {self.n!r}")
        if self.temperature < 0:
            bad(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad(f"top_k must be 0 or -1 (off) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            bad(f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            bad(f"seed must be an integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            bad("stop must be a non-empty string or a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids or []):
            bad("stop_token_ids must be a list of non-negative integers")
        if self.stop_strings and not self.detokenize:
            bad("stop strings need detokenize=True")
        so = self.structured_outputs
        if so is not None:
            if not isinstance(so, StructuredOutputsParams):
                bad(f"structured_outputs must be a StructuredOutputsParams, got {type(so).__name__}")
            # The grammar decides where the output ends: its end allows only EOS, so EOS must end it.
            if self.ignore_eos:
                bad("ignore_eos cannot be combined with structured outputs (the grammar ends the output)")
            if self.min_tokens:
                bad("min_tokens cannot be combined with structured outputs (the grammar ends the output)")
        if self.best_of is not None and (not isinstance(self.best_of, int) or self.best_of < self.n):
            bad(f"best_of must be an integer >= n ({self.n}), got {self.best_of!r}")
        if self.logit_bias is not None and (
            not isinstance(self.logit_bias, dict)
            or any(not _is_id(k) or not isinstance(v, (int, float)) for k, v in self.logit_bias.items())
        ):
            bad("logit_bias must map token ids (non-negative integers) to numbers")
        if self.allowed_token_ids is not None and (
            not isinstance(self.allowed_token_ids, list)
            or not self.allowed_token_ids
            or not all(_is_id(t) for t in self.allowed_token_ids)
        ):
            bad("allowed_token_ids must be a non-empty list of non-negative integers")
        if self.bad_words is not None and (
            not isinstance(self.bad_words, list)
            or any(not isinstance(w, str) or not w.strip() for w in self.bad_words)
        ):
            bad("bad_words must be a list of non-blank strings")
        if self.prompt_logprobs is not None and (
            not _is_id(self.prompt_logprobs) or self.prompt_logprobs > 20
        ):
            bad(f"prompt_logprobs must be an integer in [0, 20], got {self.prompt_logprobs!r}")
        if self.truncate_prompt_tokens is not None and (
            not isinstance(self.truncate_prompt_tokens, int)
            or isinstance(self.truncate_prompt_tokens, bool)
            or (self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1)
        ):
            bad(f"truncate_prompt_tokens must be -1 or an integer >= 1, got {self.truncate_prompt_tokens!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1.0

    @property
    def num_samples(self) -> int:
        """Completions generated: best_of when set, else n."""
        return self.best_of or self.n

    @property
    def sampled_logprobs(self) -> int | None:
        """Top logprobs the sampler computes per output token: the user's `logprobs`, or 0 (the sampled
        token's own) when best_of > n needs cumulative logprobs to choose by; None: none."""
        if self.logprobs is None and self.num_samples > self.n:
            return 0
        return self.logprobs

    @property
    def needs_output_history(self) -> bool:
        """The sampler reads this request's earlier output tokens (penalties, multi-token bad words)."""
        return self.needs_penalties or any(len(w) > 1 for w in self.bad_words_token_ids)

    @property
    def has_logits_edits(self) -> bool:
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids)

    def truncate_prompt(self, ids: list[int], max_model_len: int) -> list[int]:
        """The prompt as truncate_prompt_tokens leaves it (its last tokens)."""
        k = self.truncate_prompt_tokens
        if k is None:
            return ids
        if k == -1:
            k = max_model_len - 1
        return ids[-k:] if len(ids) > k else ids

    def with_bad_words_tokenized(self, tokenizer: Any) -> SamplingParams:
        """A copy with bad_words_token_ids set (self when there are no bad words). Each word is banned as
        written and with a leading space, the two ways a word is tokenized mid-text."""
        if not self.bad_words:
            return self
        seqs: list[list[int]] = []
        for word in self.bad_words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = list(tokenizer.encode(text, add_special_tokens=False))
                if ids and ids not in seqs:
                    seqs.append(ids)
        out = replace(self)
        out.bad_words_token_ids = seqs
        return out


def _is_id(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _canonical_object(value: Any, what: str) -> str:
    """A JSON object given as a dict or as JSON text, written compactly (keys in their given order);
    InvalidRequestError naming `what` for text that is not JSON, a value that is not an object, or
    one JSON cannot write (NaN, a set)."""
    if isinstance(value, str):
        try:
            value = _json.loads(value)
        except ValueError as e:
            raise InvalidRequestError(f"{what} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{what} must be a JSON object, got {type(value).__name__}")
    try:
        return _json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(f"{what} cannot be written as JSON: {e}") from None
