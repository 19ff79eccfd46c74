"""Scores, reranking and classes, vLLM's routes for cross-encoders and sequence classifiers: the request
bodies (pydantic) and the response bodies (JSON-ready dicts). Registers its bodies in protocol.ROUTES
(this package's __init__ imports it), so run-batch lines take these urls too.

    /v1/score     {"text_1": str | [str], "text_2": str | [str]}: one text_1 against every text_2, or two
                  lists pair by pair -> {"object": "list", "data": [{"index", "object": "score", "score"}]}
    /v1/rerank    {"query", "documents": [str | {"text"}], "top_n"} (Jina / Cohere style) ->
                  {"results": [{"index", "document": {"text"}, "relevance_score"}]}, best first, top_n of them
    /v1/classify  {"input": str | [str] | token ids} -> {"data": [{"index", "label", "probs", "num_classes"}]}

Each pair is one engine request (PoolingParams task "score"): the pair as the tokenizer joins it. An
embedding model scores too, as vLLM's does: each distinct text embedded once, a pair's score the cosine
similarity of its two embeddings.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pydantic import AliasChoices, Field, field_validator

from overnight.entrypoints.pooling_prompts import score_pairs, tokenize_pairs
from overnight.layers.pooler import cosine
from overnight.openai_api.convert import new_id
from overnight.openai_api.protocol import ROUTES, Bool, Int, TokenIds, _Body
from overnight.outputs import PoolingRequestOutput
from overnight.pooling_params import PoolingParams

if TYPE_CHECKING:
    from overnight.tokenizer.tokenizer import Tokenizer

SCORE_URL = "/v1/score"
RERANK_URL = "/v1/rerank"
CLASSIFY_URL = "/v1/classify"


def _cut_is_positive(v: int | None) -> int | None:
    if v == 0:
        raise ValueError("must be -1 (the context length) or at least 1")
    return v


def _not_empty(v: Any) -> Any:
    if v == "" or (isinstance(v, list) and (not v or any(x == "" or x == [] for x in v))):
        raise ValueError("must not be empty, nor hold an empty string or list")
    return v


class _PoolingBody(_Body):
    model: str | None = None
    # Cut each prompt to this many tokens (-1: to the context; a pair loses from its longer text first)
    # instead of refusing the longer ones.
    truncate_prompt_tokens: Int | None = Field(None, ge=-1)
    # False: the raw logits. (`activation`: vLLM's earlier name.)
    use_activation: Bool | None = Field(None, validation_alias=AliasChoices("use_activation", "activation"))
    user: str | None = None

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncation_is_positive(cls, v: int | None) -> int | None:
        return _cut_is_positive(v)


class ScoreRequest(_PoolingBody):
    # vLLM's names over its versions: text_1 / text_2, data_1 / data_2, queries / documents.
    text_1: str | list[str] = Field(validation_alias=AliasChoices("text_1", "data_1", "queries"))
    text_2: str | list[str] = Field(validation_alias=AliasChoices("text_2", "data_2", "documents"))

    @field_validator("text_1", "text_2")
    @classmethod
    def _texts_not_empty(cls, v: Any) -> Any:
        return _not_empty(v)

    def to_pooling_params(self) -> PoolingParams:
        return PoolingParams(task="score", use_activation=self.use_activation)

    def pairs(self) -> list[tuple[str, str]]:
        """InvalidRequestError for lists that do not pair up."""
        return score_pairs(self.text_1, self.text_2)


class RerankDocument(_Body):
    text: str


class RerankRequest(_PoolingBody):
    query: str = Field(min_length=1)
    documents: list[str | RerankDocument] = Field(min_length=1)
    top_n: Int | None = Field(None, ge=0)  # None or 0: every document
    return_documents: Bool = True

    def to_pooling_params(self) -> PoolingParams:
        return PoolingParams(task="score", use_activation=self.use_activation)

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]

    def pairs(self) -> list[tuple[str, str]]:
        return [(self.query, t) for t in self.texts()]


class ClassificationRequest(_PoolingBody):
    """Inputs as /v1/embeddings takes them; each gets its class probabilities."""

    input: str | list[str] | TokenIds | list[TokenIds]

    @field_validator("input")
    @classmethod
    def _input_not_empty(cls, v: Any) -> Any:
        return _not_empty(v)

    def to_pooling_params(self) -> PoolingParams:
        return PoolingParams(task="classify", use_activation=self.use_activation)

    def input_list(self) -> list[str | list[int]]:
        v = self.input
        if isinstance(v, str):
            return [v]
        if v and isinstance(v[0], int):
            return [list(v)]  # type: ignore[arg-type]
        return list(v)  # type: ignore[arg-type]


def pair_prompts(
    req: ScoreRequest | RerankRequest, tokenizer: Tokenizer | None, max_model_len: int
) -> list[tuple[str | None, list[int]]]:
    """One prompt per pair, joined by the tokenizer (InvalidRequestError naming what is wrong)."""
    ids = tokenize_pairs(req.pairs(), tokenizer, max_model_len, req.truncate_prompt_tokens)
    return [(None, p) for p in ids]


# Bodies whose prompts are pairs of texts.
PairRequest = ScoreRequest | RerankRequest
ScoringRequest = ScoreRequest | RerankRequest | ClassificationRequest

ROUTES[SCORE_URL] = ScoreRequest  # type: ignore[assignment]
ROUTES[RERANK_URL] = RerankRequest  # type: ignore[assignment]
ROUTES[CLASSIFY_URL] = ClassificationRequest  # type: ignore[assignment]


def scoring_response(
    req: ScoringRequest,
    outputs: Sequence[PoolingRequestOutput],
    model: str,
    labels: Sequence[str] = (),
    *,
    pairs: Sequence[tuple[int, int]] | None = None,
    response_id: str | None = None,
    created: int | None = None,
) -> dict[str, Any]:
    """The response to `req` whose prompts gave `outputs` (in prompt order); labels: the classifier's
    id2label, for /v1/classify; pairs: an embedding model's pairs (EngineInputs.pairs), each scored by
    the cosine similarity of two outputs."""
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    if pairs is not None:
        values = [[cosine(outputs[a].outputs.data, outputs[b].outputs.data)] for a, b in pairs]
    else:
        values = [o.outputs.data.tolist() for o in outputs]
    if isinstance(req, RerankRequest):
        texts = req.texts()
        order = sorted(range(len(values)), key=lambda i: -values[i][0])
        if req.top_n:
            order = order[: req.top_n]
        results: list[dict[str, Any]] = []
        for i in order:
            result: dict[str, Any] = {"index": i, "relevance_score": values[i][0]}
            if req.return_documents:
                result["document"] = {"text": texts[i]}
            results.append(result)
        return {"id": response_id or new_id("rerank"), "model": model, "usage": usage, "results": results}
    body: dict[str, Any] = {
        "id": response_id or new_id("score" if isinstance(req, ScoreRequest) else "classify"),
        "object": "list",
        "created": created if created is not None else int(time.time()),
        "model": model,
    }
    if isinstance(req, ScoreRequest):
        body["data"] = [{"index": i, "object": "score", "score": v[0]} for i, v in enumerate(values)]
    else:
        body["data"] = [
            {
                "index": i,
                "label": _label(labels, max(range(len(v)), key=v.__getitem__)),
                "probs": v,
                "num_classes": len(v),
            }
            for i, v in enumerate(values)
        ]
    body["usage"] = usage
    return body


def _label(labels: Sequence[str], i: int) -> str:
    return labels[i] if i < len(labels) else f"LABEL_{i}"
