"""Structured outputs without a model: the params, the schema keyword check, the grammar compiler and its
cache, the token-mask kernel against its reference, the runner's matchers (catch-up, resume, n > 1),
the OpenAI body fields, and the synthetic tokenizer. The vocabulary is the synthetic byte-level BPE
(overnight/tokenizer/synthetic.py) at a few hundred ids."""

from __future__ import annotations

import json
import pickle
import random

import pytest
import torch

from overnight.errors import InvalidRequestError
from overnight.kernels.token_bitmask import (
    apply_token_bitmask_cpu_,
    apply_token_bitmask_kernel_,
    apply_token_bitmask_ref,
    unpack_token_bitmask,
)
from overnight.openai_api.errors import ApiError
from overnight.openai_api.inputs import prepare
from overnight.openai_api.protocol import parse_request
from overnight.runner.grammar_mask import GrammarMask
from overnight.runner.request_state import RunnerRequest
from overnight.sampling_params import SamplingParams, StructuredOutputsParams
from overnight.structured.compiler import GrammarCompiler
from overnight.structured.schema_check import unsupported_keyword
from overnight.tokenizer.synthetic import build_synthetic_tokenizer, save_synthetic_tokenizer_folder
from overnight.tokenizer.tokenizer import Tokenizer

VOCAB = 600  # the tokenizer's ids
MODEL_VOCAB = 640  # the model's logits are wider: ids 600.. must never be allowed
SPECIALS = {597: "<|im_start|>", 598: "<|im_end|>", 599: "<|endoftext|>"}
EOS = 599
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 5},
        "kind": {"enum": ["cat", "dog"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 20},
    },
    "required": ["name", "kind", "age"],
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    from transformers import AutoTokenizer

    folder = save_synthetic_tokenizer_folder(tmp_path_factory.mktemp("synthetic"), VOCAB, SPECIALS)
    return Tokenizer(AutoTokenizer.from_pretrained(folder, local_files_only=True), (EOS,))


@pytest.fixture()
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler.for_tokenizer(tokenizer, MODEL_VOCAB)


def allowed_ids(bitmask_row: torch.Tensor, vocab: int = MODEL_VOCAB) -> set[int]:
    return set(unpack_token_bitmask(bitmask_row[None], vocab)[0].nonzero().flatten().tolist())


def S(**kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kw)


# -- params -------------------------------------------------------------------------------------------


def test_exactly_one_kind_and_its_shape():
    for bad in [{}, {"regex": "a", "choice": ["b"]}, {"json": SCHEMA, "json_object": True}]:
        with pytest.raises(InvalidRequestError, match="exactly one"):
            S(**bad)
    with pytest.raises(InvalidRequestError, match="non-empty list"):
        S(choice=[])
    with pytest.raises(InvalidRequestError, match="non-empty string"):
        S(choice=["a", ""])
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        S(json="{nope")
    with pytest.raises(InvalidRequestError, match="JSON object"):
        S(json="[1, 2]")
    with pytest.raises(InvalidRequestError, match="boolean"):
        S(regex="a", disable_any_whitespace="yes")
    # A schema as text or as a dict is one cache entry; key order is kept (it is the output's order).
    assert S(json=json.dumps(SCHEMA, indent=2)).key == S(json=SCHEMA).key
    reordered = dict(reversed(list(SCHEMA["properties"].items())))
    assert S(json={**SCHEMA, "properties": reordered}).key != S(json=SCHEMA).key
    assert S(json=SCHEMA).key != S(json=SCHEMA, disable_any_whitespace=False).key


def test_sampling_params_conflicts_and_pickling():
    so = S(json=SCHEMA)
    with pytest.raises(InvalidRequestError, match="ignore_eos"):
        SamplingParams(structured_outputs=so, ignore_eos=True)
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        SamplingParams(structured_outputs=so, min_tokens=2)
    assert SamplingParams(structured_outputs={"json": SCHEMA}).structured_outputs == so
    with pytest.raises(InvalidRequestError, match="unexpected keyword argument 'jsn'"):
        SamplingParams(structured_outputs={"jsn": SCHEMA})
    with pytest.raises(InvalidRequestError, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs="json")
    p = pickle.loads(pickle.dumps(SamplingParams(structured_outputs=so)))  # data parallel ships params
    assert p.structured_outputs == so and p.structured_outputs.key == so.key


# -- schema keywords ------------------------------------------------------------------------------------


