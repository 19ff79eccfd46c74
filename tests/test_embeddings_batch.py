"""/v1/embeddings lines through run-batch: a 2,000-line file of every input form round-trips (each body
parsed by the openai package's CreateEmbeddingResponse, vectors equal to sentence-transformers'), bad
lines become error lines, and a run killed with SIGKILL finishes with --resume."""

from __future__ import annotations

import base64
import json
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.batch_helpers import REPO, read_jsonl, run_cli, write_jsonl
from tests.tiny_embedders import WORDS, make_tiny_embedder, reference_embeddings

pytestmark = pytest.mark.slow  # runs sentence-transformers and run-batch processes

SERVED = "tiny-embed"


@pytest.fixture(scope="module")
def embed_model(tmp_path_factory) -> str:
    return str(make_tiny_embedder(tmp_path_factory.mktemp("embed"), "bert", "mean"))


def flags(model: str) -> list[str]:
    return ["--model", model, "--served-model-name", SERVED, "--device", "cpu", "--no-progress"]


def line(cid: str, **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/embeddings", "body": {"model": SERVED, **body}}


def text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))


def good_lines(n: int, seed: int = 0) -> tuple[list[dict], dict[str, list[str]]]:
    """n lines and the texts each embeds, in every input form (token-id lines embed no text: None)."""
    rng = random.Random(seed)
    lines, texts = [], {}
    for i in range(n):
        cid = f"e{i}"
        kind = i % 4
        if kind == 0:
            t = [text(rng)]
            lines.append(line(cid, input=t[0]))
        elif kind == 1:
            t = [text(rng) for _ in range(rng.randint(2, 4))]
            lines.append(line(cid, input=t))
        elif kind == 2:
            t = [text(rng)]
            lines.append(line(cid, input=t[0], encoding_format="base64"))
        else:
            t = []
            lines.append(line(cid, input=[[2, 10 + i % 40, 11, 3], [2, 12, 3]]))
        texts[cid] = t
    return lines, texts


def vectors_of(body: dict) -> torch.Tensor:
    """The vectors of a response body, parsed as the openai package parses it (which first decodes
    base64: little-endian float32)."""
    from openai.types import CreateEmbeddingResponse

    decoded = json.loads(json.dumps(body))
    for d in decoded["data"]:
        if isinstance(d["embedding"], str):
            d["embedding"] = np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4").tolist()
    resp = CreateEmbeddingResponse.model_validate(decoded)
    assert resp.object == "list" and resp.model == SERVED
    assert [d.index for d in resp.data] == list(range(len(resp.data)))
    return torch.tensor([d.embedding for d in resp.data])


def test_two_thousand_lines_round_trip_with_bad_lines_as_errors(embed_model, tmp_path):
    lines, texts = good_lines(2000)
    bad = {
        "b-json": '{"custom_id": "b-json", "url": "/v1/embeddings", ',
        "b-empty": line("b-empty", input=""),
        "b-type": line("b-type", input=[1.5]),
        "b-long": line("b-long", input="dog " * 200),
        "b-dims": line("b-dims", input="a dog", dimensions=8),
        "b-model": line("b-model", input="a dog", model="another-model"),
        "b-chat": {
            "custom_id": "b-chat",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "hi"}]},
        },
    }
    codes = {
        "b-json": "invalid_json",
        "b-empty": "invalid_request",
        "b-type": "invalid_request",
        "b-long": "context_length_exceeded",
        "b-dims": "invalid_request",
        "b-model": "model_not_found",
        "b-chat": "unsupported_model",
    }
    everything = list(lines)
    for k, bad_line in enumerate(bad.values()):
        everything.insert(100 + 250 * k, bad_line)
    everything.append(line("t-cut", input="dog " * 200, truncate_prompt_tokens=16))
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(inp, everything)
    assert run_cli(["-i", str(inp), "-o", str(out), *flags(embed_model)]) == 0
    results = read_jsonl(out)
    assert [r["custom_id"] for r in results] == [
        x["custom_id"] if isinstance(x, dict) else "b-json" for x in everything
    ]  # input order
    by_id = {r["custom_id"]: r for r in results}
    for cid, code in codes.items():
        assert by_id[cid]["error"]["code"] == code, by_id[cid]
        assert by_id[cid]["response"]["status_code"] == 400 or code == "model_not_found"
    assert len(vectors_of(by_id["t-cut"]["response"]["body"])) == 1
    assert by_id["t-cut"]["response"]["body"]["usage"]["prompt_tokens"] == 16

    unique = sorted({t for ts in texts.values() for t in ts})
    ref = dict(zip(unique, reference_embeddings(embed_model, unique)))
    for cid, ts in texts.items():
        body = by_id[cid]["response"]["body"]
        got = vectors_of(body)
        assert got.shape[1] == 64
        if ts:
            want = torch.stack([ref[t] for t in ts])
            assert F.cosine_similarity(got, want).min() >= 0.9999
        else:  # token ids: two prompts of 4 and 3 tokens
            assert body["usage"] == {"prompt_tokens": 7, "total_tokens": 7}


def test_sigkill_then_resume_answers_every_line_once(embed_model, tmp_path):
    lines, _ = good_lines(400, seed=1)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(inp, lines)
    args = [sys.executable, "-m", "overnight", "run-batch", "-i", str(inp), "-o", str(out), "--resume"]
    args += [*flags(embed_model), "--max-num-seqs", "4", "--max-in-flight", "8"]
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.Popen(args, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while (not out.exists() or out.read_bytes().count(b"\n") < 50) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    written = out.read_bytes().count(b"\n")
    assert 50 <= written < 400  # killed mid-run
    done = subprocess.run(args, env=env, cwd=REPO, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    results = read_jsonl(out)
    assert sorted(r["custom_id"] for r in results) == sorted(x["custom_id"] for x in lines)
    assert all(r["error"] is None for r in results)
    assert f"{written} lines already answered".encode() in done.stderr or b"skipped" in done.stderr


def test_validate_only_checks_embedding_lines(embed_model, tmp_path, capsys):
    lines, _ = good_lines(20)
    lines += [line("b-long", input="dog " * 200), line("b-dims", input="a dog", dimensions=8)]
    write_jsonl(tmp_path / "in.jsonl", lines)
    assert run_cli(["-i", str(tmp_path / "in.jsonl"), "--validate-only", *flags(embed_model)]) == 1
    err = capsys.readouterr().err
    assert "22 lines: 20 valid, 2 invalid" in err and "context_length_exceeded 1" in err


def test_data_parallel_embeddings_equal_one_engine(embed_model):
    from overnight import LLM
    from tests.tiny_embedders import TEXTS

    one = torch.tensor([o.outputs.embedding for o in LLM(embed_model).embed(TEXTS * 3, use_tqdm=False)])
    dp = LLM(embed_model, data_parallel_size=2, device="cpu")
    try:
        two = torch.tensor([o.outputs.embedding for o in dp.embed(TEXTS * 3, use_tqdm=False)])
    finally:
        dp.engine.shutdown()
    torch.testing.assert_close(two, one)
