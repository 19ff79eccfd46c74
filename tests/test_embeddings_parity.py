"""Embeddings against sentence-transformers on tiny random models, in fp32: a Qwen3 decoder saved as
sentence-transformers saves Qwen3-Embedding (through the main engine: chunked prefill, prefix cache,
preemption) and a BERT encoder (through the encoder engine), with each pooling and normalization on and
off. The reference is SentenceTransformer(folder).encode on the same texts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from overnight import LLM, PoolingParams
from overnight.errors import InvalidRequestError
from tests.tiny_embedders import TEXTS, make_tiny_embedder, reference_embeddings

pytestmark = pytest.mark.slow  # builds and runs sentence-transformers models

MODES = ("lasttoken", "mean", "cls")


def vectors(outs) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in outs])


def assert_same(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.shape == ref.shape
    cos = F.cosine_similarity(got, ref)
    assert cos.min() >= 0.9999, cos
    torch.testing.assert_close(got.norm(dim=-1), ref.norm(dim=-1), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "raw"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", ["qwen3", "bert"])
def test_embeddings_equal_sentence_transformers(tmp_path, family, mode, normalize):
    folder = make_tiny_embedder(tmp_path, family, mode, normalize=normalize)
    # A step budget of 8 tokens splits most decoder prompts over steps: pooling must carry across chunks.
    llm = LLM(str(folder), runner="pooling", max_num_batched_tokens=8, kv_cache_memory_bytes=4 << 20)
    assert_same(vectors(llm.embed(TEXTS, use_tqdm=False)), reference_embeddings(folder, TEXTS))
    norms = vectors(llm.embed(TEXTS[:2], use_tqdm=False)).norm(dim=-1)
    assert torch.allclose(norms, torch.ones(2)) == normalize


@pytest.mark.parametrize("family", ["qwen3", "bert"])
def test_truncation_matches_sentence_transformers_max_seq_length(tmp_path, family):
    folder = make_tiny_embedder(tmp_path, family, "mean")
    llm = LLM(str(folder), runner="pooling", max_model_len=64)
    long_text = " ".join(["the quick brown fox jumps over the lazy dog"] * 20)  # past max_model_len
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        llm.embed([long_text], use_tqdm=False)
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(folder), device="cpu")
    st.max_seq_length = 10
    ref = torch.as_tensor(st.encode([long_text, "a dog"]))
    out = llm.embed([long_text, "a dog"], truncate_prompt_tokens=10, use_tqdm=False)
    assert len(out[0].prompt_token_ids) == 10
    assert_same(vectors(out), ref)


def test_matryoshka_dimensions(tmp_path):
    folder = make_tiny_embedder(tmp_path, "qwen3", "lasttoken", is_matryoshka=True)
    llm = LLM(str(folder), runner="pooling")
    full = vectors(llm.embed(TEXTS, use_tqdm=False))
    cut = vectors(llm.embed(TEXTS, PoolingParams(dimensions=16), use_tqdm=False))
    assert cut.shape == (len(TEXTS), 16)
    torch.testing.assert_close(cut, F.normalize(full[:, :16], dim=-1))  # cut first, then normalized
    ref = reference_embeddings(folder, TEXTS, truncate_dim=16)  # sentence-transformers cuts last
    assert F.cosine_similarity(cut, ref).min() >= 0.9999
    raw = vectors(llm.embed(TEXTS, PoolingParams(dimensions=16, normalize=False), use_tqdm=False))
    assert not torch.allclose(raw.norm(dim=-1), torch.ones(len(TEXTS)))

    plain = make_tiny_embedder(tmp_path, "bert", "cls", name="plain")
    with pytest.raises(InvalidRequestError, match="Matryoshka"):
        LLM(str(plain)).embed(["a dog"], PoolingParams(dimensions=16), use_tqdm=False)


def test_prefix_cache_keeps_embeddings_exact(tmp_path):
    folder = make_tiny_embedder(tmp_path, "qwen3", "lasttoken")
    ref = reference_embeddings(folder, TEXTS)
    # No runner given: the folder holds a bare Qwen3Model (no LM head), which auto runs for pooling.
    llm = LLM(str(folder), block_size=4, max_num_batched_tokens=8)
    assert llm.engine.config.model.runner == "pooling"
    first = llm.encode(TEXTS, use_tqdm=False)
    assert_same(torch.stack([o.outputs.data for o in first]), ref)
    again = llm.encode(TEXTS, use_tqdm=False)
    assert max(o.num_cached_tokens for o in again) > 0  # equal prompts start past cached blocks
    assert_same(torch.stack([o.outputs.data for o in again]), ref)
