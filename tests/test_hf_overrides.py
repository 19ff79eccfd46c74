"""hf_overrides and heads made from tokens (loader/hf_overrides.py, models/for_pooling.py): a tiny random
Qwen3-Reranker (a plain Qwen3ForCausalLM folder) loaded as vLLM users load the published ones scores
exactly as transformers' causal LM does (sigmoid(logit_yes - logit_no) at the last token), offline, over
/v1/rerank and on a run-batch /v1/score line given the --hf-overrides flag; bad overrides are refused
with a message naming them."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from overnight import LLM, PoolingParams
from overnight.errors import ConfigError, ModelLoadError
from overnight.loader.hf_overrides import apply_hf_overrides
from overnight.options import EngineOptions, options_to_flags
from tests.batch_helpers import read_jsonl, run_cli, write_jsonl
from tests.tiny_classifiers import make_tiny_classifier
from tests.tiny_rerankers import (
    DOCS,
    QUERY,
    RERANKER_OVERRIDES,
    make_tiny_reranker,
    reference_scores,
    reference_token_logits,
)


def scores(outs) -> torch.Tensor:
    return torch.tensor([o.outputs.score for o in outs])


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    return make_tiny_reranker(tmp_path_factory.mktemp("rr"))


@pytest.mark.slow  # builds transformers models
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_scores_equal_the_causal_lm_yes_no(tmp_path, untied, tied):
    import transformers

    folder = make_tiny_reranker(tmp_path, tied=True) if tied else untied
    # A step budget of 8 tokens splits each pair over steps (the last chunk pools).
    llm = LLM(
        str(folder), device="cpu", runner="pooling", hf_overrides=RERANKER_OVERRIDES, max_num_batched_tokens=8
    )
    assert llm.engine.source.arch.num_labels == 1
    model = llm.engine.runner.model  # type: ignore[attr-defined]
    assert model.score.weight.shape == (1, 64) and model.score.weight.dtype == torch.float32
    assert not any("lm_head" in name for name, _ in model.named_parameters())  # only its one row kept
    outs = llm.score(QUERY, DOCS, use_tqdm=False)
    pairs = [(QUERY, d) for d in DOCS]
    ref = reference_scores(folder, pairs)
    torch.testing.assert_close(scores(outs), ref, rtol=0, atol=2e-6)
    assert scores(outs).std() > 1e-2  # the pairs score differently
    # A pair is its two texts written one after the other, tokenized once (vLLM's rule for these).
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    assert [o.prompt_token_ids for o in outs] == [tok(QUERY + d)["input_ids"] for d in DOCS]
    joined = llm.score("the quick bro", "wn fox", use_tqdm=False)[0]  # not two texts' ids end to end
    assert joined.prompt_token_ids == tok("the quick brown fox")["input_ids"]
    raw = llm.score(QUERY, DOCS, pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
    logits = reference_token_logits(folder, [QUERY + d for d in DOCS], ["no", "yes"])
    torch.testing.assert_close(scores(raw), logits[:, 1] - logits[:, 0], rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # builds a transformers model
def test_one_label_per_token_is_a_softmax_over_them(untied):
    """More than two tokens: a label per token, the class probabilities a softmax over their logits."""
    tokens = ["no", "maybe", "yes"]
    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": tokens}
    llm = LLM(str(untied), device="cpu", hf_overrides=overrides)  # runner auto: a sequence classifier pools
    texts = [QUERY + d for d in DOCS]
    outs = llm.classify(texts, use_tqdm=False)
    ref = torch.softmax(reference_token_logits(untied, texts, tokens), -1)
    torch.testing.assert_close(torch.tensor([o.outputs.probs for o in outs]), ref, rtol=0, atol=2e-6)
    assert llm.engine.config.model.pooler.classifier.labels == tuple(tokens)


def test_bad_overrides_are_refused_naming_them(tmp_path, untied):
    arch = {"architectures": ["Qwen3ForSequenceClassification"]}
    cases = [
        ({"f": print}, ConfigError, r"hf_overrides\['f'\] is a builtin_function_or_method"),
        ({"a": {"b": {1, 2}}}, ConfigError, r"hf_overrides\['a'\]\['b'\] is a set"),
        ("[1, 2]", ConfigError, "hf_overrides must be a JSON object"),
        (7, ConfigError, r"hf_overrides must be a JSON object \(a dict\), not 7"),
        (
            {**arch, "classifier_from_token": ["no", "perhaps"]},
            ConfigError,
            "'perhaps' is not in the vocabulary",
        ),
        (
            {**arch, "classifier_from_token": "yes"},
            ConfigError,
            "classifier_from_token must be a non-empty list",
        ),
        (
            {**RERANKER_OVERRIDES, "classifier_from_token": ["no", "maybe", "yes"]},
            ConfigError,
            "from_2_way_softmax .* takes two tokens",
        ),
        (
            {**arch, "classifier_from_token": ["yes"], "method": "argmax"},
            ConfigError,
            "unknown method 'argmax'",
        ),
        (
            {"classifier_from_token": ["no", "yes"]},
            ConfigError,
            'architecture is Qwen3ForCausalLM: add "architectures": \\["Qwen3ForSequenceClassification"\\]',
        ),
        # A classifier architecture alone over a causal-LM checkpoint: no score.weight to load.
        (arch, ModelLoadError, "no score.weight.*classifier_from_token"),
    ]
    for overrides, error, message in cases:
        with pytest.raises(error, match=message):
            LLM(str(untied), hf_overrides=overrides, runner="pooling")
    bert = make_tiny_classifier(tmp_path, "bert")
    with pytest.raises(ConfigError, match=r"BertForSequenceClassification \(an encoder\) has none"):
        LLM(str(bert), hf_overrides={"classifier_from_token": ["a"]})
    with pytest.raises(ConfigError, match="GGUF"):
        LLM("m.gguf", hf_overrides=RERANKER_OVERRIDES)


def test_merge_keeps_unknown_keys_and_merges_sub_configs():
    cfg = {
        "architectures": ["Qwen3ForCausalLM"],
        "text_config": {"a": 1, "b": 2},
        "rope_scaling": {"type": "linear", "factor": 2.0},
    }
    merged = apply_hf_overrides(cfg, {"text_config": {"b": 3}, "rope_scaling": {"factor": 4.0}, "mine": [1]})
    assert merged["text_config"] == {"a": 1, "b": 3}  # a sub-config: merged key by key
    assert merged["rope_scaling"] == {"factor": 4.0}  # a value: replaced, as vLLM sets it
    assert merged["mine"] == [1] and cfg["text_config"] == {"a": 1, "b": 2}  # kept; the input untouched
    head = apply_hf_overrides({"model_type": "qwen3"}, RERANKER_OVERRIDES)
    assert head["num_labels"] == 1 and head["id2label"] == {"0": "yes"}


def test_flag_takes_json_and_round_trips():
    pytest.importorskip("fastapi")  # the serve command's module builds the app (the `server` extra)
    from overnight.server import cli as server_cli

    parser = argparse.ArgumentParser()
    server_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--model", "m", "--hf-overrides", json.dumps(RERANKER_OVERRIDES)])
    opts = server_cli.engine_options(args)
    assert opts.hf_overrides == RERANKER_OVERRIDES
    flags = options_to_flags(opts)
    again = parser.parse_args(["serve", *flags])
    assert server_cli.engine_options(again).hf_overrides == RERANKER_OVERRIDES
    with pytest.raises(ConfigError, match="hf_overrides must be a JSON object"):
        server_cli.engine_options(parser.parse_args(["serve", "--hf-overrides", "{nope"]))


@pytest.mark.slow  # serves a model over HTTP, runs run-batch
def test_rerank_route_and_run_batch_score_line(tmp_path, untied):
    pytest.importorskip("fastapi")  # the server's packages (the `server` extra)
    pytest.importorskip("uvicorn")
    httpx = pytest.importorskip("httpx")
    from overnight.build import build_engine
    from overnight.server.background import BackgroundServer
    from overnight.server.cli import ServerOptions, make_app

    ref = reference_scores(untied, [(QUERY, d) for d in DOCS]).tolist()
    engine = build_engine(
        EngineOptions(model=str(untied), hf_overrides=RERANKER_OVERRIDES, mode="server", device="cpu")
    )
    try:
        with BackgroundServer(make_app(engine, ServerOptions(), model_arg=str(untied))) as s:
            r = httpx.post(s.url + "/v1/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 2})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == sorted(range(len(DOCS)), key=lambda i: -ref[i])[:2]
        assert all(abs(x["relevance_score"] - ref[x["index"]]) < 2e-6 for x in results)
    finally:
        engine.shutdown()

    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    body = {"model": "rr", "text_1": QUERY, "text_2": DOCS}
    write_jsonl(inp, [{"custom_id": "s", "method": "POST", "url": "/v1/score", "body": body}])
    flags = ["--model", str(untied), "--served-model-name", "rr", "--device", "cpu", "--no-progress"]
    flags += ["--hf-overrides", json.dumps(RERANKER_OVERRIDES)]
    assert run_cli(["-i", str(inp), "-o", str(out), *flags]) == 0
    data = read_jsonl(out)[0]["response"]["body"]["data"]
    got = torch.tensor([d["score"] for d in sorted(data, key=lambda d: d["index"])])
    torch.testing.assert_close(got, torch.tensor(ref), rtol=0, atol=2e-6)
