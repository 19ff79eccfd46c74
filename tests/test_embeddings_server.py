"""/v1/embeddings through the official `openai` client against a server running a tiny Qwen3 embedding
model (saved as sentence-transformers saves Qwen3-Embedding): a string, a list, token ids, base64,
Matryoshka dimensions; and the routes of the other kind answer 400 on both kinds of model."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F

from overnight import LLM
from overnight.server.background import BackgroundServer
from overnight.server.cli import ServerOptions, make_app
from tests.tiny_embedders import TEXTS, make_tiny_embedder, reference_embeddings

pytestmark = pytest.mark.slow  # serves a model over HTTP


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_embedder(tmp_path_factory.mktemp("served"), "qwen3", "lasttoken", is_matryoshka=True)


@pytest.fixture(scope="module")
def server(folder):
    llm = LLM(str(folder), runner="pooling", mode="server", max_num_batched_tokens=16)
    with BackgroundServer(make_app(llm.engine, ServerOptions(), model_arg=str(folder))) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def as_tensor(resp) -> torch.Tensor:
    """The vectors; a base64 one (what the client hands back when base64 was asked for explicitly) is
    little-endian float32."""
    rows = [
        np.frombuffer(base64.b64decode(d.embedding), dtype="<f4")
        if isinstance(d.embedding, str)
        else d.embedding
        for d in resp.data
    ]
    return torch.tensor(np.array(rows, dtype=np.float32))


def test_openai_client_embeddings(client, folder):
    model = client.models.list().data[0].id
    ref = reference_embeddings(folder, TEXTS)
    one = client.embeddings.create(model=model, input=TEXTS[0])
    assert one.object == "list" and len(one.data) == 1 and one.data[0].index == 0
    assert F.cosine_similarity(as_tensor(one), ref[:1]).item() >= 0.9999
    many = client.embeddings.create(model=model, input=TEXTS)
    assert [d.index for d in many.data] == list(range(len(TEXTS)))
    assert F.cosine_similarity(as_tensor(many), ref).min() >= 0.9999
    assert many.usage.prompt_tokens == many.usage.total_tokens > len(TEXTS)

    b64 = client.embeddings.create(model=model, input=TEXTS, encoding_format="base64")
    assert isinstance(b64.data[0].embedding, str)
    torch.testing.assert_close(as_tensor(b64), as_tensor(many))
    default = client.embeddings.create(model=model, input=TEXTS[:2])  # the client asks for base64 itself
    torch.testing.assert_close(as_tensor(default), as_tensor(many)[:2])

    ids = client.embeddings.create(model=model, input=[[5, 6, 7, 2], [8, 2]])
    assert len(ids.data) == 2 and ids.usage.prompt_tokens == 6
    single_ids = client.embeddings.create(model=model, input=[5, 6, 7, 2])
    torch.testing.assert_close(as_tensor(single_ids)[0], as_tensor(ids)[0])

    cut = client.embeddings.create(model=model, input=TEXTS, dimensions=16)
    got = as_tensor(cut)
    assert got.shape == (len(TEXTS), 16)
    torch.testing.assert_close(got, F.normalize(as_tensor(many)[:, :16], dim=-1), rtol=1e-4, atol=1e-5)


def test_errors_are_openai_shaped(client, server):
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model=model, input="a dog", dimensions=100)
    with pytest.raises(openai.BadRequestError, match="input"):
        client.embeddings.create(model=model, input=[])
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="a dog")
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.embeddings.create(model=model, input="dog " * 600)
    r = httpx.post(server.url + "/v1/embeddings", json={"input": "dog " * 600, "truncate_prompt_tokens": 8})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 8
    with pytest.raises(openai.BadRequestError, match="/v1/embeddings") as info:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
    assert info.value.code == "unsupported_model"
    with pytest.raises(openai.BadRequestError, match="embeddings"):
        client.completions.create(model=model, prompt="hi")


def test_a_generation_server_refuses_embeddings(tmp_path):
    from tests.tiny_models import make_tiny_checkpoint

    llm = LLM(str(make_tiny_checkpoint(tmp_path)), skip_tokenizer_init=True, kv_cache_memory_bytes=4 << 20)
    with BackgroundServer(make_app(llm.engine, ServerOptions())) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="--runner pooling") as info:
            client.embeddings.create(model="tiny-qwen3", input=[[5, 6]])
        assert info.value.code == "unsupported_model"


def test_embeddings_through_the_engine_process(folder, client):
    """`overnight serve` steps its engine in a process of its own by default: pooled vectors cross the
    pipe packed (parallel/output_codec.py) and come out equal to the in-process server's."""
    llm = LLM(str(folder), runner="pooling", mode="server", max_num_batched_tokens=16, engine_process=True)
    try:
        with BackgroundServer(make_app(llm.engine, ServerOptions(), model_arg=str(folder))) as s:
            other = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)
            model = other.models.list().data[0].id
            got = as_tensor(other.embeddings.create(model=model, input=TEXTS, encoding_format="float"))
            with pytest.raises(openai.BadRequestError, match="dimensions"):
                other.embeddings.create(model=model, input="a dog", dimensions=100)
    finally:
        llm.engine.shutdown()
    ref_model = client.models.list().data[0].id
    want = as_tensor(client.embeddings.create(model=ref_model, input=TEXTS, encoding_format="float"))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
