"""Tiny random embedding models saved as sentence-transformers folders, for tests anywhere.

    make_tiny_embedder(tmp, "bert", "mean", normalize=True)   BERT encoder (WordPiece tokenizer)
    make_tiny_embedder(tmp, "qwen3", "lasttoken")             Qwen3 decoder saved as sentence-transformers
                                                               saves Qwen3-Embedding: bare Qwen3Model weights,
                                                               a tokenizer that appends <|endoftext|>

The folder holds what sentence-transformers itself writes (modules.json, 1_Pooling/config.json,
2_Normalize, config_sentence_transformers.json), so loading it back with SentenceTransformer(folder) is
the reference.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.tiny_models import make_tiny_model

WORDS = (
    "the quick brown fox jumps over lazy dog a an of to in is it that for on with as was he she they we "
    "you night batch embed vector search query document model token long short text"
).split()
CHARS = "abcdefghijklmnopqrstuvwxyz0123456789"
EOS = "<|endoftext|>"

TEXTS = [
    "the quick brown fox",
    "a dog",
    "jumps over the lazy dog again and again tonight",
    "search query",
    "vector",
    "the model embeds a long document of text, token by token, for search",
    "we batch the night",
    "xyz 42",
]


def _vocab(specials: list[str]) -> list[str]:
    return specials + WORDS + list(CHARS + ".,!?") + ["##" + c for c in CHARS]


def _bert_tokenizer(folder: Path):
    from transformers import BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    vocab = folder / "vocab.txt"
    vocab.write_text("\n".join(_vocab(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])) + "\n")
    tok = BertTokenizerFast(str(vocab))
    os.remove(vocab)
    return tok


def _decoder_tokenizer():
    """WordPiece over lower-cased words, ending every prompt with EOS (as Qwen3-Embedding's does)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(_vocab(["<pad>", "<unk>", EOS]))}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(single=f"$A {EOS}", special_tokens=[(EOS, vocab[EOS])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token=EOS)


@torch.no_grad()
def make_tiny_bert(seed: int = 0, **overrides: Any):
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=len(_vocab(["", "", "", "", ""])),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        **overrides,
    )
    torch.manual_seed(seed)
    model = BertModel(config).eval()
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "LayerNorm.weight" in name:
            p.copy_(1.0 + 0.2 * (torch.rand(p.shape, generator=gen) - 0.5))
        elif name.endswith("bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        elif "embeddings" in name:
            p.copy_(torch.randn(p.shape, generator=gen))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
    return model


def make_tiny_embedder(
    tmp_path: str | os.PathLike,
    family: str,
    pooling_mode: str,
    *,
    normalize: bool = True,
    seed: int = 0,
    name: str | None = None,
    **overrides: Any,
) -> Path:
    """A sentence-transformers folder (see the module docstring); pooling_mode: "cls" | "mean" |
    "lasttoken". Returns the folder."""
    pytest.importorskip("sentence_transformers")  # writes the folder (a `test` extra, not the engine's)
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    root = Path(tmp_path) / (name or f"{family}-{pooling_mode}-{'norm' if normalize else 'raw'}")
    base = root.with_name(root.name + "-hf")
    if family == "bert":
        model = make_tiny_bert(seed, **overrides)
        tokenizer = _bert_tokenizer(base)
    else:
        model = make_tiny_model(family, seed=seed, vocab_size=len(_vocab(["", "", ""])), **overrides)
        tokenizer = _decoder_tokenizer()
    model.save_pretrained(base)
    tokenizer.save_pretrained(base)
    modules = [Transformer(str(base)), Pooling(model.config.hidden_size, pooling_mode=pooling_mode)]
    if normalize:
        modules.append(Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(str(root))
    return root


def reference_embeddings(folder: str | os.PathLike, texts: list[str], **kwargs: Any) -> torch.Tensor:
    SentenceTransformer = pytest.importorskip("sentence_transformers").SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu")
    return torch.as_tensor(model.encode(texts, convert_to_numpy=True, **kwargs))
