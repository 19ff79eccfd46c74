"""hf_overrides (options.py): a JSON object merged over config.json before the architecture is read, as
vLLM's; and what it most often says: run a causal-LM checkpoint as a sequence classifier whose head is
made from its LM head's rows of a few tokens (Qwen3-Reranker, bge-reranker-v2-gemma).

Merging: an override replaces config.json's value, except under a sub-config (a dict-valued key ending
in "_config" such as text_config, quantization_config excepted), which is merged key by key, as vLLM
updates a nested PretrainedConfig. Keys config.json does not know are kept: model code reads them.

The classifier keys, as vLLM reads them:

    classifier_from_token        vocabulary entries (token strings, not text to encode)
    method                       from_2_way_softmax: two tokens [false, true], one label
                                 no_post_processing: one label per token
    is_original_qwen3_reranker   true: method from_2_way_softmax, exactly two tokens

They make a head only for a ...ForSequenceClassification architecture; hf_overrides that name them for
another architecture are refused (say which one), config.json's own are left alone, as vLLM does.
Without a method, two tokens are [false, true] (from_2_way_softmax) and any other count gives one label
per token. num_labels and id2label are then set to the head's labels, named by their tokens (the true
token for a 2-way head), so the rest of the loader reads a plain sequence classifier.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from overnight.config import LM_HEAD_METHODS, LMHeadClassifier
from overnight.errors import ConfigError
from overnight.models.registry import hf_architecture_of, is_sequence_classifier

# The keys that ask for a head made from tokens (`method` alone is read only beside them).
_CLASSIFIER_KEYS = ("classifier_from_token", "is_original_qwen3_reranker")


def apply_hf_overrides(cfg: dict[str, Any], overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """config.json's dict with `overrides` merged over it (a new dict) and, for a classifier made from
    tokens, num_labels / id2label set to its labels; ConfigError for classifier keys that cannot work."""
    merged = _merge(cfg, overrides) if overrides else cfg
    arch = hf_architecture_of(merged) if overrides and _asks_for_head(overrides) else None
    if arch is not None and not is_sequence_classifier(arch):
        raise ConfigError(
            f"classifier_from_token / is_original_qwen3_reranker make a sequence classifier's head, but "
            f'the architecture is {arch}: add "architectures": ["{_seq_cls_name(arch)}"] to hf_overrides'
        )
    head = lm_head_classifier(merged)
    if head is None:
        return merged
    if head.method == "from_2_way_softmax":
        labels = [head.tokens[1]]
    else:
        labels = list(head.tokens)
    return {**merged, "num_labels": len(labels), "id2label": {str(i): t for i, t in enumerate(labels)}}


def _merge(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in overrides.items():
        old = merged.get(key)
        sub_config = key.endswith("_config") and key != "quantization_config"
        if sub_config and isinstance(old, dict) and isinstance(value, dict):
            merged[key] = _merge(old, value)
        else:
            merged[key] = value
    return merged


def lm_head_classifier(cfg: Mapping[str, Any]) -> LMHeadClassifier | None:
    """The head a config's classifier keys describe (see the module docstring), without token ids;
    None when it has none or is no ...ForSequenceClassification (as vLLM, which reads these keys only
    for those). ConfigError naming the key for values that cannot make a head."""
    if not _asks_for_head(cfg) or not is_sequence_classifier(hf_architecture_of(dict(cfg))):
        return None
    tokens = cfg.get("classifier_from_token")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) and t for t in tokens):
        raise ConfigError(
            f'classifier_from_token must be a non-empty list of token strings (e.g. ["no", "yes"]), '
            f"got {tokens!r}"
        )
    if len(set(tokens)) != len(tokens):
        raise ConfigError(f"classifier_from_token names a token twice: {tokens!r}")
    original = cfg.get("is_original_qwen3_reranker", False)
    if not isinstance(original, bool):
        raise ConfigError(f"is_original_qwen3_reranker must be true or false, got {original!r}")
    method = cfg.get("method")
    if original:
        if method not in (None, "from_2_way_softmax"):
            raise ConfigError(
                f"is_original_qwen3_reranker scores with method from_2_way_softmax, not {method!r}"
            )
        method = "from_2_way_softmax"
    if method is None:
        method = "from_2_way_softmax" if len(tokens) == 2 else "no_post_processing"
    if method not in LM_HEAD_METHODS:
        raise ConfigError(f"unknown method {method!r}: use one of {', '.join(LM_HEAD_METHODS)}")
    if method == "from_2_way_softmax" and len(tokens) != 2:
        raise ConfigError(
            f"method from_2_way_softmax{' (is_original_qwen3_reranker)' if original else ''} takes two "
            f'tokens [false, true] in classifier_from_token, e.g. ["no", "yes"]; got {tokens!r}'
        )
    return LMHeadClassifier(method, tuple(tokens))


def _asks_for_head(cfg: Mapping[str, Any]) -> bool:
    return any(cfg.get(k) not in (None, False) for k in _CLASSIFIER_KEYS)


def _seq_cls_name(arch: str) -> str:
    for suffix in ("ForCausalLM", "ForConditionalGeneration"):
        if arch.endswith(suffix):
            return arch[: -len(suffix)] + "ForSequenceClassification"
    return "Qwen3ForSequenceClassification"


def with_token_ids(
    head: LMHeadClassifier, vocab: Mapping[str, int], vocab_size: int, model: str
) -> LMHeadClassifier:
    """`head` with the ids of its tokens in the tokenizer's vocabulary (added tokens included);
    ConfigError naming the tokens it lacks, or ids past the LM head's rows (vocab_size)."""
    missing = [t for t in head.tokens if t not in vocab]
    if missing:
        raise ConfigError(
            f"classifier_from_token: {', '.join(repr(t) for t in missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not in the vocabulary of {model}'s tokenizer "
            '(name vocabulary entries, e.g. "yes" and "no" for Qwen3-Reranker)'
        )
    ids = tuple(int(vocab[t]) for t in head.tokens)
    outside = [t for t, i in zip(head.tokens, ids) if not 0 <= i < vocab_size]
    if outside:
        raise ConfigError(
            f"classifier_from_token: {', '.join(repr(t) for t in outside)} has an id past the LM head's "
            f"{vocab_size} rows"
        )
    return replace(head, token_ids=ids)
