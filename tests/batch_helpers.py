"""What the run-batch tests share: a tiny random model with a word-level tokenizer (the batch_model
fixture, in conftest.py), input lines, and the command run in this process or in a subprocess."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny_models import make_tiny_checkpoint

# ---------------------------------------------------------------- the tiny model

REPO = Path(__file__).resolve().parents[1]

VOCAB = 384  # the tiny models' vocabulary; the tokenizer below fills it exactly

SPECIALS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]

WORDS = [f"w{i}" for i in range(len(SPECIALS), VOCAB)]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

SERVED = "tiny-batch"

MAX_MODEL_LEN = 96


def make_batch_model(root: str | os.PathLike) -> str:
    """A tiny random Qwen3 (eos id 2) with a word-level tokenizer over "w6".."w383" and a chat
    template, saved as one HF folder."""
    from tokenizers import AddedToken, decoders, pre_tokenizers
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    folder = make_tiny_checkpoint(root, "qwen3", name=SERVED)
    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    backend = RustTokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    backend.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        chat_template=CHAT_TEMPLATE,
    )
    hf.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def batch_model(tmp_path_factory) -> str:
    return make_batch_model(tmp_path_factory.mktemp("batch-model"))


def engine_flags(model: str, max_num_seqs: int = 16) -> list[str]:
    return [
        "--model",
        model,
        "--served-model-name",
        SERVED,
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-num-seqs",
        str(max_num_seqs),
        "--kv-cache-memory-bytes",
        str(8 << 20),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--attention-backend",
        "torch",
        "--no-progress",
    ]


# ---------------------------------------------------------------- input lines


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def chat_line(cid: str, content: str | list[dict], **body) -> dict:
    """A chat completion line of one user message: text, or a list of parts (text, images)."""
    return {
        "custom_id": cid,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": content}], **body},
    }


def completion_line(cid: str, prompt, **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": {"prompt": prompt, **body}}


def mixed_lines(n: int, seed: int = 0) -> list[dict]:
    """Chat and completion lines: greedy and seeded, stop strings, n=2, list and token-id prompts,
    logprobs; every sampled line has a seed so its output is reproducible."""
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        kind = i % 6
        common = {"max_tokens": rng.randint(1, 8)}
        if rng.random() < 0.3:
            common["model"] = SERVED
        if kind == 0:
            lines.append(chat_line(f"c{i}", words(rng, rng.randint(1, 12)), temperature=0, **common))
        elif kind == 1:
            lines.append(
                chat_line(
                    f"c{i}",
                    words(rng, 5),
                    temperature=0,
                    stop=[rng.choice(WORDS)],
                    logprobs=True,
                    top_logprobs=2,
                    **common,
                )
            )
        elif kind == 2:
            lines.append(
                chat_line(f"c{i}", words(rng, 4), n=2, temperature=0.8, seed=rng.randrange(1000), **common)
            )
        elif kind == 3:
            lines.append(
                completion_line(f"p{i}", words(rng, rng.randint(1, 10)), temperature=0, logprobs=1, **common)
            )
        elif kind == 4:
            prompts = [words(rng, rng.randint(1, 6)) for _ in range(rng.randint(2, 3))]
            lines.append(
                completion_line(
                    f"p{i}",
                    prompts,
                    n=2,
                    temperature=1.0,
                    seed=rng.randrange(1000),
                    stop=rng.choice(WORDS),
                    **common,
                )
            )
        else:
            ids = [[rng.randrange(6, VOCAB) for _ in range(rng.randint(1, 8))] for _ in range(2)]
            lines.append(
                completion_line(f"p{i}", ids if rng.random() < 0.5 else ids[0], temperature=0, **common)
            )
    return lines


def write_jsonl(path: str | os.PathLike, lines: list) -> None:
    with open(path, "w") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    with open(path) as f:
        return [json.loads(x) for x in f if x.strip()]


def expected_texts(model: str, lines: list[dict]) -> dict[str, list[str]]:
    """What LLM.generate gives for each line's prompts and params, choice by choice."""
    from overnight import LLM
    from overnight.openai_api.protocol import parse_request

    llm = LLM(
        model,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=16,
        kv_cache_memory_bytes=8 << 20,
        device="cpu",
        dtype="float32",
        attention_backend="torch",
    )
    prompts, params, owners = [], [], []
    for line in lines:
        req = parse_request(line["url"], line["body"])
        for text, ids in req.engine_prompts(llm.get_tokenizer()):
            prompts.append({"prompt": text, "prompt_token_ids": ids})
            params.append(req.to_sampling_params())
            owners.append(line["custom_id"])
    texts: dict[str, list[str]] = {}
    for owner, out in zip(owners, llm.generate(prompts, params, use_tqdm=False), strict=True):
        texts.setdefault(owner, []).extend(c.text for c in out.outputs)
    return texts


# ---------------------------------------------------------------- the command


def run_batch_lines(engine, lines: list[dict], images=None) -> list[dict]:
    """run-batch's runner over `lines` in this process with `engine` (and an LLM's image processor,
    for lines with images): the records it writes, in input order."""
    import io

    from overnight.batch.ordering import OutputOrder
    from overnight.batch.output import Sink
    from overnight.batch.reader import read_lines
    from overnight.batch.runner import BatchRunner
    from overnight.batch.summary import Summary
    from overnight.openai_api.inputs import served_names

    out = io.BytesIO()
    served = engine.source.served_name
    runner = BatchRunner(
        engine,
        Sink(out),
        Summary(input="-", output="-"),
        model_name=served,
        names=served_names(served),
        order=OutputOrder("input"),
        max_in_flight=4,
        images=images,
    )
    runner.run(read_lines(json.dumps(line).encode() + b"\n" for line in lines))
    return [json.loads(x) for x in out.getvalue().splitlines()]


def run_cli(args: list[str]) -> int:
    from overnight.cli import main

    return main(["run-batch", *args])


def run_subprocess(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "overnight", "run-batch", *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        **kwargs,
    )