def test_unsupported_keywords_are_named_with_their_place():
    assert unsupported_keyword(SCHEMA) is None
    # A property may be called like a keyword: only schema positions are checked.
    assert unsupported_keyword({"type": "object", "properties": {"not": {"type": "string"}}}) is None
    assert unsupported_keyword({"enum": [{"if": 1}], "default": {"contains": 2}}) is None
    cases = {
        "'uniqueItems' at /properties/tags": {
            "type": "object",
            "properties": {"tags": {"type": "array", "uniqueItems": True}},
        },
        "'not' at /items/anyOf/1": {"type": "array", "items": {"anyOf": [{}, {"not": {}}]}},
        "'contains' at /$defs/a~1b": {"$defs": {"a/b": {"contains": {}}}},
        "'multipleOf' on a non-integer at /": {"type": "number", "multipleOf": 0.5},
        "'allOf' with more than one subschema at /": {"allOf": [{}, {}]},
        "'if' at /additionalProperties": {"type": "object", "additionalProperties": {"if": {}}},
    }
    for expected, schema in cases.items():
        assert unsupported_keyword(schema) == expected
    assert unsupported_keyword({"type": "integer", "multipleOf": 3}) is None  # enforced for integers


# -- the compiler -----------------------------------------------------------------------------------------


def test_compiles_once_per_spec_and_caches_failures(compiler):
    for _ in range(3):
        compiler.compile(S(json=json.dumps(SCHEMA)))
        compiler.compile(S(json=SCHEMA))
    assert compiler.num_compiled == 1
    for _ in range(3):
        with pytest.raises(InvalidRequestError, match=r"regex cannot be compiled: .*parenthesis"):
            compiler.compile(S(regex="(ab"))
    assert compiler.num_compiled == 2


def test_bad_specs_are_request_errors(compiler):
    with pytest.raises(InvalidRequestError, match='JSON schema cannot be compiled: Unsupported type "strin"'):
        compiler.compile(S(json={"type": "strin"}))
    with pytest.raises(InvalidRequestError, match="uses 'dependentRequired' at /"):
        compiler.compile(S(json={"type": "object", "dependentRequired": {"a": ["b"]}}))
    with pytest.raises(InvalidRequestError, match='root rule with name "root" is not found'):
        compiler.compile(S(grammar='start ::= "a"'))


def test_lru_evicts_the_least_recently_used(tokenizer):
    small = GrammarCompiler.for_tokenizer(tokenizer, MODEL_VOCAB)
    small.capacity = 2
    a, b, c = S(regex="a+"), S(regex="b+"), S(regex="c+")
    small.compile(a)
    small.compile(b)
    small.compile(a)  # a is now the most recent
    small.compile(c)  # evicts b
    small.compile(a)
    assert small.num_compiled == 3
    small.compile(b)
    assert small.num_compiled == 4


def test_masks_never_allow_special_or_padding_ids(compiler, tokenizer):
    """Inside a JSON string almost every token fits, but never a special token (its literal text would be
    dropped when decoding) nor an id past the tokenizer (the model's padded logits); EOS only at the end."""
    import xgrammar as xgr

    m = compiler.matcher(S(json=SCHEMA))
    for t in tokenizer.encode('{"name": "a', add_special_tokens=False):
        assert m.accept_token(t)
    bm = xgr.allocate_token_bitmask(1, MODEL_VOCAB)
    m.fill_next_token_bitmask(bm)
    ids = allowed_ids(bm[0])
    assert len(ids) > 300
    assert not ids & set(SPECIALS)
    assert max(ids) < VOCAB
    for t in tokenizer.encode('", "kind": "cat", "age": 7}', add_special_tokens=False):
        assert m.accept_token(t)
    m.fill_next_token_bitmask(bm)
    assert allowed_ids(bm[0]) == {EOS}


def test_choice_and_json_object_grammars(compiler, tokenizer):
    import xgrammar as xgr

    choices = ['say "hi"', "naïve\\", "x"]
    for text in choices:
        m = compiler.matcher(S(choice=choices))
        assert all(m.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False))
        assert m.is_completed()
    m = compiler.matcher(S(choice=choices))
    assert not m.accept_string("y")
    m = compiler.matcher(S(json_object=True))
    assert m.accept_string('{"free": [1, {"form": null}]}') and m.is_completed()
    m = compiler.matcher(S(json_object=True))
    assert not m.accept_string("[")
    assert isinstance(m, xgr.GrammarMatcher)


