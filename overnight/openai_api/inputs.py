"""From a validated request body to what the engine takes: prompts (text, token ids) and SamplingParams
(or PoolingParams, for /v1/embeddings and the scoring routes: /v1/score, /v1/rerank, /v1/classify).

Every check a request can fail before it reaches the engine happens here, so a caller either gets
inputs the engine accepts or one ApiError naming the cause.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from jinja2 import TemplateError

from overnight.entrypoints.pooling_prompts import tokenize_for_pooling
from overnight.entrypoints.prompts import conversation_images
from overnight.errors import InvalidRequestError
from overnight.multimodal.inputs import MultiModalInputs
from overnight.multimodal.media import MediaError
from overnight.openai_api.errors import ApiError
from overnight.openai_api.protocol import AnyRequest, ChatCompletionRequest, EmbeddingRequest
from overnight.openai_api.responses import ResponsesRequest
from overnight.openai_api.scores import ClassificationRequest, RerankRequest, ScoreRequest, pair_prompts
from overnight.pooling_params import PoolingParams, RequestParams
from overnight.sampling_params import SamplingParams
from overnight.tool_calls.forced import ToolError, check_tools
from overnight.tool_calls.message import MessagePlan, plan_message

if TYPE_CHECKING:
    from overnight.multimodal.processor import ImageProcessor
    from overnight.options import ChatOptions
    from overnight.tokenizer.tokenizer import Tokenizer


@dataclass
class EngineInputs:
    prompts: list[tuple[str | None, list[int]]]  # one engine request each, in choice order
    params: SamplingParams | PoolingParams
    # Chat: how the output reads as a message (reasoning, tool calls); None: its text is the answer.
    plan: MessagePlan | None = None
    multi_modal: MultiModalInputs | None = None  # chat with image parts: the one prompt's images
    # Score / rerank on an embedding model: the prompts are the texts, and each pair scores the cosine
    # similarity of two of their embeddings (indices into prompts). None: a prompt per pair.
    pairs: list[tuple[int, int]] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(ids) for _, ids in self.prompts)

    @property
    def num_seqs(self) -> int:
        """Engine sequences these inputs become: prompts x best_of or n (one per prompt when pooling)."""
        n = self.params.num_samples if isinstance(self.params, SamplingParams) else 1
        return len(self.prompts) * n


# Bodies served by a pooling engine (runner "pooling").
PoolingRequest = EmbeddingRequest | ScoreRequest | RerankRequest | ClassificationRequest


def check_task(req: AnyRequest | PoolingRequest, runner: str | None) -> None:
    """A pooling request (embeddings, scores, classes) needs an engine that pools, a generation request
    one that generates (runner None: not known here; the engine's own checks still refuse the wrong
    kind, and tell embeddings from a classifier's scores)."""
    if isinstance(req, (ScoreRequest, RerankRequest, ClassificationRequest)):
        check_route_task(True, runner, "scores")
    else:
        check_route_task(isinstance(req, EmbeddingRequest), runner)


def check_route_task(pooling: bool, runner: str | None, what: str = "embeddings") -> None:
    """what: the pooling route's product ("embeddings", "scores"), for the message."""
    if runner is None:
        return
    if pooling and runner != "pooling":
        needs = (
            "start it with --runner pooling to serve /v1/embeddings"
            if what == "embeddings"
            else "/v1/score, /v1/rerank and /classify need a cross-encoder or sequence classifier "
            "(...ForSequenceClassification)"
        )
        raise ApiError(
            "unsupported_model",
            f"this model is served to generate text (runner 'generate'): it computes no {what}; {needs}",
            "model",
        )
    if not pooling and runner == "pooling":
        raise ApiError(
            "unsupported_model",
            "this model is served for pooling (runner 'pooling': embeddings, or a classifier's scores): "
            "it does not generate text; use /v1/embeddings, /v1/score, /v1/rerank or /classify",
            "model",
        )


def served_names(served_name: str, model_arg: str | None = None) -> set[str]:
    """The names a request's `model` may use: the served name, the --model argument as typed, and that
    path's last component (so "org/model" and "model" both match a folder named model)."""
    names = {served_name}
    for name in (model_arg, served_name):
        if name:
            names.add(name)
            names.add(os.path.basename(os.path.normpath(name)))
    return names


def check_model(requested: str | None, names: Collection[str]) -> None:
    """The body's model may be absent; when present it must name the model being served, in full or by
    its last path component ("HuggingFaceTB/SmolLM2-135M-Instruct" names SmolLM2-135M-Instruct)."""
    if requested is None or requested in names:
        return
    if os.path.basename(os.path.normpath(requested)) not in names:
        raise ApiError(
            "model_not_found",
            f"the model {requested!r} does not exist here; serving: {', '.join(sorted(names))}",
            "model",
        )


def check_prompt_length(
    ids: list[int], max_model_len: int, is_chat: bool, max_tokens: tuple[str, int] | None = None
) -> None:
    """The prompt must leave room for one output token, and for all of max_tokens when the request
    sets it (the offline class clamps instead; a server or batch user learns of it here)."""
    what = "messages" if is_chat else "prompt"
    if len(ids) >= max_model_len:
        raise ApiError(
            "context_length_exceeded",
            f"this model's maximum context length is {max_model_len} tokens, but your {what} resulted in "
            f"{len(ids)} tokens (at least one must be left to generate)",
            what,
        )
    if max_tokens is not None and len(ids) + max_tokens[1] > max_model_len:
        field, value = max_tokens
        raise ApiError(
            "context_length_exceeded",
            f"this model's maximum context length is {max_model_len} tokens, but you asked for "
            f"{len(ids) + value} tokens ({len(ids)} in the {what} + {value} of {field}): lower "
            f"{field} to at most {max_model_len - len(ids)}, or shorten the {what}",
            field,
        )


def prepare(
    req: AnyRequest | ResponsesRequest | PoolingRequest,
    tokenizer: Tokenizer | None,
    max_model_len: int,
    names: Collection[str],
    validate: Callable[[list[int], RequestParams], None] | None = None,
    runner: str | None = None,
    chat: ChatOptions | None = None,
    images: ImageProcessor | None = None,
    embedding_scores: bool = False,
    no_images: str = "this model does not take images",
) -> EngineInputs:
    """Checks the model name (and, given the engine's runner, that it serves this kind of request),
    renders / tokenizes the prompts, checks their length and builds the SamplingParams or
    PoolingParams; `validate` (Engine.validate) runs the engine's own checks on each prompt. `chat`:
    the reasoning and tool-call parsers the engine was started with; `embedding_scores`: the engine runs
    an embedding model, which scores pairs by cosine similarity; `images`: the image processor of a
    vision-language model (None: image parts are refused, with `no_images` as the reason)."""
    if isinstance(req, ResponsesRequest):
        req = req.as_chat()
    check_model(req.model, names)
    check_task(req, runner)
    if isinstance(req, (EmbeddingRequest, ClassificationRequest)):
        return _prepare_embedding(req, tokenizer, max_model_len, validate)
    if isinstance(req, (ScoreRequest, RerankRequest)):
        if embedding_scores:
            return _prepare_texts_of_pairs(req, tokenizer, max_model_len, validate)
        return _prepare_pairs(req, tokenizer, max_model_len, validate)
    is_chat = isinstance(req, ChatCompletionRequest)
    plan = None
    mm = None
    try:
        if is_chat and req.tools:  # checked before the template sees them
            check_tools(req.tools)
        params = req.to_sampling_params()
        prompts = req.engine_prompts(tokenizer)
        if isinstance(req, ChatCompletionRequest):
            plan, params = plan_message(
                chat, params, prompts[0][0], req.tools, req.tool_choice, req.parallel_tool_calls
            )
            urls = conversation_images(req.conversation())
            if urls:
                if images is None:
                    raise ApiError("invalid_request", f"{no_images} (image_url parts)", "messages")
                text, ids = prompts[0]
                try:
                    ids, mm = images.process(ids, urls)
                except MediaError as e:
                    raise ApiError("invalid_image", str(e), "messages") from None
                prompts = [(text, ids)]
    except ToolError as e:
        raise ApiError("invalid_request", str(e), e.param) from None
    except InvalidRequestError as e:
        raise ApiError.from_exception(e) from None
    except TemplateError as e:  # the model's chat template rejected these messages
        raise ApiError(
            "invalid_request", f"the chat template failed on these messages: {e}", "messages"
        ) from None
    # truncate_prompt_tokens: the engine keeps the prompt's tail; the checks and usage see that prompt.
    prompts = [(text, params.truncate_prompt(ids, max_model_len)) for text, ids in prompts]
    for _, ids in prompts:
        check_prompt_length(ids, max_model_len, is_chat, req.explicit_max_tokens())
        if validate is not None:
            try:
                validate(ids, params)
            except InvalidRequestError as e:
                raise ApiError.from_exception(e) from None
    return EngineInputs(prompts, params, None if plan is None or plan.is_plain else plan, mm)


def _prepare_embedding(
    req: EmbeddingRequest | ClassificationRequest,
    tokenizer: Tokenizer | None,
    max_model_len: int,
    validate: Callable[[list[int], RequestParams], None] | None,
) -> EngineInputs:
    try:
        params = req.to_pooling_params()
        prompts = list(
            tokenize_for_pooling(req.input_list(), tokenizer, max_model_len, req.truncate_prompt_tokens)
        )
    except InvalidRequestError as e:
        raise ApiError("invalid_request", str(e).replace("prompt ", "input ", 1), "input") from None
    for i, (_, ids) in enumerate(prompts):
        if len(ids) > max_model_len:
            raise ApiError(
                "context_length_exceeded",
                f"this model's maximum context length is {max_model_len} tokens, but input {i} has "
                f"{len(ids)} tokens; shorten it or set truncate_prompt_tokens",
                "input",
            )
        if validate is not None:
            try:
                validate(ids, params)
            except InvalidRequestError as e:
                param = "dimensions" if "dimensions" in str(e) or "Matryoshka" in str(e) else "input"
                raise ApiError("invalid_request", str(e), param) from None
    return EngineInputs(prompts, params)


def _prepare_pairs(
    req: ScoreRequest | RerankRequest,
    tokenizer: Tokenizer | None,
    max_model_len: int,
    validate: Callable[[list[int], RequestParams], None] | None,
) -> EngineInputs:
    """A score / rerank body's pairs, one prompt each, checked as embedding inputs are."""
    field = "documents" if isinstance(req, RerankRequest) else "text_2"
    try:
        params = req.to_pooling_params()
        prompts = pair_prompts(req, tokenizer, max_model_len)
    except InvalidRequestError as e:
        raise ApiError("invalid_request", str(e), "text_1" if "text_1" in str(e) else field) from None
    for i, (_, ids) in enumerate(prompts):
        if len(ids) > max_model_len:
            raise ApiError(
                "context_length_exceeded",
                f"this model's maximum context length is {max_model_len} tokens, but pair {i} has "
                f"{len(ids)} tokens; shorten it or set truncate_prompt_tokens",
                field,
            )
        if validate is not None:
            try:
                validate(ids, params)
            except InvalidRequestError as e:
                raise ApiError("invalid_request", str(e), "model") from None
    return EngineInputs(prompts, params)


def _prepare_texts_of_pairs(
    req: ScoreRequest | RerankRequest,
    tokenizer: Tokenizer | None,
    max_model_len: int,
    validate: Callable[[list[int], RequestParams], None] | None,
) -> EngineInputs:
    """An embedding model's score / rerank body: each distinct text embedded once, the pairs by index."""
    field = "documents" if isinstance(req, RerankRequest) else "text_2"
    try:
        pairs = req.pairs()
    except InvalidRequestError as e:
        raise ApiError("invalid_request", str(e), "text_1" if "text_1" in str(e) else field) from None
    index: dict[str, int] = {}
    for a, b in pairs:
        index.setdefault(a, len(index))
        index.setdefault(b, len(index))
    # Built unvalidated: the texts were checked as the score body's.
    embedding = EmbeddingRequest.model_construct(
        input=list(index), truncate_prompt_tokens=req.truncate_prompt_tokens
    )
    try:
        inputs = _prepare_embedding(embedding, tokenizer, max_model_len, validate)
    except ApiError as e:
        raise ApiError(e.code, e.message.replace("input ", "text ", 1), field) from None
    return replace(inputs, pairs=[(index[a], index[b]) for a, b in pairs])
