"""The engine's tokenizer: a thin wrapper over a transformers tokenizer with a small, fixed surface.

Stop ids come from the ModelSource (generation_config / GGUF metadata), never from `tokenizer.eos_token`,
which is often wrong or incomplete (instruct models stop on an end-of-turn token the tokenizer does not
call eos). Decoding never applies transformers' "clean up tokenization spaces", so that the incremental
detokenizer and `decode` agree on every character.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

from overnight.errors import InvalidRequestError, ModelLoadError
from overnight.loader.source import ModelSource

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class Tokenizer:
    def __init__(
        self, hf: PreTrainedTokenizerBase, eos_token_ids: tuple[int, ...], pairs_as_text: bool = False
    ) -> None:
        """pairs_as_text: a score pair is its two texts written one after the other and tokenized as
        one text (vLLM's rule for an LM used as a reranker, whose prompts carry their own template),
        instead of the tokenizer's pair template."""
        self.hf = hf
        self.pairs_as_text = pairs_as_text
        # The engine checks lengths against max_model_len itself; transformers' own limit only makes it
        # warn ("will result in indexing errors") about prompts the engine then refuses with a message.
        hf.model_max_length = sys.maxsize
        self.eos_token_ids = tuple(eos_token_ids)
        # The Rust tokenizer decodes exactly as the wrapper does (without clean-up) at a fraction of the
        # per-call overhead, which matters for the detokenizer's one-or-two decodes per output token.
        self._backend = getattr(hf, "backend_tokenizer", None)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included."""
        return len(self.hf)

    @property
    def all_special_ids(self) -> list[int]:
        return list(self.hf.all_special_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    @property
    def truncation_side(self) -> str:
        """Which end truncation cuts ("right" keeps a prompt's start)."""
        return getattr(self.hf, "truncation_side", "right")

    def encode_batch(
        self, texts: list[str], add_special_tokens: bool = True, max_length: int | None = None
    ) -> list[list[int]]:
        """Many texts at once (the Rust tokenizer spreads them over threads); with max_length, each is
        cut to that many tokens on the truncation side, special tokens kept."""
        enc = self.hf(
            texts,
            add_special_tokens=add_special_tokens,
            truncation=max_length is not None,
            max_length=max_length,
            return_attention_mask=False,
            return_token_type_ids=False,
        )
        return [list(ids) for ids in enc["input_ids"]]

    @property
    def sep_token_id(self) -> int | None:
        """BERT's [SEP] (XLM-R's </s>): the end of a pair's first text; None when the tokenizer has none."""
        sep = getattr(self.hf, "sep_token_id", None)
        return sep if isinstance(sep, int) else None

    def encode_pairs(
        self, firsts: list[str], seconds: list[str], max_length: int | None = None
    ) -> list[list[int]]:
        """Pairs joined as the tokenizer joins a text pair (BERT: [CLS] a [SEP] b [SEP]), as a
        cross-encoder reads them; with max_length, each pair is cut to that many tokens by removing
        tokens from the longer text first (transformers' longest_first), special tokens kept. With
        pairs_as_text, each pair is the text first + second, cut on the truncation side."""
        if self.pairs_as_text:
            return self.encode_batch([a + b for a, b in zip(firsts, seconds)], max_length=max_length)
        enc = self.hf(
            firsts,
            seconds,
            truncation="longest_first" if max_length is not None else False,
            max_length=max_length,
            return_attention_mask=False,
            return_token_type_ids=False,
        )
        return [list(ids) for ids in enc["input_ids"]]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._backend is not None:
            return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self.hf.decode(
            ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    @property
    def is_harmony(self) -> bool:
        """gpt-oss's tokenizer: chats are rendered in the harmony format (reasoning/harmony.py)."""
        vocab = self.hf.get_vocab()
        return "<|channel|>" in vocab and "<|constrain|>" in vocab

    def render_chat(
        self,
        conversation: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """The conversation as the prompt text the chat template produces."""
        if chat_template is None and not getattr(self.hf, "chat_template", None):
            raise InvalidRequestError(
                "this model has no chat template; pass chat_template=... or send a plain text prompt"
            )
        text = self.hf.apply_chat_template(
            conversation,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
            tokenize=False,
            **kwargs,
        )
        assert isinstance(text, str)
        return text

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """Prompt ids of a conversation. The template writes any bos itself, so none is added on encode
        (transformers' own tokenize=True path does the same)."""
        kwargs.pop("tokenize", None)
        text = self.render_chat(conversation, add_generation_prompt, chat_template, **kwargs)
        return self.encode(text, add_special_tokens=False)


def load_tokenizer(source: ModelSource) -> Tokenizer:
    """The tokenizer a model source names: its GGUF metadata, or the tokenizer files of its folder."""
    path = source.tokenizer_path
    if path is None:
        raise ModelLoadError(
            f"no tokenizer for {source.served_name}; pass token-id prompts with skip_tokenizer_init=True"
        )
    if path.endswith(".gguf") and os.path.isfile(path):
        from overnight.tokenizer.gguf_tokenizer import load_gguf_tokenizer

        hf = load_gguf_tokenizer(path)
    else:
        # A folder, or a repo id already in the local HF cache; never the network. Imported here: the
        # auto classes cost seconds of start-up that the GGUF path does not need.
        from transformers import AutoTokenizer

        try:
            hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ModelLoadError(
                f"cannot load a tokenizer from {path} (not a tokenizer folder, .gguf file or "
                f"repo in the local HF cache): {e}"
            ) from e
    # An LM made a reranker by hf_overrides (classifier_from_token) reads pairs as vLLM writes them.
    return Tokenizer(hf, source.eos_token_ids, pairs_as_text=source.lm_head_classifier is not None)
