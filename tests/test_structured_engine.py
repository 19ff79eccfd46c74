"""Structured outputs through the whole engine on the embedded SmolLM2 (CPU, fp32): every kind holds and
ends with EOS, max_tokens and stop strings still cut, n > 1 children each follow the grammar, logprobs
are of the raw distribution, prefix caching and batching change nothing, preemption keeps each matcher in
step, and bad specs fail their own prompt only."""

from __future__ import annotations

import json
import re

import pytest

from overnight import LLM, SamplingParams, StructuredOutputsParams
from overnight.errors import InvalidRequestError
from tests.structured_schemas import SCHEMAS, assert_valid

pytestmark = pytest.mark.slow  # runs the real model

MAX_MODEL_LEN = 256
# SmolLM2-135M keeps 46080 bytes of fp32 KV per token: 24 blocks of 16 (384 tokens) hold about four of
# the requests below at once, so eight of them must preempt.
KV_BYTES_PER_BLOCK = 16 * 46080


def so(**kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kw)


def ask(what: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": what}]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=400 * KV_BYTES_PER_BLOCK)


def test_each_kind_holds_and_ends_with_eos(llm):
    greedy = dict(temperature=0.0, max_tokens=80)
    grammar = 'root ::= "The answer is " ("yes" | "no") "."'
    cases = [
        (ask("Describe a person as JSON."), so(json=SCHEMAS["person"])),
        (ask("What is your phone number?"), so(regex=r"\+1 \d{3}-\d{4}")),
        (ask("Is the sea salty?"), so(choice=["yes", "no", "it depends"])),
        (ask("Is the sea salty?"), so(grammar=grammar)),
        (ask("Give me a JSON object with a name and an age."), so(json_object=True)),
        (ask("Describe a person as pretty JSON."), so(json=SCHEMAS["person"], disable_any_whitespace=False)),
    ]
    outs = llm.chat(
        [c for c, _ in cases],
        [SamplingParams(**greedy, structured_outputs=s) for _, s in cases],
        use_tqdm=False,
    )
    texts = [o.outputs[0].text for o in outs]
    assert_valid(texts[0], SCHEMAS["person"])
    assert re.fullmatch(r"\+1 \d{3}-\d{4}", texts[1])
    assert texts[2] in ("yes", "no", "it depends")
    assert re.fullmatch(r"The answer is (yes|no)\.", texts[3])
    assert isinstance(assert_valid(texts[4], {"type": "object"}), dict)
    assert_valid(texts[5], SCHEMAS["person"])
    for o in outs:  # the grammar's end allows only EOS, which ends the request
        assert o.outputs[0].finish_reason == "stop" and o.outputs[0].stop_reason is None
    # Compact by default: exactly the separators json.dumps writes, no other whitespace.
    assert json.dumps(json.loads(texts[0]), ensure_ascii=False) == texts[0]


def test_max_tokens_still_cuts(llm):
    out = llm.chat(
        ask("Describe a person as JSON."),
        SamplingParams(temperature=0.0, max_tokens=5, structured_outputs=so(json=SCHEMAS["person"])),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert out.text.startswith('{"name": "')


def test_n_children_each_follow_the_grammar(llm):
    params = SamplingParams(
        n=4, temperature=1.0, seed=11, max_tokens=100, structured_outputs=so(json=SCHEMAS["event"])
    )
    outs = llm.chat(ask("Plan an event as JSON."), params, use_tqdm=False)[0].outputs
    assert len(outs) == 4
    for c in outs:
        assert_valid(c.text, SCHEMAS["event"])
        assert c.finish_reason == "stop"
    assert len({c.text for c in outs}) >= 2  # each child drew its own tokens through its own matcher


def test_stop_strings_cut_structured_text(llm):
    conv = ask("Describe a person as JSON.")
    full = llm.chat(
        conv,
        SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=so(json=SCHEMAS["person"])),
        use_tqdm=False,
    )[0].outputs[0]
    stop = '"age"'
    cut = llm.chat(
        conv,
        SamplingParams(
            temperature=0.0, max_tokens=80, stop=[stop], structured_outputs=so(json=SCHEMAS["person"])
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert cut.text == full.text[: full.text.index(stop)]
    assert (cut.finish_reason, cut.stop_reason) == ("stop", stop)


def test_logprobs_are_of_the_raw_distribution(llm):
    """A forced answer the model would not pick itself: under a masked distribution every sampled token
    would have logprob 0 and rank 1; the raw one ranks it lower somewhere and sums to less."""
    forced = "Zebra-7734 kumquat"
    out = llm.chat(
        ask("Say hello."),
        SamplingParams(temperature=0.0, max_tokens=30, logprobs=3, structured_outputs=so(choice=[forced])),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.text == forced
    assert len(out.logprobs) == len(out.token_ids)
    ranks = [step[t].rank for step, t in zip(out.logprobs, out.token_ids)]
    assert max(ranks) > 1
    total = sum(step[t].logprob for step, t in zip(out.logprobs, out.token_ids))
    assert total < -5 and abs(total - out.cumulative_logprob) < 1e-4
    for step in out.logprobs:  # the top-3 of the raw distribution are reported, allowed or not
        assert sum(1 for lp in step.values() if lp.rank <= 3) == 3


def test_batching_and_prefix_cache_change_nothing(llm):
    conv = ask("Review a restaurant as JSON.")
    params = SamplingParams(temperature=0.0, max_tokens=90, structured_outputs=so(json=SCHEMAS["review"]))
    alone = llm.chat(conv, params, use_tqdm=False)[0]
    others = [ask(f"Review hotel number {i} as JSON.") for i in range(3)]
    together = llm.chat(others[:2] + [conv] + others[2:], params, use_tqdm=False)
    again = llm.chat(conv, params, use_tqdm=False)[0]
    assert together[2].outputs[0].token_ids == alone.outputs[0].token_ids
    assert again.outputs[0].token_ids == alone.outputs[0].token_ids
    assert again.num_cached_tokens > 0  # the prompt's blocks came from the prefix cache
    for o in together:
        assert_valid(o.outputs[0].text, SCHEMAS["review"])


def test_preemption_keeps_each_matcher_in_step(llm):
    convs = [ask(f"Describe person number {i} as JSON.") for i in range(8)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=90, structured_outputs=so(json=SCHEMAS["person"])),
        SamplingParams(temperature=0.9, seed=5, max_tokens=90, structured_outputs=so(json=SCHEMAS["event"])),
    ] * 4
    roomy = llm.chat(convs, params, use_tqdm=False)
    small = LLM(dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=24 * KV_BYTES_PER_BLOCK)
    tight = small.chat(convs, params, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions_total > 0
    for a, b, p in zip(roomy, tight, params):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        name = "person" if p.temperature == 0 else "event"
        assert_valid(b.outputs[0].text, SCHEMAS[name])


def test_bad_specs_fail_their_prompt_before_anything_runs(llm):
    ok = SamplingParams(max_tokens=4, structured_outputs=so(regex="[a-z]+"))
    bad = {
        "regex cannot be compiled": so(regex="[a-z"),
        "JSON schema cannot be compiled": so(json={"type": "object", "properties": {"a": {"type": "nope"}}}),
        "'uniqueItems' at /properties/tags": so(json={"properties": {"tags": {"uniqueItems": True}}}),
        "grammar cannot be compiled": so(grammar="root ::= "),
    }
    for words, spec in bad.items():
        with pytest.raises(InvalidRequestError, match=f"^prompt 2: .*{re.escape(words)}"):
            llm.generate(
                ["a", "b", "c"],
                [ok, ok, SamplingParams(max_tokens=4, structured_outputs=spec)],
                use_tqdm=False,
            )
        assert not llm.engine.has_unfinished_requests()
    with pytest.raises(InvalidRequestError, match="exactly one"):
        so(regex="a", choice=["a"])
    with pytest.raises(InvalidRequestError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs=so(regex="a"))
