"""A synthetic byte-level BPE tokenizer of any vocabulary size, for models that ship none (dummy presets).

Dummy weights come without a tokenizer, but whatever reads token text needs one of the model's vocabulary
size: a grammar engine (structured outputs) sizes its token masks by it, a server decodes with it. This
builds a deterministic one that encodes any text:

    ids 0 .. 255        the 256 bytes, as byte-level BPE spells them ("Ġ" is the space byte, ...)
    ids 256 ..          words over an alphabet of letters, digits and the space byte, shortest first
                        ("ab", then "abc", ...), each with the merge (prefix, last character)
    special_tokens      at the ids given (default: "<|endoftext|>" as the last id); generated words
                        skip those ids

Quotes, backslashes and other punctuation exist only as single bytes, as in real vocabularies where most
tokens are pieces of words: a JSON string then closes only through the one `"` token.
"""

from __future__ import annotations

import json
import os
import string
from collections.abc import Iterator, Mapping

from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE

_SPACE = "Ġ"  # the byte-level spelling of b" "
ALPHABET = string.ascii_lowercase + string.ascii_uppercase + string.digits + _SPACE


def _byte_chars() -> list[str]:
    """The 256 characters byte-level BPE uses for the bytes 0 .. 255, in byte order (printable bytes
    stand for themselves, the others are shifted past 255)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars: dict[int, str] = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return [chars[b] for b in range(256)]


def _words() -> Iterator[tuple[str, str]]:
    """(prefix, last character) of every word of length >= 2 over ALPHABET, shortest first."""
    level = list(ALPHABET)
    while True:
        longer = []
        for prefix in level:
            for ch in ALPHABET:
                longer.append(prefix + ch)
                yield prefix, ch
        level = longer


def default_special_tokens(vocab_size: int) -> dict[int, str]:
    return {vocab_size - 1: "<|endoftext|>"}


def build_synthetic_tokenizer(vocab_size: int, special_tokens: Mapping[int, str] | None = None) -> Tokenizer:
    """A byte-level BPE tokenizer with exactly vocab_size ids (see the module docstring)."""
    specials = dict(default_special_tokens(vocab_size) if special_tokens is None else special_tokens)
    if vocab_size < 256 + len(specials):
        raise ValueError(f"vocab_size {vocab_size} leaves no room for the 256 bytes and the special tokens")
    bad = [i for i in specials if not 256 <= i < vocab_size]
    if bad:
        raise ValueError(f"special token id {bad[0]} is not in [256, {vocab_size})")
    vocab: dict[str, int] = {ch: i for i, ch in enumerate(_byte_chars())}
    merges: list[tuple[str, str]] = []
    words = _words()
    next_id = 256
    while next_id < vocab_size:
        if next_id in specials:
            vocab[specials[next_id]] = next_id
        else:
            prefix, ch = next(words)
            vocab[prefix + ch] = next_id
            merges.append((prefix, ch))
        next_id += 1
    tok = Tokenizer(BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Already in the vocabulary at their ids: registering them only makes them special (matched whole,
    # skipped when decoding with skip_special_tokens).
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials.values()])
    return tok


def save_synthetic_tokenizer_folder(
    path: str | os.PathLike,
    vocab_size: int,
    special_tokens: Mapping[int, str] | None = None,
    eos_token: str | None = None,
) -> str:
    """Write the tokenizer as a Hugging Face tokenizer folder (tokenizer.json, tokenizer_config.json)
    that transformers' AutoTokenizer and servers load. eos_token: default the special token with the
    highest id. Returns the folder."""
    specials = dict(default_special_tokens(vocab_size) if special_tokens is None else special_tokens)
    tok = build_synthetic_tokenizer(vocab_size, specials)
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    eos = eos_token if eos_token is not None else specials[max(specials)]
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos,
        "pad_token": eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 20,
        "added_tokens_decoder": {
            str(i): {"content": t, "special": True, "normalized": False, "lstrip": False, "rstrip": False}
            for i, t in sorted(specials.items())
        },
    }
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return os.fspath(path)
