"""Build a fast tokenizer from a GGUF file's metadata in about a second.

A GGUF file carries its tokenizer as metadata: `tokenizer.ggml.tokens` (id -> piece), `.merges`
("left right" in rank order), `.token_type` (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused,
6 byte), the special ids, and `.pre`, which names the pre-tokenizer of the model's original tokenizer.

For byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`) with a known `.pre`, the tokenizer is
assembled here directly. Anything else (SentencePiece-style "llama" vocabularies, unknown pre-tokenizers)
goes through transformers' own conversion, which is slow (10-20 s), so its result is saved under
~/.cache/overnight/tokenizers and reused.

Where this build and transformers' conversion differ, this build follows the model's original tokenizer:
  - `.pre` picks the split rules (transformers uses the GPT-2 regex for every llama-architecture file,
    which differs from Llama 3's on digit runs and from SmolLM's on numerals after a space);
  - every control token is special and every user-defined token is an added (non-special) token
    (transformers' qwen2 path hardcodes three special tokens, so e.g. Qwen3's `<think>` gets split);
  - bos/eos/pad/unk are the pieces their ids name (transformers names bos as eos for llama files);
  - a bos/eos is added on encode when `tokenizer.ggml.add_bos_token` / `add_eos_token` say so.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import transformers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers import Tokenizer as RustTokenizer
from tokenizers.models import BPE
from transformers import PreTrainedTokenizerFast

from overnight.errors import ModelLoadError
from overnight.loader.gguf_file import read_gguf_file

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "overnight", "tokenizers")

_CONTROL, _UNKNOWN, _USER_DEFINED = 3, 2, 4

# Split rules of the original tokenizers, as regexes over the raw text (before the byte-to-char map).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2 is Llama 3's rule with single digits.
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


@dataclass(frozen=True)
class _PreRule:
    """How one `tokenizer.ggml.pre` family splits text before BPE."""

    split: str | None  # an isolating regex, or None for ByteLevel's built-in GPT-2 regex
    digits: bool = False  # isolate every numeric char first
    nfc: bool = False
    ignore_merges: bool = False  # a word that is itself a vocabulary entry is one token
    add_bos: bool = False  # the default when the file has no tokenizer.ggml.add_bos_token


_PRE_RULES = {
    "gpt-2": _PreRule(None),
    "smollm": _PreRule(None, digits=True),
    "starcoder": _PreRule(None, digits=True),
    "refact": _PreRule(None, digits=True),
    "llama-bpe": _PreRule(_LLAMA3_SPLIT, ignore_merges=True, add_bos=True),
    "llama3": _PreRule(_LLAMA3_SPLIT, ignore_merges=True, add_bos=True),
    "llama-v3": _PreRule(_LLAMA3_SPLIT, ignore_merges=True, add_bos=True),
    "qwen2": _PreRule(_QWEN2_SPLIT, nfc=True),
    "deepseek-r1-qwen": _PreRule(_QWEN2_SPLIT, nfc=True),
}


def _pre_tokenizer(rule: _PreRule, add_prefix_space: bool) -> pre_tokenizers.PreTokenizer:
    steps = []
    if rule.digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if rule.split is not None:
        steps.append(pre_tokenizers.Split(Regex(rule.split), behavior="isolated", invert=False))
    steps.append(
        pre_tokenizers.ByteLevel(
            add_prefix_space=add_prefix_space, trim_offsets=False, use_regex=rule.split is None
        )
    )
    return pre_tokenizers.Sequence(steps) if len(steps) > 1 else steps[0]


def can_build_fast(metadata: dict[str, Any]) -> bool:
    return (
        metadata.get("tokenizer.ggml.model") == "gpt2"
        and "tokenizer.ggml.merges" in metadata
        and metadata.get("tokenizer.ggml.pre") in _PRE_RULES
    )


def build_backend(metadata: dict[str, Any]) -> RustTokenizer:
    """The `tokenizers.Tokenizer` of a byte-level BPE GGUF vocabulary (see can_build_fast)."""
    rule = _PRE_RULES[metadata["tokenizer.ggml.pre"]]
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {piece: i for i, piece in enumerate(tokens)}
    # Byte-level pieces never contain a plain space (it is mapped to another char), so one split suffices.
    merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    model = BPE(
        vocab, merges, unk_token=None if unk_id is None else tokens[unk_id], ignore_merges=rule.ignore_merges
    )
    tok = RustTokenizer(model)
    if rule.nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = _pre_tokenizer(rule, bool(metadata.get("tokenizer.ggml.add_space_prefix", False)))
    tok.decoder = decoders.ByteLevel()
    # Control and unknown pieces are special (skipped by skip_special_tokens); user-defined ones are
    # matched whole in the input but decoded like text. Both bypass the normalizer and the BPE merges.
    special = [tokens[i] for i, t in enumerate(types) if t in (_CONTROL, _UNKNOWN)]
    user = [tokens[i] for i, t in enumerate(types) if t == _USER_DEFINED]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    return tok


def _special_token_kwargs(metadata: dict[str, Any]) -> dict[str, Any]:
    tokens = metadata["tokenizer.ggml.tokens"]
    kwargs: dict[str, Any] = {}
    for name, key in (
        ("bos_token", "bos"),
        ("eos_token", "eos"),
        ("unk_token", "unknown"),
        ("pad_token", "padding"),
    ):
        token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
        kwargs[name] = None if token_id is None or token_id >= len(tokens) else tokens[token_id]
    return kwargs


def load_gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """A transformers tokenizer for a GGUF file, carrying its chat template."""
    metadata = read_gguf_file(path).metadata
    if "tokenizer.ggml.tokens" not in metadata:
        raise ModelLoadError(
            f"{path} holds no tokenizer; pass token-id prompts with skip_tokenizer_init=True"
        )
    if not can_build_fast(metadata):
        return _load_converted(path, metadata)
    add_bos = bool(
        metadata.get("tokenizer.ggml.add_bos_token", _PRE_RULES[metadata["tokenizer.ggml.pre"]].add_bos)
    )
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    return PreTrainedTokenizerFast(
        tokenizer_object=build_backend(metadata),
        chat_template=metadata.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        model_max_length=_context_length(metadata),
        **_special_token_kwargs(metadata),
    )


def _context_length(metadata: dict[str, Any]) -> int:
    arch = metadata.get("general.architecture", "")
    return int(metadata.get(f"{arch}.context_length", 1 << 30))


def _load_converted(path: str, metadata: dict[str, Any]) -> PreTrainedTokenizerBase:
    """transformers' conversion, run once per file version and kept on disk."""
    real = os.path.realpath(path)
    st = os.stat(real)
    key = f"{real}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    cached = os.path.join(CACHE_DIR, hashlib.sha256(key.encode()).hexdigest()[:24])
    if not os.path.isdir(cached):
        logger.warning(
            "tokenizer of %s (model %r, pre %r) has no fast build; converting with transformers "
            "(slow, once; cached in %s)",
            path,
            metadata.get("tokenizer.ggml.model"),
            metadata.get("tokenizer.ggml.pre"),
            cached,
        )
        hf = transformers.AutoTokenizer.from_pretrained(
            os.path.dirname(real), gguf_file=os.path.basename(real), local_files_only=True
        )
        # Name the special tokens by the ids the file gives (transformers swaps bos and eos for llama).
        for name, value in _special_token_kwargs(metadata).items():
            if value is not None:
                setattr(hf, name, value)
        os.makedirs(CACHE_DIR, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=CACHE_DIR)
        hf.save_pretrained(tmp)
        try:
            os.rename(tmp, cached)  # atomic: a concurrent loader sees the whole folder or none
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    return transformers.AutoTokenizer.from_pretrained(cached, local_files_only=True)
