"""Scores and classes against transformers and sentence-transformers on tiny random models, in fp32:
a BERT cross-encoder (token types from the pair), an XLM-R reranker (positions past the padding id, the
dense + tanh + out_proj head) and a Qwen3 sequence classifier (last token, through the main engine with
chunked prefill). References: transformers' ...ForSequenceClassification run one pair at a time, and
sentence-transformers' CrossEncoder.predict."""

from __future__ import annotations

import pytest
import torch

from overnight import LLM, PoolingParams
from overnight.errors import ConfigError, InvalidRequestError
from tests.tiny_classifiers import DOCS, KINDS, QUERY, make_tiny_classifier, reference_logits

pytestmark = pytest.mark.slow  # builds transformers and sentence-transformers models


def scores(outs) -> torch.Tensor:
    return torch.tensor([o.outputs.score for o in outs])


@pytest.mark.parametrize("kind", KINDS)
def test_scores_equal_transformers_and_cross_encoder(tmp_path, kind):
    folder = make_tiny_classifier(tmp_path, kind)
    # A step budget of 8 tokens splits the decoder's pairs over steps (the last chunk pools).
    llm = LLM(str(folder), device="cpu", max_num_batched_tokens=8 if kind == "qwen3" else None)
    assert llm.engine.config.model.runner == "pooling"
    pairs = [(QUERY, d) for d in DOCS]
    ref = torch.sigmoid(reference_logits(folder, pairs)[:, 0])
    one_to_many = scores(llm.score(QUERY, DOCS, use_tqdm=False))
    torch.testing.assert_close(one_to_many, ref, rtol=0, atol=2e-6)
    assert one_to_many.std() > 1e-3  # the pairs score differently: a mixed-up batch would show
    # Pairwise lists of mixed lengths, in another order: each pair's score is its own.
    firsts = [d for d in reversed(DOCS)]
    seconds = [QUERY + " " + d for d in DOCS]
    pairwise = scores(llm.score(firsts, seconds, use_tqdm=False))
    ref2 = torch.sigmoid(reference_logits(folder, list(zip(firsts, seconds)))[:, 0])
    torch.testing.assert_close(pairwise, ref2, rtol=0, atol=2e-6)
    if kind != "qwen3":  # CrossEncoder pads a batch; the encoders are where it applies
        CrossEncoder = pytest.importorskip("sentence_transformers").CrossEncoder

        predicted = CrossEncoder(str(folder), device="cpu").predict(pairs)
        torch.testing.assert_close(one_to_many, torch.as_tensor(predicted), rtol=0, atol=2e-6)
    streamed = dict(llm.score_stream(list(zip(firsts, seconds)), use_tqdm=False))
    torch.testing.assert_close(scores([streamed[i] for i in range(len(DOCS))]), pairwise)


def test_checkpoint_activation_and_raw_logits(tmp_path):
    """ms-marco cross-encoders declare Identity: the score is the logit, as CrossEncoder.predict says."""
    CrossEncoder = pytest.importorskip("sentence_transformers").CrossEncoder

    identity = {"activation_fn": "torch.nn.modules.linear.Identity"}
    folder = make_tiny_classifier(tmp_path, "bert", sentence_transformers=identity)
    llm = LLM(str(folder), device="cpu")
    got = scores(llm.score(QUERY, DOCS, use_tqdm=False))
    pairs = [(QUERY, d) for d in DOCS]
    torch.testing.assert_close(got, reference_logits(folder, pairs)[:, 0], rtol=0, atol=2e-6)
    predicted = CrossEncoder(str(folder), device="cpu").predict(pairs)
    torch.testing.assert_close(got, torch.as_tensor(predicted), rtol=0, atol=2e-6)
    sigmoid = make_tiny_classifier(tmp_path / "s", "xlmr")
    raw = LLM(str(sigmoid), device="cpu").score(
        QUERY, DOCS, pooling_params=PoolingParams(use_activation=False), use_tqdm=False
    )
    torch.testing.assert_close(scores(raw), reference_logits(sigmoid, pairs)[:, 0], rtol=0, atol=2e-6)


@pytest.mark.parametrize("kind", ["bert", "qwen3"])
def test_classify_probabilities(tmp_path, kind):
    folder = make_tiny_classifier(tmp_path, kind, num_labels=3)
    llm = LLM(str(folder), device="cpu")
    texts = [QUERY, *DOCS]
    outs = llm.classify(texts, use_tqdm=False)
    probs = torch.tensor([o.outputs.probs for o in outs])
    assert all(o.outputs.num_classes == 3 for o in outs)
    torch.testing.assert_close(probs, torch.softmax(reference_logits(folder, texts), -1), rtol=0, atol=2e-6)
    with pytest.raises(InvalidRequestError, match="one label"):
        llm.score(QUERY, DOCS, use_tqdm=False)
    streamed = dict(llm.classify_stream(iter(texts), use_tqdm=False))
    assert sorted(streamed) == list(range(len(texts)))
    # each text's own probabilities; the stream batches the texts otherwise, and a CPU BLAS may round a
    # row by an ulp differently with its place in the batch, so to rounding rather than bit for bit
    streamed_probs = torch.tensor([streamed[i].outputs.probs for i in range(len(texts))])
    torch.testing.assert_close(streamed_probs, probs, rtol=0, atol=2e-6)