# -- the token mask kernel ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("vocab", [31, 32, 4100, 8192 + 33])
def test_bitmask_kernel_and_cpu_path_match_reference(vocab, dtype):
    gen = torch.Generator().manual_seed(vocab)
    words = -(-vocab // 32)
    logits = torch.randn(5, vocab, generator=gen).to(dtype)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=gen, dtype=torch.int64).to(torch.int32)
    rows = torch.tensor([4, 0, 2])
    ref, out, cpu = logits.clone(), logits.clone(), logits.clone()
    apply_token_bitmask_ref(ref, bitmask, rows)
    apply_token_bitmask_kernel_(out, bitmask, rows)
    apply_token_bitmask_cpu_(cpu, bitmask, rows)
    assert torch.equal(out, ref) and torch.equal(cpu, ref)
    # The reference itself, bit by bit: untouched rows stay, listed rows keep exactly their set bits.
    assert torch.equal(ref[1], logits[1]) and torch.equal(ref[3], logits[3])
    for i, r in enumerate(rows.tolist()):
        for t in random.Random(t_seed := vocab + i).sample(range(vocab), min(vocab, 64)):
            keep = (int(bitmask[i, t // 32]) >> (t % 32)) & 1
            assert ref[r, t] == (logits[r, t] if keep else float("-inf")), (t_seed, t)


def test_bitmask_wrapper_checks_shapes():
    logits = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="int32"):
        apply_token_bitmask_ref(logits, torch.zeros(1, 2, dtype=torch.int64), torch.tensor([0]))
    with pytest.raises(ValueError, match=r"\[K, 2\]"):
        apply_token_bitmask_ref(logits, torch.zeros(1, 3, dtype=torch.int32), torch.tensor([0]))
    with pytest.raises(ValueError, match="rows"):
        apply_token_bitmask_ref(logits, torch.zeros(1, 2, dtype=torch.int32), torch.tensor([0, 1]))


# -- the runner's matchers --------------------------------------------------------------------------------


def runner_req(rid: str, prompt: list[int], outputs: list[int], params: SamplingParams) -> RunnerRequest:
    return RunnerRequest(
        req_id=rid,
        token_ids=prompt + outputs,
        num_prompt_tokens=len(prompt),
        params=params,
        seed=0,
        slot=0,
        num_blocks=0,
        num_computed_tokens=len(prompt) + len(outputs),
        num_pending=1,  # this step's sample
    )


def test_matchers_follow_the_tokens(compiler, tokenizer):
    """A mask per structured row in row order (plain rows skipped); each matcher accepts the tokens
    sampled since its last mask; n > 1 children do not share a matcher; a resumed request (a new state
    whose whole output is known) replays it and gets the mask of a request that never stopped."""
    mask = GrammarMask(compiler, max_rows=8, device=torch.device("cpu"))
    structured = SamplingParams(structured_outputs=S(json=SCHEMA))
    prompt = [5, 6, 7]
    text = tokenizer.encode('{"name": "ab', add_special_tokens=False)
    a = runner_req("a", prompt, [], structured)
    b = runner_req("b#1", prompt, [], structured)
    free = runner_req("free", prompt, [], SamplingParams())
    for t in text:
        m = mask.build([free, a, b])
        assert m is not None and m.rows.tolist() == [1, 2]
        assert t in allowed_ids(m.bitmask[0]) and t in allowed_ids(m.bitmask[1])
        a.token_ids.append(t)  # the step's tokens reached the host
        b.token_ids.append(t)
    last = mask.build([free, a, b])
    assert a.guide is not b.guide and a.guide.consumed == b.guide.consumed == len(text)
    assert torch.equal(last.bitmask[0], last.bitmask[1])
    quote = tokenizer.encode('"', add_special_tokens=False)
    b.token_ids += quote  # b closes the string, a does not move
    after = mask.build([a, b])
    assert torch.equal(after.bitmask[0], last.bitmask[0])
    assert allowed_ids(after.bitmask[1]) == set(tokenizer.encode(",", add_special_tokens=False))
    resumed = runner_req("a", prompt, a.token_ids[len(prompt) :], structured)
    again = mask.build([resumed])
    assert resumed.guide is not a.guide and resumed.guide.consumed == len(text)
    assert torch.equal(again.bitmask[0], last.bitmask[0])
    assert mask.build([free]) is None


def test_a_step_launched_after_the_end_gets_a_stop_only_row(compiler, tokenizer):
    """With the one-step-ahead loop the engine launches a step for a request before it reads that the
    previous token was EOS: the matcher has terminated, and the row (whose token is dropped) is filled
    with the stop tokens instead of asking the matcher for a mask."""
    mask = GrammarMask(compiler, max_rows=2, device=torch.device("cpu"))
    st = runner_req("a", [5], [], SamplingParams(structured_outputs=S(choice=["ab"])))
    mask.build([st])
    st.token_ids += tokenizer.encode("ab", add_special_tokens=False) + [EOS]
    m = mask.build([st])
    assert st.guide.ended and st.guide.matcher.is_terminated()
    assert allowed_ids(m.bitmask[0]) == {EOS}


def test_a_refused_token_ends_the_request(compiler, tokenizer):
    mask = GrammarMask(compiler, max_rows=2, device=torch.device("cpu"))
    st = runner_req("a", [5], [], SamplingParams(structured_outputs=S(regex="[0-9]+")))
    mask.build([st])
    st.token_ids += tokenizer.encode("x", add_special_tokens=False)
    m = mask.build([st])
    assert allowed_ids(m.bitmask[0]) == {EOS}


# -- the OpenAI fields --------------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]


def so_of(url: str, **body) -> StructuredOutputsParams | None:
    base = {"messages": MSGS} if url == CHAT else {"prompt": "x"}
    return parse_request(url, {**base, **body}).to_sampling_params().structured_outputs


def test_response_format_and_extra_fields_map_to_one_constraint():
    rf = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
    assert so_of(CHAT, response_format=rf) == S(json=SCHEMA)
    assert so_of(COMP, response_format=rf) == S(json=SCHEMA)
    assert so_of(CHAT, response_format={"type": "json_object"}) == S(json_object=True)
    assert so_of(CHAT, response_format={"type": "text"}) is None
    assert so_of(CHAT) is None
    assert so_of(CHAT, structured_outputs={"regex": "[a-z]+", "disable_fallback": True}) == S(regex="[a-z]+")
    assert so_of(COMP, structured_outputs={"json": SCHEMA, "disable_any_whitespace": False}) == S(
        json=SCHEMA, disable_any_whitespace=False
    )
    assert so_of(COMP, guided_json=json.dumps(SCHEMA)).key == S(json=SCHEMA).key
    assert so_of(COMP, guided_regex=r"\d+") == S(regex=r"\d+")
    assert so_of(COMP, guided_choice=["a", "b"]) == S(choice=["a", "b"])
    assert so_of(CHAT, guided_grammar='root ::= "x"') == S(grammar='root ::= "x"')


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "only one"),
        ({"guided_json": SCHEMA, "guided_choice": ["a"]}, "guided_choice", "only one"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs", "whitespace_pattern"),
        ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
        ({"guided_json": "{oops"}, "guided_json", "not valid JSON"),
    ],
)
def test_conflicting_or_malformed_fields_are_400s(body, param, words):
    req = parse_request(CHAT, {"messages": MSGS, **body})
    with pytest.raises(ApiError) as info:
        prepare(req, None, 1024, {"m"})
    err = info.value
    assert (err.status_code, err.code, err.param) == (400, "invalid_request", param)
    assert words in err.message


