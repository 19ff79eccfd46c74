"""POST /tokenize and /detokenize, as vLLM's server spells them.

    /tokenize    {"prompt": "text", "add_special_tokens": true}                      (completion form)
                 {"messages": [...], "add_generation_prompt": true, ...}              (chat form)
              -> {"count": N, "max_model_len": L, "tokens": [ids], "token_strs": [pieces] | null}
    /detokenize  {"tokens": [ids]} -> {"prompt": "text"}

The chat form renders the messages through the model's chat template exactly as /v1/chat/completions
does, so its count is the prompt length a chat request would have.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import Field, ValidationError

from overnight.entrypoints.prompts import render_conversation
from overnight.errors import InvalidRequestError
from overnight.openai_api.errors import ApiError
from overnight.openai_api.inputs import check_model
from overnight.openai_api.protocol import (
    Bool,
    ChatMessage,
    TokenIds,
    _Body,
    check_text,
    conversation_of,
    describe_validation_error,
)

if TYPE_CHECKING:
    from collections.abc import Collection

    from overnight.tokenizer.tokenizer import Tokenizer


class TokenizeCompletionRequest(_Body):
    model: str | None = None
    prompt: str
    add_special_tokens: Bool = True
    return_token_strs: Bool = False


class TokenizeChatRequest(_Body):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: Bool = True
    add_special_tokens: Bool = False  # the template writes them
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: Bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: TokenIds


def _parse(cls: type[_Body], body: Any) -> Any:
    if not isinstance(body, dict):
        raise ApiError("invalid_request", "the request body must be a JSON object", "body")
    check_text(body)
    try:
        return cls.model_validate(body)
    except ValidationError as e:
        message, param = describe_validation_error(e)
        raise ApiError("invalid_request", message, param) from None


def _need(tokenizer: Tokenizer | None) -> Tokenizer:
    if tokenizer is None:
        raise ApiError("invalid_request", "this server has no tokenizer (skip_tokenizer_init is set)")
    return tokenizer


def tokenize(
    body: Any, tokenizer: Tokenizer | None, max_model_len: int, names: Collection[str]
) -> dict[str, Any]:
    """The /tokenize response for `body` (either form); raises ApiError."""
    is_chat = isinstance(body, dict) and "messages" in body
    req = _parse(TokenizeChatRequest if is_chat else TokenizeCompletionRequest, body)
    check_model(req.model, names)
    tok = _need(tokenizer)
    try:
        if isinstance(req, TokenizeChatRequest):
            text, ids = render_conversation(
                conversation_of(req.messages),
                tok,
                add_generation_prompt=req.add_generation_prompt,
                **(req.chat_template_kwargs or {}),
            )
            if req.add_special_tokens:
                ids = tok.encode(text, add_special_tokens=True)
        else:
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    except InvalidRequestError as e:
        raise ApiError.from_exception(e) from None
    pieces = [tok.decode([t], skip_special_tokens=False) for t in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": pieces}


def detokenize(body: Any, tokenizer: Tokenizer | None, names: Collection[str]) -> dict[str, Any]:
    """The /detokenize response for `body`; raises ApiError."""
    req = _parse(DetokenizeRequest, body)
    check_model(req.model, names)
    tok = _need(tokenizer)
    bad = [t for t in req.tokens if t >= tok.vocab_size]
    if bad:
        raise ApiError(
            "invalid_request",
            f"token id {bad[0]} is outside the tokenizer's vocabulary (size {tok.vocab_size})",
            "tokens",
        )
    return {"prompt": tok.decode(req.tokens, skip_special_tokens=False)}