def test_truncation_cuts_the_longer_text_first(tmp_path):
    import transformers

    folder = make_tiny_classifier(tmp_path, "bert")
    llm = LLM(str(folder), device="cpu")
    long_doc = " ".join(["the quick brown fox jumps over the lazy dog"] * 10)  # past 64 positions
    with pytest.raises(InvalidRequestError, match="pair 0: .*maximum context length"):
        llm.score(QUERY, [long_doc], use_tqdm=False)
    out = llm.score(QUERY, [long_doc], truncate_prompt_tokens=20, use_tqdm=False)[0]
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    enc = tok(QUERY, long_doc, truncation="longest_first", max_length=20)
    assert out.prompt_token_ids == enc["input_ids"]
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        folder, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        ref = torch.sigmoid(model(**{k: torch.tensor([v]) for k, v in enc.items()}).logits[0, 0])
    assert abs(out.outputs.score - ref.item()) < 2e-6


def test_wrong_kind_of_model_is_refused(tmp_path):
    from tests.tiny_embedders import make_tiny_embedder

    folder = make_tiny_classifier(tmp_path, "bert")
    with pytest.raises(ConfigError, match="sequence classifier .* cannot generate text"):
        LLM(str(folder), runner="generate")
    classifier = LLM(str(folder))
    with pytest.raises(InvalidRequestError, match="does not generate|not generate"):
        classifier.generate(["a dog"], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="sequence classifier .* not embeddings"):
        classifier.embed(["a dog"], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="text_1 has 2 texts and text_2 has 3"):
        classifier.score(["a", "b"], ["c", "d", "e"], use_tqdm=False)

    embedder = LLM(str(make_tiny_embedder(tmp_path, "bert", "cls")))
    with pytest.raises(InvalidRequestError, match="no classification head"):
        embedder.classify(DOCS, use_tqdm=False)

    from tests.tiny_models import make_tiny_checkpoint

    generator = LLM(
        str(make_tiny_checkpoint(tmp_path)), skip_tokenizer_init=True, kv_cache_memory_bytes=4 << 20
    )
    for call in (lambda: generator.score("a", ["b"]), lambda: generator.classify([[5, 6]])):
        with pytest.raises(
            InvalidRequestError, match=r"tiny-qwen3' runs to generate text \(runner 'generate'\)"
        ):
            call()


def test_an_embedding_model_scores_by_cosine_similarity(tmp_path):
    """As vLLM's score with an embedding model: the cosine similarity of the two texts' embeddings."""
    import torch.nn.functional as F

    from tests.tiny_embedders import make_tiny_embedder, reference_embeddings

    folder = make_tiny_embedder(tmp_path, "bert", "mean", normalize=False)
    llm = LLM(str(folder), device="cpu")
    ref_query, ref_docs = reference_embeddings(folder, [QUERY]), reference_embeddings(folder, DOCS)
    want = F.cosine_similarity(ref_query, ref_docs)
    got = scores(llm.score(QUERY, DOCS, use_tqdm=False))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert got.std() > 1e-3
    pairs = [(d, QUERY) for d in DOCS] + [(DOCS[0], DOCS[1])]
    streamed = dict(llm.score_stream(pairs, use_tqdm=False))
    torch.testing.assert_close(scores([streamed[i] for i in range(len(DOCS))]), want, rtol=0, atol=1e-5)
    last = streamed[len(DOCS)].outputs.score
    assert abs(last - F.cosine_similarity(ref_docs[:1], ref_docs[1:2]).item()) < 1e-5


def test_xlm_roberta_model_embeds(tmp_path):
    """A bare XLMRobertaModel (bge-m3's shape) embeds too: RoBERTa's positions, the CLS token."""
    import transformers

    from tests.tiny_classifiers import _spread, _xlmr_tokenizer

    tokenizer = _xlmr_tokenizer()
    cfg = transformers.XLMRobertaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=66,
        type_vocab_size=1,
        layer_norm_eps=1e-5,
        pad_token_id=1,
    )
    model = transformers.XLMRobertaModel(cfg, add_pooling_layer=False).eval()
    _spread(model, 0)
    model.save_pretrained(tmp_path / "xlmr")
    tokenizer.save_pretrained(tmp_path / "xlmr")
    got = LLM(str(tmp_path / "xlmr"), device="cpu").embed(
        DOCS, pooling_params=PoolingParams(normalize=False), use_tqdm=False
    )
    with torch.no_grad():
        ref = [model(**tokenizer(d, return_tensors="pt")).last_hidden_state[0, 0] for d in DOCS]
    torch.testing.assert_close(
        torch.tensor([o.outputs.embedding for o in got]), torch.stack(ref), atol=2e-5, rtol=0
    )


def test_a_decoder_reranker_reuses_the_query_prefix(tmp_path):
    """Pairs of one query share its tokens: a decoder classifier (last-token pooling) starts past the
    query's cached KV blocks, and scores stay exact."""
    folder = make_tiny_classifier(tmp_path, "qwen3")
    llm = LLM(str(folder), device="cpu", block_size=4)
    query = QUERY + " " + " ".join(["search query document"] * 4)
    ids = llm.get_tokenizer().encode_pairs([query] * len(DOCS), DOCS)
    outs = llm.encode([{"prompt_token_ids": i} for i in ids], PoolingParams(task="score"), use_tqdm=False)
    assert max(o.num_cached_tokens for o in outs) >= 16
    got = torch.stack([o.outputs.data[0] for o in outs])
    ref = torch.sigmoid(reference_logits(folder, [(query, d) for d in DOCS])[:, 0])
    torch.testing.assert_close(got, ref, rtol=0, atol=2e-6)