# -- the synthetic tokenizer --------------------------------------------------------------------------------


def test_synthetic_tokenizer_has_the_size_and_round_trips():
    tok = build_synthetic_tokenizer(2000, {1000: "<|im_end|>", 1999: "<|endoftext|>"})
    assert tok.get_vocab_size() == 2000
    assert tok.id_to_token(1000) == "<|im_end|>" and tok.id_to_token(1999) == "<|endoftext|>"
    assert len(tok.id_to_token(1001)) == 2  # words go on past it
    for text in ['{"a": [1, 2.5e-3]} \n\t\\', "héllo wörld 😀 ✓", "Hello world, hello again"]:
        ids = tok.encode(text).ids
        assert tok.decode(ids) == text
    assert len(tok.encode("Hello world").ids) < len("Hello world")  # words merge
    assert tok.encode("a<|im_end|>b").ids[1] == 1000
    with pytest.raises(ValueError, match="not in"):
        build_synthetic_tokenizer(300, {100: "<s>"})
    # Deterministic: the same size gives the same vocabulary.
    assert build_synthetic_tokenizer(700).get_vocab() == build_synthetic_tokenizer(700).get_vocab()


def test_synthetic_tokenizer_folder_loads_with_transformers(tokenizer):
    assert tokenizer.vocab_size == VOCAB
    assert tokenizer.hf.eos_token_id == EOS
    assert tokenizer.decode(tokenizer.encode("a b", add_special_tokens=False)) == "a b"
