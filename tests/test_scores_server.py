"""The scoring routes of `overnight serve` (/v1/score, /v1/rerank, /classify and their other paths)
against a tiny BERT cross-encoder and a 3-class classifier: the response shapes vLLM users know, values
equal to LLM.score / classify, and refusals (a generation model, an embedding model, bad bodies)."""

from __future__ import annotations

import pytest
import torch

# The server's packages (the `server` extra) and the test client: absent, the module is skipped.
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from overnight import LLM  # noqa: E402
from overnight.server.background import BackgroundServer  # noqa: E402
from overnight.server.cli import ServerOptions, make_app  # noqa: E402
from tests.tiny_classifiers import DOCS, QUERY, make_tiny_classifier, reference_logits  # noqa: E402

pytestmark = pytest.mark.slow  # serves models over HTTP


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_classifier(tmp_path_factory.mktemp("ce"), "bert")


@pytest.fixture(scope="module")
def url(folder):
    llm = LLM(str(folder), device="cpu", mode="server")
    with BackgroundServer(make_app(llm.engine, ServerOptions(), model_arg=str(folder))) as s:
        yield s.url


def test_score_and_rerank(url, folder):
    ref = torch.sigmoid(reference_logits(folder, [(QUERY, d) for d in DOCS])[:, 0]).tolist()
    one = httpx.post(url + "/v1/score", json={"model": folder.name, "text_1": QUERY, "text_2": DOCS[0]})
    assert one.status_code == 200, one.text
    body = one.json()
    assert body["object"] == "list" and body["model"] == httpx.get(url + "/v1/models").json()["data"][0]["id"]
    assert body["data"][0]["object"] == "score" and body["data"][0]["index"] == 0
    assert abs(body["data"][0]["score"] - ref[0]) < 2e-6
    assert body["usage"]["prompt_tokens"] > 0
    many = httpx.post(url + "/score", json={"text_1": [QUERY] * len(DOCS), "text_2": DOCS}).json()
    assert [d["index"] for d in many["data"]] == list(range(len(DOCS)))
    torch.testing.assert_close(
        torch.tensor([d["score"] for d in many["data"]]), torch.tensor(ref), atol=2e-6, rtol=0
    )

    documents = [DOCS[0], {"text": DOCS[1]}, *DOCS[2:]]
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        r = httpx.post(url + path, json={"query": QUERY, "documents": documents, "top_n": 3})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        best = sorted(range(len(DOCS)), key=lambda i: -ref[i])[:3]
        assert [x["index"] for x in results] == best  # best first, top_n of them
        assert [x["document"]["text"] for x in results] == [DOCS[i] for i in best]
        assert all(abs(x["relevance_score"] - ref[x["index"]]) < 2e-6 for x in results)
    bare = httpx.post(url + "/rerank", json={"query": QUERY, "documents": DOCS, "return_documents": False})
    assert len(bare.json()["results"]) == len(DOCS) and "document" not in bare.json()["results"][0]


def test_bad_bodies_are_400_naming_the_field(url):
    cases = [
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1 has 2 texts"),
        ("/v1/score", {"text_1": QUERY}, "text_2"),
        ("/v1/rerank", {"query": QUERY, "documents": []}, "documents"),
        ("/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": -1}, "top_n"),
        ("/v1/score", {"model": "other", "text_1": "a", "text_2": "b"}, "does not exist"),
        ("/v1/embeddings", {"input": "a dog"}, "not embeddings"),
        ("/v1/completions", {"prompt": "a dog"}, "does not generate text"),
    ]
    for path, body, message in cases:
        r = httpx.post(url + path, json=body)
        assert r.status_code in (400, 404), (path, r.text)
        assert message in r.json()["error"]["message"], (path, r.text)
    long_doc = " ".join(["the quick brown fox jumps over the lazy dog"] * 10)
    r = httpx.post(url + "/v1/score", json={"text_1": QUERY, "text_2": long_doc})
    assert r.status_code == 400 and "truncate_prompt_tokens" in r.json()["error"]["message"]
    r = httpx.post(
        url + "/v1/score", json={"text_1": QUERY, "text_2": long_doc, "truncate_prompt_tokens": 32}
    )
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 32


def test_classify_route(tmp_path):
    folder = make_tiny_classifier(tmp_path, "bert", num_labels=3)
    llm = LLM(str(folder), device="cpu", mode="server")
    texts = [QUERY, *DOCS]
    with BackgroundServer(make_app(llm.engine, ServerOptions())) as s:
        r = httpx.post(s.url + "/classify", json={"input": texts})
        assert r.status_code == 200, r.text
        data = r.json()["data"]
        probs = torch.tensor([d["probs"] for d in data])
        ref = torch.softmax(reference_logits(folder, texts), -1)
        torch.testing.assert_close(probs, ref, atol=2e-6, rtol=0)
        assert [d["label"] for d in data] == [f"LABEL_{i}" for i in ref.argmax(-1).tolist()]
        assert all(d["num_classes"] == 3 for d in data)
        r = httpx.post(s.url + "/v1/score", json={"text_1": "a", "text_2": "b"})
        assert r.status_code == 400 and "one label" in r.json()["error"]["message"]


def test_a_generation_server_refuses_scores(tmp_path):
    from tests.tiny_models import make_tiny_checkpoint

    llm = LLM(str(make_tiny_checkpoint(tmp_path)), skip_tokenizer_init=True, kv_cache_memory_bytes=4 << 20)
    with BackgroundServer(make_app(llm.engine, ServerOptions())) as s:
        for path in ("/v1/score", "/v1/rerank", "/classify"):
            r = httpx.post(
                s.url + path, json={"text_1": "a", "text_2": "b", "query": "a", "documents": ["b"]}
            )
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["code"] == "unsupported_model" and "cross-encoder" in error["message"]


def test_an_embedding_server_scores_by_cosine(tmp_path):
    import torch.nn.functional as F

    from tests.tiny_embedders import make_tiny_embedder

    llm = LLM(str(make_tiny_embedder(tmp_path, "bert", "cls")), device="cpu", mode="server")
    vectors = torch.tensor([o.outputs.embedding for o in llm.embed([QUERY, *DOCS], use_tqdm=False)])
    want = F.cosine_similarity(vectors[:1], vectors[1:]).tolist()
    with BackgroundServer(make_app(llm.engine, ServerOptions())) as s:
        r = httpx.post(s.url + "/v1/score", json={"text_1": QUERY, "text_2": DOCS})
        assert r.status_code == 200, r.text
        assert [d["score"] for d in r.json()["data"]] == pytest.approx(want, abs=1e-5)
        ranked = httpx.post(s.url + "/rerank", json={"query": QUERY, "documents": DOCS}).json()["results"]
        assert [x["index"] for x in ranked] == sorted(range(len(DOCS)), key=lambda i: -want[i])
        r = httpx.post(s.url + "/classify", json={"input": "a dog"})
        assert r.status_code == 400 and "no classification head" in r.json()["error"]["message"]
