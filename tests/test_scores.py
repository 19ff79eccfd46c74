"""The parts of scoring that need no model: which pairs a request names, BERT's pair token types, the
classifier head's activations, the classifier config read from config.json, the task checks, and the
response bodies (rerank's order and top_n, classify's labels)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from overnight.config import ClassifierConfig, PoolerConfig
from overnight.encoder.runner import pair_token_types
from overnight.engine.validation import RequestLimits, validate_request
from overnight.entrypoints.pooling_prompts import score_pairs
from overnight.errors import ConfigError, InvalidRequestError, ModelLoadError
from overnight.layers.pooler import classifier_head
from overnight.outputs import PoolingOutput, PoolingRequestOutput
from overnight.pooling_params import PoolingParams


def test_score_pairs():
    assert score_pairs("q", ["a", "b"]) == [("q", "a"), ("q", "b")]
    assert score_pairs(["q"], "a") == [("q", "a")]
    assert score_pairs(["q1", "q2"], ["a", "b"]) == [("q1", "a"), ("q2", "b")]
    with pytest.raises(InvalidRequestError, match="text_1 has 2 texts and text_2 has 3"):
        score_pairs(["a", "b"], ["c", "d", "e"])
    with pytest.raises(InvalidRequestError, match="text_2 is empty"):
        score_pairs("q", [])
    with pytest.raises(InvalidRequestError, match=r"text_2\[1\] is not a string"):
        score_pairs("q", ["a", [1, 2]])  # type: ignore[list-item]


def test_pair_token_types_follow_the_first_sep():
    sep = 3
    prompts = [
        [2, 10, 11, 3, 20, 21, 3],  # scored: [CLS] a a [SEP] b b [SEP]
        [2, 12, 3],  # an embedding prompt: one segment, its [SEP] changes nothing
        [2, 13, 3, 3, 22, 3],  # scored, an empty first text: type 1 from the second [SEP] on
        [2, 14, 15],  # scored, but no [SEP] (token ids given as such): one segment
    ]
    lens = np.array([len(p) for p in prompts])
    ids = np.concatenate([np.array(p) for p in prompts])
    positions = np.concatenate([np.arange(n) for n in lens])
    types = pair_token_types(ids, lens, positions, np.array([True, False, True, True]), sep)
    want = [0, 0, 0, 0, 1, 1, 1] + [0, 0, 0] + [0, 0, 0, 1, 1, 1] + [0, 0, 0]
    assert types.tolist() == want


def test_classifier_head_activations():
    logits = torch.tensor([[0.5, -1.0, 2.0], [1.0, 0.0, -3.0]])
    torch.testing.assert_close(classifier_head(logits, "softmax", [True, True]), logits.softmax(-1))
    torch.testing.assert_close(classifier_head(logits, "sigmoid", [True, True]), logits.sigmoid())
    mixed = classifier_head(logits, "softmax", [False, True])
    torch.testing.assert_close(mixed[0], logits[0])
    torch.testing.assert_close(mixed[1], logits[1].softmax(-1))
    assert classifier_head(logits, "none", [True, True]) is logits


def _classifier_source(tmp_path, arch: str, **config):
    from overnight.loader.resolve import resolve_source

    cfg = {
        "architectures": [arch],
        "model_type": "bert",
        "vocab_size": 32,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "max_position_embeddings": 16,
        **config,
    }
    folder = tmp_path / f"m{len(list(tmp_path.iterdir()))}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    return resolve_source(str(folder), "dummy")


def test_classifier_config_from_the_checkpoint(tmp_path):
    from overnight.loader.pooling_config import read_pooler_config

    def classifier(**config) -> ClassifierConfig:
        pooler = read_pooler_config(_classifier_source(tmp_path, "BertForSequenceClassification", **config))
        assert pooler.pooling_type == "CLS" and pooler.classifier is not None
        return pooler.classifier

    assert classifier(num_labels=1) == ClassifierConfig(1, "sigmoid", ("LABEL_0",))
    three = classifier(id2label={"0": "neg", "1": "neutral", "2": "pos"})
    assert three == ClassifierConfig(3, "softmax", ("neg", "neutral", "pos"))
    identity = {"activation_fn": "torch.nn.modules.linear.Identity"}
    assert classifier(num_labels=1, sentence_transformers=identity).activation == "none"
    legacy = {"sbert_ce_default_activation_function": "torch.nn.modules.activation.Sigmoid"}
    assert classifier(num_labels=2, **legacy).activation == "sigmoid"
    with pytest.raises(ModelLoadError, match="activation 'my.Tanh' is not supported"):
        classifier(num_labels=1, sentence_transformers={"activation_fn": "my.Tanh"})
    source = _classifier_source(tmp_path, "BertForSequenceClassification", num_labels=1)
    with pytest.raises(ConfigError, match="reads its first token: pooling_type MEAN"):
        read_pooler_config(source, "MEAN")
    assert _classifier_source(tmp_path, "BertModel").arch.num_labels == 0


def test_the_engine_refuses_a_task_the_model_cannot_do():
    embedder = RequestLimits(64, 100, True, pooler=PoolerConfig("CLS", True), hidden_size=16)
    scorer = PoolerConfig("CLS", False, classifier=ClassifierConfig(1, "sigmoid", ("LABEL_0",)))
    cross_encoder = RequestLimits(64, 100, True, pooler=scorer, hidden_size=16)
    three = PoolerConfig("LAST", False, classifier=ClassifierConfig(3, "softmax", ("a", "b", "c")))
    classifier = RequestLimits(64, 100, True, pooler=three, hidden_size=16)
    ids = [1, 2, 3]
    validate_request(ids, PoolingParams(task="embed"), embedder)
    validate_request(ids, PoolingParams(task="score"), cross_encoder)
    validate_request(ids, PoolingParams(task="classify"), classifier)
    validate_request(ids, PoolingParams(), classifier)  # LLM.encode: whatever the model pools
    cases = [
        (PoolingParams(task="score"), embedder, "no classification head"),
        (PoolingParams(task="embed"), cross_encoder, "not embeddings"),
        (PoolingParams(task="score"), classifier, "one label"),
        (PoolingParams(task="classify", dimensions=8), classifier, "apply to embeddings"),
    ]
    for params, limits, message in cases:
        with pytest.raises(InvalidRequestError, match=message):
            validate_request(ids, params, limits)
    with pytest.raises(InvalidRequestError, match="task must be one of"):
        PoolingParams(task="rerank")


def _outputs(values: list[list[float]]) -> list[PoolingRequestOutput]:
    return [
        PoolingRequestOutput(str(i), None, [1, 2, 3], PoolingOutput(torch.tensor(v)))
        for i, v in enumerate(values)
    ]


def test_response_bodies():
    from overnight.openai_api.scores import (
        ClassificationRequest,
        RerankRequest,
        ScoreRequest,
        scoring_response,
    )

    outs = _outputs([[0.1], [0.9], [0.5]])
    rerank = RerankRequest(query="q", documents=["a", {"text": "b"}, "c"], top_n=2)
    body = scoring_response(rerank, outs, "m", response_id="rerank-1")
    assert body["id"] == "rerank-1" and body["usage"] == {"prompt_tokens": 9, "total_tokens": 9}
    assert [(r["index"], r["document"]["text"]) for r in body["results"]] == [(1, "b"), (2, "c")]
    assert body["results"][0]["relevance_score"] == pytest.approx(0.9)
    score = scoring_response(ScoreRequest(text_1="q", text_2=["a", "b", "c"]), outs, "m")
    assert [d["object"] for d in score["data"]] == ["score"] * 3 and score["object"] == "list"
    probs = _outputs([[0.2, 0.8], [0.7, 0.3]])
    classes = scoring_response(ClassificationRequest(input=["x", "y"]), probs, "m", ("neg", "pos"))
    assert [(d["label"], d["num_classes"]) for d in classes["data"]] == [("pos", 2), ("neg", 2)]
    # An embedding model's score: the cosine of two of the outputs.
    vectors = _outputs([[1.0, 0.0], [1.0, 1.0], [0.0, 2.0]])
    cos = scoring_response(ScoreRequest(text_1="q", text_2=["a", "b"]), vectors, "m", pairs=[(0, 1), (0, 2)])
    assert [d["score"] for d in cos["data"]] == pytest.approx([2**-0.5, 0.0], abs=1e-6)


def test_score_bodies_take_vllms_names():
    import overnight.openai_api  # noqa: F401  (registers the scoring routes)
    from overnight.openai_api.errors import ApiError
    from overnight.openai_api.protocol import parse_request

    for first, second in (("text_1", "text_2"), ("data_1", "data_2"), ("queries", "documents")):
        body = parse_request("/v1/score", {first: "q", second: ["a", "b"], "activation": False})
        assert body.pairs() == [("q", "a"), ("q", "b")] and body.use_activation is False
    with pytest.raises(ApiError, match="text_2: field required"):
        parse_request("/v1/score", {"text_1": "q"})
    with pytest.raises(ApiError, match="documents: not supported"):  # still refused where undeclared
        parse_request("/v1/completions", {"prompt": "q", "documents": ["a"]})
