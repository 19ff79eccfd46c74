"""logit_bias, allowed_token_ids, bad_words on synthetic logits (the batched edits against a per-row
reference), best_of / truncate_prompt_tokens in SamplingParams and the engine (fake runner)."""

from __future__ import annotations

import pytest
import torch

from overnight.errors import InvalidRequestError
from overnight.runner.logits_processors import banned_now, build_logits_edits
from overnight.sampling_params import SamplingParams
from tests.engine_helpers import EOS, VOCAB, V, make_engine, req, run_all, sample
from tests.fake_runner import reference_output


def edited_ref(logits: torch.Tensor, params: SamplingParams, output: list[int]) -> torch.Tensor:
    """One row's edits written the plain way."""
    row = logits.clone().float()
    if params.allowed_token_ids:
        keep = torch.full_like(row, float("-inf"))
        keep[params.allowed_token_ids] = 0.0
        row = row + keep
    for tid, bias in (params.logit_bias or {}).items():
        row[tid] += bias
    for word in params.bad_words_token_ids:
        if len(word) == 1 or output[-(len(word) - 1) :] == word[:-1]:
            row[word[-1]] = float("-inf")
    return row


def with_words(params: SamplingParams, words: list[list[int]]) -> SamplingParams:
    params.bad_words_token_ids = words
    return params


def test_edits_match_the_per_row_reference():
    torch.manual_seed(0)
    logits = torch.randn(5, V)
    rows = [
        (SamplingParams(logit_bias={3: 5.0, 7: -100.0}), []),
        (SamplingParams(), []),
        (SamplingParams(allowed_token_ids=[1, 9, 30], logit_bias={9: 2.0}), []),
        (with_words(SamplingParams(), [[4], [10, 11], [12, 13, 14]]), [2, 10]),  # bans 4 and 11, not 14
        (with_words(SamplingParams(), [[12, 13, 14]]), [12, 13]),  # bans 14
    ]
    reqs = [req(p, output=out) for p, out in rows]
    edits = build_logits_edits(reqs, torch.device("cpu"))
    assert edits is not None
    got = logits.clone()
    edits.apply(got)
    for i, (p, out) in enumerate(rows):
        assert torch.equal(got[i], edited_ref(logits[i], p, out)), i
    assert got[3, 4] == float("-inf") and got[3, 11] == float("-inf") and got[3, 14] != float("-inf")
    assert got[4, 14] == float("-inf")
    assert build_logits_edits([req(SamplingParams())], torch.device("cpu")) is None  # nothing to do


def test_banned_now():
    assert banned_now([[5]], []) == [5]
    assert banned_now([[1, 2]], [7, 1]) == [2]
    assert banned_now([[1, 2]], [1, 7]) == []
    assert banned_now([[1, 2, 3]], [2]) == []


def test_sampler_obeys_the_edits_greedy_and_sampled():
    torch.manual_seed(1)
    logits = torch.randn(4, V)
    top = int(logits[0].argmax())
    params = [
        SamplingParams(temperature=0, logit_bias={top: -100.0}),
        SamplingParams(temperature=0, allowed_token_ids=[5, 6]),
        SamplingParams(temperature=1.0, allowed_token_ids=[8], seed=3),
        SamplingParams(temperature=0, logprobs=2, logit_bias={17: 100.0}),
    ]
    tokens, lps = sample(logits, [req(p, seed=i) for i, p in enumerate(params)])
    assert int(tokens[0]) != top
    assert int(tokens[1]) in (5, 6) and int(tokens[1]) == 5 + int(logits[1, 6] > logits[1, 5])
    assert int(tokens[2]) == 8
    assert int(tokens[3]) == 17
    # Logprobs stay those of the model's own distribution: the bias moved the draw, not the numbers.
    raw = logits[3].log_softmax(-1)
    assert lps is not None and lps[3] is not None
    assert abs(lps[3].sampled_logprob - float(raw[17])) < 1e-5


def test_new_params_are_validated():
    SamplingParams(best_of=3, n=2, logit_bias={1: -2.5}, allowed_token_ids=[1], bad_words=["x"])
    for bad in (
        dict(n=3, best_of=2),
        dict(logit_bias={"1": 1.0}),
        dict(logit_bias={-1: 1.0}),
        dict(allowed_token_ids=[]),
        dict(allowed_token_ids=[True]),
        dict(bad_words=["  "]),
        dict(prompt_logprobs=21),
        dict(truncate_prompt_tokens=0),
        dict(truncate_prompt_tokens=-2),
    ):
        with pytest.raises(InvalidRequestError):
            SamplingParams(**bad)


def test_sampled_logprobs_for_best_of():
    assert SamplingParams().sampled_logprobs is None
    assert SamplingParams(n=2, best_of=4).sampled_logprobs == 0  # cumulative logprobs to choose by
    assert SamplingParams(n=2, best_of=2).sampled_logprobs is None
    assert SamplingParams(best_of=3, logprobs=4).sampled_logprobs == 4


def test_bad_words_are_tokenized_as_written_and_after_a_space():
    class Tok:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [ord(c) for c in text]

    p = SamplingParams(bad_words=["ab", " ab"]).with_bad_words_tokenized(Tok())
    assert p.bad_words_token_ids == [[97, 98], [32, 97, 98]]
    assert p.needs_output_history and p.has_logits_edits
    assert SamplingParams().with_bad_words_tokenized(Tok()).bad_words_token_ids == []


def test_truncate_prompt_tokens_keeps_the_tail_in_the_engine():
    engine, _ = make_engine(max_model_len=64)
    prompt = list(range(10, 90))  # longer than max_model_len: served only because it is truncated
    engine.add_request("t", prompt, SamplingParams(max_tokens=4, ignore_eos=True, truncate_prompt_tokens=20))
    engine.add_request(
        "m", prompt[:50], SamplingParams(max_tokens=4, ignore_eos=True, truncate_prompt_tokens=-1)
    )
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
    assert outs["t"].prompt_token_ids == prompt[-20:]
    assert outs["t"].outputs[0].token_ids == reference_output(prompt[-20:], 4, VOCAB, EOS)
    assert outs["m"].prompt_token_ids == prompt[:50]  # -1: what fits (63 tokens) keeps all 50
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        engine.add_request("long", prompt, SamplingParams(max_tokens=4))


def test_best_of_cannot_stream():
    engine, _ = make_engine()
    with pytest.raises(InvalidRequestError, match="best_of"):
        engine.add_request("s", [5, 6], SamplingParams(n=1, best_of=2), stream=True)
    run_all(engine)
