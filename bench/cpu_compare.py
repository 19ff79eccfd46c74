"""What the CPU comparisons against sentence-transformers share (bench/embed_cpu.py, bench/score_cpu.py):
a synthetic vocabulary, MiniLM-L6-shaped BERT checkpoints with a WordPiece tokenizer over it, texts of
log-uniform length, and the timing loop that runs the sides alternately and keeps each one's runs."""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Callable
from typing import Any

import torch

WORD_CHARS = "abcdefghijklmnopqrstuvwxyz"
VOCAB_SIZE = 30522  # MiniLM's (BERT's uncased vocabulary)


def synthetic_words(seed: int = 1) -> list[str]:
    """~20,000 distinct lower-case words of 2 to 9 letters, sorted."""
    rng = random.Random(seed)
    return sorted({"".join(rng.choice(WORD_CHARS) for _ in range(rng.randint(2, 9))) for _ in range(20000)})


def words_between(rng: random.Random, words: list[str], lo: int, hi: int) -> str:
    """A text of lo to hi words, its length log-uniform (as titles, sentences and paragraphs mix)."""
    k = int(math.exp(rng.uniform(math.log(lo), math.log(hi))))
    return " ".join(rng.choice(words) for _ in range(k))


def save_minilm_shape(folder: str, vocab_words: list[str], model_class: Any, **config: Any) -> str:
    """Random weights of MiniLM-L6's shape (BERT: 6 layers, hidden 384, 12 heads, MLP 1536, 512
    positions) as `model_class` (BertModel, BertForSequenceClassification, ...) with `config`'s extra
    fields, seed 0, saved in folder with a WordPiece tokenizer: the special tokens, vocab_words, the
    letters and their ## continuations (so every word tokenizes), padded to VOCAB_SIZE entries."""
    from transformers import BertConfig, BertTokenizerFast

    os.makedirs(folder)
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = specials + vocab_words + list(WORD_CHARS) + ["##" + c for c in WORD_CHARS]
    vocab += [f"[unused{i}]" for i in range(VOCAB_SIZE - len(vocab))]
    with open(os.path.join(folder, "vocab.txt"), "w") as f:
        f.write("\n".join(vocab) + "\n")
    tokenizer = BertTokenizerFast(os.path.join(folder, "vocab.txt"))
    bert = BertConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=384,
        num_hidden_layers=6,
        num_attention_heads=12,
        intermediate_size=1536,
        max_position_embeddings=512,
        **config,
    )
    torch.manual_seed(0)
    model_class(bert).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def alternate(
    sides: dict[str, Callable[[], object]], rounds: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Each side run `rounds` times, the sides taking turns (so each sees the same machine): per side its
    runs' wall seconds and CPU seconds of the process (the steadier one on a shared machine)."""
    wall: dict[str, list[float]] = {n: [] for n in sides}
    cpu: dict[str, list[float]] = {n: [] for n in sides}
    for _ in range(rounds):
        for name, fn in sides.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    return wall, cpu
