"""Reranking throughput on the CPU: overnight's LLM.score against sentence-transformers'
CrossEncoder.predict, on the same cross-encoder and pairs, in one process (same torch threads), fp32.

The model is random weights of ms-marco-MiniLM-L6-v2's shape (BertForSequenceClassification: 6 layers,
hidden 384, 12 heads, MLP 1536, 512 positions, vocabulary 30,522, one label), with a WordPiece tokenizer
over a synthetic vocabulary (bench/cpu_compare.py). The job: --queries queries of 4 to 16 words, each
against --docs documents of 16 to 256 words (log-uniform), seed 0: a retriever's candidates, reranked.
The scores are checked first (equal to CrossEncoder.predict's within 1e-4 on the first 64 pairs, before
any activation). The two sides run alternately, --rounds times after a warm-up; the best run of each
counts, in wall time and in CPU time of the process.

    PYTHONPATH=. python bench/score_cpu.py [--queries 20] [--docs 50] [--threads N]
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
    from transformers import BertForSequenceClassification

    folder = os.path.join(root, "ms-marco-minilm-shape")
    return save_minilm_shape(folder, vocab_words, BertForSequenceClassification, num_labels=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--queries", type=int, default=20)
    p.add_argument("--docs", type=int, default=50, help="documents per query")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from sentence_transformers import CrossEncoder

    from overnight import LLM, PoolingParams

    words = synthetic_words()
    data = random.Random(0)
    jobs = [
        (words_between(data, words, 4, 16), [words_between(data, words, 16, 256) for _ in range(args.docs)])
        for _ in range(args.queries)
    ]
    pairs = [(q, d) for q, docs in jobs for d in docs]
    with tempfile.TemporaryDirectory() as root:
        folder = make_model(root, words)
        ce = CrossEncoder(folder, device="cpu", max_length=512)
        llm = LLM(folder)
        tok = llm.get_tokenizer()
        num_tokens = sum(len(ids) for ids in tok.encode_pairs([q for q, _ in pairs], [d for _, d in pairs]))

        raw = PoolingParams(use_activation=False)
        got = torch.tensor(
            [o.outputs.score for o in llm.score(*zip(*pairs[:64]), pooling_params=raw, use_tqdm=False)]
        )
        ref = torch.as_tensor(ce.predict(pairs[:64], activation_fn=torch.nn.Identity()))
        diff = (got - ref).abs().max().item()
        assert diff < 1e-4, f"scores differ from CrossEncoder.predict: max |diff| {diff}"

        def run_ce() -> None:
            ce.predict(pairs, batch_size=32)

        def run_ours() -> None:
            for query, docs in jobs:  # as a reranking service sees them: one query's candidates at a time
                llm.score(query, docs, use_tqdm=False)

        def run_ours_whole() -> None:
            llm.score([q for q, _ in pairs], [d for _, d in pairs], use_tqdm=False)

        sides = {
            "CrossEncoder.predict": run_ce,
            "overnight (per query)": run_ours,
            "overnight (one call)": run_ours_whole,
        }
        for fn in sides.values():
            fn()  # warm-up
        wall, cpu = alternate(sides, args.rounds)
    best = {k: min(v) for k, v in wall.items()}
    best_cpu = {k: min(v) for k, v in cpu.items()}
    base = "CrossEncoder.predict"
    threads = torch.get_num_threads()
    print(
        f"{len(pairs)} pairs ({args.queries} queries x {args.docs}), {num_tokens} tokens, torch threads {threads}"
    )
    print(f"max |score - CrossEncoder's| on 64 pairs: {diff:.2e}")
    print(f"{'engine':<26}{'best wall s':>12}{'pairs/s':>10}{'tok/s':>10}{'best CPU s':>12}{'speed-up':>10}")
    for name, t in best.items():
        up = best[base] / t
        print(
            f"{name:<26}{t:>12.2f}{len(pairs) / t:>10.0f}{num_tokens / t:>10.0f}{best_cpu[name]:>12.2f}{up:>9.2f}x"
        )
    result = {
        "bench": "score_cpu",
        "pairs": len(pairs),
        "tokens": num_tokens,
        "threads": threads,
        "max_abs_diff": diff,
        "wall_s": {k: round(v, 3) for k, v in best.items()},
        "cpu_s": {k: round(v, 3) for k, v in best_cpu.items()},
        "speedup": {k: round(best[base] / v, 3) for k, v in best.items()},
        "speedup_cpu_time": {k: round(best_cpu[base] / v, 3) for k, v in best_cpu.items()},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
