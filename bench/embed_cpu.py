"""Embedding throughput on the CPU: overnight's LLM.embed against sentence-transformers' encode, on the
same model and texts, in one process (same torch threads), fp32.

The model is random weights of MiniLM-L6's shape (BERT: 6 layers, hidden 384, 12 heads, MLP 1536, 512
positions, vocabulary 30,522, mean pooling, normalized), saved as a sentence-transformers folder with a
WordPiece tokenizer over a synthetic vocabulary. Texts: 2,000 (seed 0) of 4 to 128 words, log-uniform,
as a corpus of titles, sentences and short paragraphs is. The two sides run alternately, --rounds times
(each after a warm-up); the best run of each counts, in wall time and in CPU time of the process (the
second is steadier on a machine shared with other work). The embeddings are checked first (cosine >=
0.9999 against sentence-transformers on the first 64 texts).

    PYTHONPATH=. python bench/embed_cpu.py [--texts 2000] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile

import torch

sys.path.insert(0, ".")

from bench.cpu_compare import alternate, save_minilm_shape, synthetic_words, words_between  # noqa: E402


def make_model(root: str, vocab_words: list[str]) -> str:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from transformers import BertModel

    base = save_minilm_shape(os.path.join(root, "minilm-shape-hf"), vocab_words, BertModel)
    folder = os.path.join(root, "minilm-shape")
    modules = [Transformer(base), Pooling(384, pooling_mode="mean"), Normalize()]
    SentenceTransformer(modules=modules, device="cpu").save(folder)
    return folder


def make_texts(n: int, words: list[str], seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [words_between(rng, words, 4, 128) for _ in range(n)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--texts", type=int, default=2000)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from sentence_transformers import SentenceTransformer

    from overnight import LLM

    words = synthetic_words()
    with tempfile.TemporaryDirectory() as root:
        folder = make_model(root, words)
        texts = make_texts(args.texts, words)
        st = SentenceTransformer(folder, device="cpu")
        st.max_seq_length = 512
        llm = LLM(folder)
        num_tokens = sum(len(ids) for ids in llm.get_tokenizer().encode_batch(texts))

        ref = torch.as_tensor(st.encode(texts[:64]))
        got = torch.tensor([o.outputs.embedding for o in llm.embed(texts[:64], use_tqdm=False)])
        cos = torch.nn.functional.cosine_similarity(got, ref).min().item()
        assert cos >= 0.9999, f"embeddings differ from sentence-transformers: min cosine {cos}"

        def run_st() -> None:
            st.encode(texts, batch_size=32)

        def run_ours() -> None:
            llm.embed(texts, use_tqdm=False)

        wall, cpu = alternate({"sentence-transformers": run_st, "overnight": run_ours}, args.rounds)
    best = {k: min(v) for k, v in wall.items()}
    best_cpu = {k: min(v) for k, v in cpu.items()}
    speedup = best["sentence-transformers"] / best["overnight"]
    speedup_cpu = best_cpu["sentence-transformers"] / best_cpu["overnight"]
    threads = torch.get_num_threads()
    print(f"{args.texts} texts, {num_tokens} tokens, torch threads {threads}, min cosine {cos:.6f}")
    print(f"{'engine':<24}{'best wall s':>12}{'texts/s':>10}{'tok/s':>10}{'best CPU s':>12}")
    for name, t in best.items():
        print(f"{name:<24}{t:>12.2f}{args.texts / t:>10.0f}{num_tokens / t:>10.0f}{best_cpu[name]:>12.2f}")
    print(f"speed-up: {speedup:.2f}x wall, {speedup_cpu:.2f}x CPU time")
    result = {
        "bench": "embed_cpu",
        "texts": args.texts,
        "tokens": num_tokens,
        "threads": threads,
        "wall_s": {k: round(v, 3) for k, v in best.items()},
        "cpu_s": {k: round(v, 3) for k, v in best_cpu.items()},
        "wall_runs": {k: [round(x, 3) for x in v] for k, v in wall.items()},
        "cpu_runs": {k: [round(x, 3) for x in v] for k, v in cpu.items()},
        "speedup": round(speedup, 3),
        "speedup_cpu_time": round(speedup_cpu, 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
