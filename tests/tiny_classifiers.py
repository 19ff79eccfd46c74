"""Tiny random sequence classifiers and cross-encoders saved as HF folders, for tests anywhere.

    make_tiny_classifier(tmp, "bert")      BertForSequenceClassification (ms-marco MiniLM cross-encoder
                                           shape), WordPiece tokenizer: [CLS] a [SEP] b [SEP], token types
    make_tiny_classifier(tmp, "xlmr")      XLMRobertaForSequenceClassification (bge-reranker-v2-m3 shape):
                                           <s> a </s></s> b </s>, positions from pad_token_id + 1
    make_tiny_classifier(tmp, "qwen3")     Qwen3ForSequenceClassification: last token, `score` head
    num_labels=3                           a classifier of three classes (softmax probabilities)

The references are transformers' own model (reference_logits) and sentence-transformers' CrossEncoder.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from tests.tiny_embedders import EOS, _bert_tokenizer, _vocab
from tests.tiny_models import tiny_config

KINDS = ("bert", "xlmr", "qwen3")

QUERY = "the quick brown fox"
DOCS = [
    "a dog",
    "jumps over the lazy dog again and again tonight",
    "the model embeds a long document of text, token by token, for search",
    "xyz 42",
    "the quick brown fox jumps",
]


def _xlmr_tokenizer():
    """WordPiece over lower-cased words with RoBERTa's pair template; <pad> has id 1 (pad_token_id)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(_vocab(["<s>", "<pad>", "</s>", "<unk>"]))}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        sep_token="</s>",
        cls_token="<s>",
        pad_token="<pad>",
        unk_token="<unk>",
    )


def _decoder_pair_tokenizer():
    """The decoder embedders' tokenizer (tests/tiny_embedders.py), joining a pair as `a b <eos>`."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(_vocab(["<pad>", "<unk>", EOS]))}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single=f"$A {EOS}", pair=f"$A $B:1 {EOS}:1", special_tokens=[(EOS, vocab[EOS])]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token=EOS)


@torch.no_grad()
def _spread(model: torch.nn.Module, seed: int) -> None:
    """Weights with a larger spread than transformers' init, so scores differ visibly between pairs."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "LayerNorm.weight" in name or name.endswith("norm.weight"):
            p.copy_(1.0 + 0.2 * (torch.rand(p.shape, generator=gen) - 0.5))
        elif name.endswith("bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        elif "embed" in name:
            p.copy_(torch.randn(p.shape, generator=gen))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


def make_tiny_classifier(
    tmp_path: str | os.PathLike, kind: str, *, num_labels: int = 1, seed: int = 0, **config: Any
) -> Path:
    """A folder holding a tiny random classifier of `kind` (see the module docstring) and its
    tokenizer; config: config.json fields to add (e.g. sentence_transformers={"activation_fn": ...})."""
    import transformers

    folder = Path(tmp_path) / f"{kind}-{num_labels}"
    labels = {"num_labels": num_labels}
    if kind == "bert":
        tokenizer = _bert_tokenizer(folder)
        cfg: Any = transformers.BertConfig(
            vocab_size=len(tokenizer),
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=64,
            **labels,
        )
        model: Any = transformers.BertForSequenceClassification(cfg)
    elif kind == "xlmr":
        tokenizer = _xlmr_tokenizer()
        cfg = transformers.XLMRobertaConfig(
            vocab_size=len(tokenizer),
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=66,  # 64 positions past the padding id
            type_vocab_size=1,
            layer_norm_eps=1e-5,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
            **labels,
        )
        model = transformers.XLMRobertaForSequenceClassification(cfg)
    else:
        tokenizer = _decoder_pair_tokenizer()
        cfg = tiny_config(kind, vocab_size=len(tokenizer), pad_token_id=0, **labels)
        model = transformers.Qwen3ForSequenceClassification(cfg)
    for key, value in config.items():
        setattr(model.config, key, value)
    model.eval()
    _spread(model, seed)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@torch.no_grad()
def reference_logits(folder: str | os.PathLike, pairs: list[tuple[str, str]] | list[str]) -> torch.Tensor:
    """transformers' logits [N, num_labels] for text pairs (or single texts), one at a time, unpadded."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    rows = []
    for item in pairs:
        enc = tok(*item, return_tensors="pt") if isinstance(item, tuple) else tok(item, return_tensors="pt")
        rows.append(model(**enc).logits[0])
    return torch.stack(rows)
