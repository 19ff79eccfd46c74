"""What makes a request unservable, checked before it is queued (one bad request must never fail
inside a step, where it would take every other request down with it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from overnight.config import PoolerConfig
from overnight.errors import InvalidRequestError
from overnight.pooling_params import PoolingParams, RequestParams

if TYPE_CHECKING:
    from overnight.multimodal.inputs import MultiModalInputs
    from overnight.structured.compiler import GrammarCompiler


@dataclass(frozen=True)
class RequestLimits:
    max_model_len: int
    vocab_size: int
    has_tokenizer: bool
    # With chunked prefill off, a prompt must fit one step's budget; None when chunking is on.
    max_unchunked_prompt: int | None = None
    pooler: PoolerConfig | None = None  # set for an engine that runs pooling requests, and only then
    hidden_size: int = 0


def validate_request(
    ids: list[int],
    params: RequestParams,
    limits: RequestLimits,
    grammars: GrammarCompiler | None = None,
) -> None:
    """Raise InvalidRequestError naming the problem if this prompt and params cannot be served.
    A generation prompt is checked as truncate_prompt_tokens leaves it. Structured outputs are compiled
    here (cached), so a grammar that cannot be built fails its request before it is queued."""
    if not ids:
        raise InvalidRequestError("the prompt is empty")
    if isinstance(params, PoolingParams):
        _validate_pooling(ids, params, limits)
        return
    ids = params.truncate_prompt(ids, limits.max_model_len)
    if not ids:
        raise InvalidRequestError("the prompt is empty")
    if limits.pooler is not None:
        raise InvalidRequestError(
            "this model runs as a pooling (embedding) model (runner 'pooling'): it does not generate "
            "text; ask for embeddings, or start it with runner 'generate'"
        )
    if len(ids) >= limits.max_model_len:
        raise InvalidRequestError(
            f"the prompt has {len(ids)} tokens, but max_model_len is {limits.max_model_len}: "
            "at least one token must be left to generate"
        )
    vocab = limits.vocab_size
    bad = [t for t in ids if not isinstance(t, int) or t < 0 or t >= vocab]
    if bad:
        raise InvalidRequestError(f"prompt token id {bad[0]!r} is outside the vocabulary (size {vocab})")
    if params.stop_strings and not limits.has_tokenizer:
        raise InvalidRequestError("stop strings need a tokenizer (skip_tokenizer_init is set)")
    if limits.max_unchunked_prompt is not None and len(ids) > limits.max_unchunked_prompt:
        raise InvalidRequestError(
            f"the prompt has {len(ids)} tokens, more than max_num_batched_tokens "
            f"({limits.max_unchunked_prompt}) with chunked prefill off"
        )
    params.validate()
    # Checked here, not in SamplingParams, because only the engine knows the vocabulary.
    bad = [t for t in params.stop_token_ids or [] if not 0 <= t < vocab]
    if bad:
        raise InvalidRequestError(f"stop token id {bad[0]!r} is outside the vocabulary (size {vocab})")
    for what, values in (
        ("logit_bias token id", list(params.logit_bias or ())),
        ("allowed token id", params.allowed_token_ids or []),
    ):
        bad = [t for t in values if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"{what} {bad[0]!r} is outside the vocabulary (size {vocab})")
    if params.bad_words and not limits.has_tokenizer:
        raise InvalidRequestError("bad_words need a tokenizer (skip_tokenizer_init is set)")
    if not 0 <= params.top_k < 1 << 62:  # becomes an int64 tensor entry
        raise InvalidRequestError(
            f"top_k must be below 2**62 (any value past the vocabulary means no top-k), got {params.top_k}"
        )
    if params.structured_outputs is not None:
        if grammars is None:
            raise InvalidRequestError("structured outputs need the model's tokenizer, and none is loaded")
        grammars.compile(params.structured_outputs)


def limits_of(config, vocab_size: int, has_tokenizer: bool) -> RequestLimits:
    """The limits an engine with this EngineConfig applies."""
    sched = config.scheduler
    return RequestLimits(
        max_model_len=sched.max_model_len,
        vocab_size=vocab_size,
        has_tokenizer=has_tokenizer,
        max_unchunked_prompt=None if sched.enable_chunked_prefill else sched.max_num_batched_tokens,
        pooler=config.model.pooler if config.model.runner == "pooling" else None,
        hidden_size=(
            config.model.pooler.output_size(config.model.arch.hidden_size)
            if config.model.pooler is not None
            else config.model.arch.hidden_size
        ),
    )


def _validate_pooling(ids: list[int], params: PoolingParams, limits: RequestLimits) -> None:
    pooler = limits.pooler
    if pooler is None:
        raise InvalidRequestError(
            "this model runs to generate text (runner 'generate'): start it with runner 'pooling' "
            "to compute embeddings"
        )
    if len(ids) > limits.max_model_len:
        raise InvalidRequestError(
            f"the prompt has {len(ids)} tokens, more than this model's maximum context length of "
            f"{limits.max_model_len} tokens; shorten it or pass truncate_prompt_tokens"
        )
    vocab = limits.vocab_size
    bad = [t for t in ids if not isinstance(t, int) or t < 0 or t >= vocab]
    if bad:
        raise InvalidRequestError(f"prompt token id {bad[0]!r} is outside the vocabulary (size {vocab})")
    if limits.max_unchunked_prompt is not None and len(ids) > limits.max_unchunked_prompt:
        raise InvalidRequestError(
            f"the prompt has {len(ids)} tokens, more than max_num_batched_tokens "
            f"({limits.max_unchunked_prompt}) with chunked prefill off"
        )
    params.validate()
    _validate_task(params, pooler)
    dims, full = params.dimensions, limits.hidden_size
    if dims is None or dims == full:
        return
    if not pooler.is_matryoshka:
        raise InvalidRequestError(
            f"this model does not support Matryoshka embeddings: dimensions must be {full} (or unset)"
        )
    allowed = pooler.matryoshka_dimensions
    if allowed is not None and dims not in allowed:
        raise InvalidRequestError(
            f"dimensions {dims} is not one this model was trained for: use one of "
            f"{', '.join(map(str, allowed))} or {full}"
        )
    if dims > full:
        raise InvalidRequestError(f"dimensions must be at most the model's size, {full}, got {dims}")


def _validate_task(params: PoolingParams, pooler: PoolerConfig) -> None:
    """An embedding needs an embedding model, a score or class a sequence classifier (a score one
    label)."""
    classifier = pooler.classifier
    if classifier is None:
        if params.task in ("classify", "score"):
            raise InvalidRequestError(
                f"this model computes embeddings: it has no classification head to {params.task} with; "
                "scores and classes need a sequence classifier or cross-encoder (...ForSequenceClassification)"
            )
        return
    if params.task == "embed":
        raise InvalidRequestError(
            "this model is a sequence classifier (cross-encoder): it computes scores and classes, not "
            "embeddings; use score / classify (/v1/score, /v1/rerank, /classify)"
        )
    if params.task == "score" and classifier.num_labels != 1:
        raise InvalidRequestError(
            f"scoring needs a model with one label (a cross-encoder); this classifier has "
            f"{classifier.num_labels}: use classify"
        )
    if params.dimensions is not None or params.normalize is not None:
        raise InvalidRequestError(
            "dimensions and normalize apply to embeddings, not to a classifier's scores"
        )


def validate_images(
    ids: list[int],
    params: RequestParams,
    multi_modal: MultiModalInputs,
    max_model_len: int,
    budget: int,
    text_only: bool = False,
) -> None:
    """Raise InvalidRequestError if a generation prompt's images cannot be served: a model run text-only
    (ModelArch.text_only) has no tower to encode them; its image tokens and positions are fixed, so it
    cannot be truncated; an image computed within one prefill chunk (whole_images) must fit one step's
    token budget."""
    if text_only and multi_modal.images:
        raise InvalidRequestError(
            f"the prompt has {len(multi_modal.images)} image(s), but this engine runs the model text-only "
            "(limit_mm_per_prompt image 0: no vision tower loaded)"
        )
    if isinstance(params, PoolingParams):
        return
    if len(params.truncate_prompt(ids, max_model_len)) != len(ids):
        raise InvalidRequestError("a prompt with images cannot be truncated (truncate_prompt_tokens)")
    if multi_modal.whole_images and multi_modal.images:
        big = max(im.num_tokens for im in multi_modal.images)
        if big > budget:
            raise InvalidRequestError(
                f"an image takes {big} tokens, more than max_num_batched_tokens ({budget}); this model "
                "computes each image within one prefill chunk: raise --max-num-batched-tokens"
            )
