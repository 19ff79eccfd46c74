"""A tiny random Qwen3-Reranker: a plain Qwen3ForCausalLM folder (no score head) whose tokenizer knows
"yes" and "no", scored as vLLM users load the published checkpoints (RERANKER_OVERRIDES); and the
reference, transformers' causal LM: sigmoid(logit_yes - logit_no) at the last token.

The tokenizer has no pair template and adds no special tokens, as Qwen's: a pair is its two texts
written one after the other (vLLM's rule for an LM used as a reranker).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tests.tiny_classifiers import _spread
from tests.tiny_embedders import _vocab
from tests.tiny_models import tiny_config

RERANKER_OVERRIDES = {
    "architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": True,
}
# The model card's template, in the tiny vocabulary's words (the query's part ends the first text).
QUERY = "judge the document for the query: the quick brown fox "
DOCS = [
    "document: a dog answer yes or no",
    "document: jumps over the lazy dog again and again tonight answer yes or no",
    "document: xyz 42 answer yes or no",
    "document: the quick brown fox jumps answer yes or no",
]


def _tokenizer():
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(_vocab(["<pad>", "<unk>", "<|endoftext|>", "yes", "no", "maybe"]))}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<|endoftext|>"
    )


def make_tiny_reranker(tmp_path: str | os.PathLike, *, tied: bool = False, seed: int = 0) -> Path:
    """A folder holding a tiny random Qwen3ForCausalLM (tied or untied embeddings) and its tokenizer."""
    import transformers

    folder = Path(tmp_path) / f"reranker-{'tied' if tied else 'untied'}"
    tokenizer = _tokenizer()
    cfg = tiny_config("qwen3", vocab_size=len(tokenizer), pad_token_id=0, tie_word_embeddings=tied)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    _spread(model, seed)
    if tied:  # the LM head's rows at the lm_head's spread (unit-size logits): scores not all 0 or 1
        with torch.no_grad():
            model.model.embed_tokens.weight.div_(cfg.hidden_size**0.5)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@torch.no_grad()
def reference_token_logits(folder: str | os.PathLike, texts: list[str], tokens: list[str]) -> torch.Tensor:
    """transformers' causal LM's logits [N, len(tokens)] of `tokens` at each text's last position, one
    text at a time."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ids = tok.convert_tokens_to_ids(tokens)
    rows = [model(**tok(t, return_tensors="pt")).logits[0, -1, ids] for t in texts]
    return torch.stack(rows)


def reference_scores(folder: str | os.PathLike, pairs: list[tuple[str, str]]) -> torch.Tensor:
    """The published Qwen3-Reranker's score: P(yes) of the softmax over "no" / "yes" at the last token."""
    logits = reference_token_logits(folder, [a + b for a, b in pairs], ["no", "yes"])
    return torch.sigmoid(logits[:, 1] - logits[:, 0])
