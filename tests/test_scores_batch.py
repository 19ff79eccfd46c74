"""/v1/score, /v1/rerank and /v1/classify lines through run-batch with a tiny BERT cross-encoder: good
lines answered with the server's shapes and scores equal to transformers', bad lines each their own
error line (the run goes on), results in input order."""

from __future__ import annotations

import json

import pytest
import torch

from tests.batch_helpers import read_jsonl, run_cli, write_jsonl
from tests.tiny_classifiers import DOCS, QUERY, make_tiny_classifier, reference_logits

pytestmark = pytest.mark.slow  # builds transformers models, runs run-batch

SERVED = "tiny-ce"


def line(cid: str, url: str, **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": url, "body": {"model": SERVED, **body}}


def test_score_and_rerank_lines_with_bad_lines(tmp_path):
    folder = make_tiny_classifier(tmp_path, "bert")
    pairs = [(QUERY, d) for d in DOCS] + [(d, QUERY) for d in DOCS]
    ref = dict(zip(pairs, torch.sigmoid(reference_logits(folder, pairs)[:, 0]).tolist()))
    good = [
        line("s-one", "/v1/score", text_1=QUERY, text_2=DOCS[1]),
        line("s-many", "/v1/score", text_1=QUERY, text_2=DOCS),
        line("s-pairwise", "/v1/score", text_1=DOCS, text_2=[QUERY] * len(DOCS)),
        line("r-all", "/v1/rerank", query=QUERY, documents=DOCS),
        line("r-top2", "/v1/rerank", query=QUERY, documents=DOCS, top_n=2),
        line("c-one", "/v1/classify", input=DOCS[0]),
    ]
    bad = {
        "b-mismatch": (line("b-mismatch", "/v1/score", text_1=DOCS[:2], text_2=DOCS[:3]), "invalid_request"),
        "b-empty": (line("b-empty", "/v1/rerank", query=QUERY, documents=[]), "invalid_request"),
        "b-long": (
            line("b-long", "/v1/score", text_1=QUERY, text_2="dog " * 100),
            "context_length_exceeded",
        ),
        "b-embed": (line("b-embed", "/v1/embeddings", input="a dog"), "invalid_request"),
        "b-model": (line("b-model", "/v1/rerank", query=QUERY, documents=DOCS, model="x"), "model_not_found"),
        "b-url": (line("b-url", "/v1/scores", text_1="a", text_2="b"), "unsupported_url"),
    }
    lines = []
    for g, (b, _) in zip(good, bad.values()):
        lines += [g, b]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(inp, lines)
    flags = ["--model", str(folder), "--served-model-name", SERVED, "--device", "cpu", "--no-progress"]
    assert run_cli(["-i", str(inp), "-o", str(out), *flags]) == 0
    results = read_jsonl(out)
    assert [r["custom_id"] for r in results] == [x["custom_id"] for x in lines]  # input order
    by_id = {r["custom_id"]: r for r in results}
    for cid, (_, code) in bad.items():
        assert by_id[cid]["error"]["code"] == code, by_id[cid]

    def body(cid: str) -> dict:
        assert by_id[cid]["error"] is None, by_id[cid]
        return json.loads(json.dumps(by_id[cid]["response"]["body"]))

    assert abs(body("s-one")["data"][0]["score"] - ref[(QUERY, DOCS[1])]) < 2e-6
    many = body("s-many")
    assert many["model"] == SERVED and [d["object"] for d in many["data"]] == ["score"] * len(DOCS)
    assert [d["score"] for d in many["data"]] == pytest.approx([ref[(QUERY, d)] for d in DOCS], abs=2e-6)
    pairwise = [d["score"] for d in body("s-pairwise")["data"]]
    assert pairwise == pytest.approx([ref[(d, QUERY)] for d in DOCS], abs=2e-6)
    ranked = sorted(range(len(DOCS)), key=lambda i: -ref[(QUERY, DOCS[i])])
    assert [r["index"] for r in body("r-all")["results"]] == ranked
    top2 = body("r-top2")["results"]
    assert [r["index"] for r in top2] == ranked[:2] and top2[0]["document"]["text"] == DOCS[ranked[0]]
    assert body("r-top2")["usage"]["total_tokens"] > 0
    (c,) = body("c-one")["data"]
    assert c["num_classes"] == 1 and c["label"] == "LABEL_0"


def test_score_lines_on_an_embedding_model(tmp_path):
    import torch.nn.functional as F

    from overnight import LLM
    from tests.tiny_embedders import make_tiny_embedder

    folder = make_tiny_embedder(tmp_path, "bert", "mean")
    vectors = torch.tensor(
        [o.outputs.embedding for o in LLM(str(folder), device="cpu").embed([QUERY, *DOCS], use_tqdm=False)]
    )
    want = F.cosine_similarity(vectors[:1], vectors[1:]).tolist()
    lines = [
        line("s", "/v1/score", text_1=QUERY, text_2=DOCS),
        line("r", "/v1/rerank", query=QUERY, documents=DOCS, top_n=1),
        line("c", "/v1/classify", input="a dog"),
    ]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(inp, lines)
    flags = ["--model", str(folder), "--served-model-name", SERVED, "--device", "cpu", "--no-progress"]
    assert run_cli(["-i", str(inp), "-o", str(out), *flags]) == 0
    by_id = {r["custom_id"]: r for r in read_jsonl(out)}
    assert [d["score"] for d in by_id["s"]["response"]["body"]["data"]] == pytest.approx(want, abs=1e-5)
    (best,) = by_id["r"]["response"]["body"]["results"]
    assert best["index"] == max(range(len(DOCS)), key=want.__getitem__)
    assert by_id["c"]["error"]["code"] == "invalid_request"  # no classification head
