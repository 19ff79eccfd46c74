"""Prompt forms users pass, turned into token ids: a string, a list of token ids, or a dict with
"prompt" or "prompt_token_ids"; and chat conversations through the tokenizer's chat template."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, get_args

from overnight.errors import InvalidRequestError

if TYPE_CHECKING:
    from overnight.tokenizer.tokenizer import Tokenizer

PromptType = str | list[int] | dict[str, Any]
Conversation = list[dict[str, Any]]

# The roles a conversation may use, for LLM.chat and the server alike (OpenAI's, "developer" included).
ChatRole = Literal["system", "developer", "user", "assistant", "tool"]
CHAT_ROLES: tuple[str, ...] = get_args(ChatRole)


def tokenize_prompt(prompt: PromptType, tokenizer: Tokenizer | None) -> tuple[str | None, list[int]]:
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), _check_ids(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise InvalidRequestError('a dict prompt needs "prompt" or "prompt_token_ids"')
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidRequestError(
                "text prompts need a tokenizer: the engine was started with skip_tokenizer_init; "
                'pass token ids instead ({"prompt_token_ids": [...]})'
            )
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, (list, tuple)):
        return None, _check_ids(prompt)
    raise InvalidRequestError(
        f"a prompt must be a string, a list of token ids or a dict, not {type(prompt).__name__}"
    )


def _check_ids(ids: Any) -> list[int]:
    if not isinstance(ids, (list, tuple)) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in ids
    ):
        raise InvalidRequestError("prompt_token_ids must be a list of integers")
    return list(ids)


def is_single_conversation(messages: Sequence[Any]) -> bool:
    return bool(messages) and isinstance(messages[0], dict)


def render_conversation(
    conversation: Conversation,
    tokenizer: Tokenizer | None,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    **template_kwargs: Any,
) -> tuple[str, list[int]]:
    if not conversation:
        raise InvalidRequestError("messages must not be empty")
    for i, m in enumerate(conversation):
        check_message(i, m)
    if tokenizer is None:
        raise InvalidRequestError("chat needs a tokenizer (skip_tokenizer_init is set)")
    if getattr(tokenizer, "is_harmony", False):
        return _render_harmony(conversation, tokenizer, template_kwargs)
    text = tokenizer.render_chat(
        [_for_template(m) for m in conversation],
        add_generation_prompt=add_generation_prompt,
        chat_template=chat_template,
        **template_kwargs,
    )
    # The template already holds any special tokens (BOS etc.): do not add them again.
    return text, tokenizer.encode(text, add_special_tokens=False)


def _render_harmony(
    conversation: Conversation, tokenizer: Tokenizer, template_kwargs: dict[str, Any]
) -> tuple[str, list[int]]:
    """gpt-oss: the prompt rendered by openai-harmony (reasoning effort, developer instructions, function
    tools), its text decoded with the special tokens (which the reply's parsing keys on)."""
    from overnight.reasoning.harmony import render_prompt

    try:
        ids = render_prompt(
            list(conversation), template_kwargs.get("reasoning_effort"), template_kwargs.get("tools")
        )
    except ValueError as e:
        raise InvalidRequestError(str(e)) from None
    return tokenizer.decode(ids, skip_special_tokens=False), ids


def check_message(index: int, m: Any) -> None:
    """The rules the server's schema applies, for LLM.chat too: a known role, and content that is text
    (a string or a list of text parts); only an assistant's content may be null."""
    if not isinstance(m, dict) or "role" not in m:
        raise InvalidRequestError(f'message {index}: each message needs "role" and "content"')
    role = m["role"]
    if role not in CHAT_ROLES:
        raise InvalidRequestError(
            f"message {index}: unknown role {role!r}; use one of {', '.join(CHAT_ROLES)}"
        )
    if role == "tool" and not m.get("tool_call_id"):
        raise InvalidRequestError(
            f"message {index}: a tool message needs tool_call_id (the id of the call it answers)"
        )
    content = m.get("content")
    if content is None:
        if role != "assistant":
            raise InvalidRequestError(
                f"message {index}: a {role} message needs content (only an assistant's may be null)"
            )
        return
    if isinstance(content, str):
        return
    if isinstance(content, list) and all(_is_text_part(p) or _image_url_of(p) is not None for p in content):
        return
    raise InvalidRequestError(
        f'message {index}: content must be a string or a list of text parts ({{"type": "text", "text": ...}}) '
        'and image parts ({"type": "image_url", "image_url": {"url": ...}})'
    )


def _is_text_part(p: Any) -> bool:
    return isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)


def _image_url_of(p: Any) -> str | None:
    """The URL of an OpenAI image part ({"type": "image_url", "image_url": {"url": ...}} or a bare
    string), None for anything else."""
    if not isinstance(p, dict) or p.get("type") != "image_url":
        return None
    ref = p.get("image_url")
    url = ref.get("url") if isinstance(ref, dict) else ref
    return url if isinstance(url, str) else None


def conversation_images(conversation: Conversation) -> list[str]:
    """The image URLs of a conversation's image parts, in the order the template writes them."""
    return [
        url
        for m in conversation
        if isinstance(m.get("content"), list)
        for p in m["content"]
        if (url := _image_url_of(p)) is not None
    ]


def _for_template(m: dict[str, Any]) -> dict[str, Any]:
    """A message as chat templates expect it: text content ("" for an assistant's null, which templates
    concatenate), and earlier tool calls' arguments as mappings (templates write them with tojson)."""
    calls = m.get("tool_calls")
    content = m.get("content")
    if isinstance(content, list) and any(_image_url_of(p) is not None for p in content):
        # Chat templates write {"type": "image"} as the model's image placeholder.
        m = {**m, "content": [{"type": "image"} if _image_url_of(p) is not None else p for p in content]}
    if m.get("content") is not None and not calls:
        return m
    m = {**m, "content": m.get("content") or ""}
    if calls:
        m["tool_calls"] = [_call_for_template(c) for c in calls]
    return m


def _call_for_template(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        arguments = json.loads(fn["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**fn, "arguments": arguments}}
