"""A structured output with a reasoning parser constrains the answer, not the reasoning: the runner's
matcher starts after the reasoning's end marker (StructuredOutputsParams.start_after), and a request's
plan sets that marker only when the prompt has not already closed the reasoning."""

from __future__ import annotations

import pytest
import torch

from overnight.options import ChatOptions
from overnight.runner.grammar_mask import GrammarMask
from overnight.sampling_params import SamplingParams, StructuredOutputsParams
from overnight.structured.compiler import GrammarCompiler
from overnight.tokenizer.synthetic import save_synthetic_tokenizer_folder
from overnight.tokenizer.tokenizer import Tokenizer
from overnight.tool_calls.message import plan_message
from tests.test_structured_units import EOS, MODEL_VOCAB, SCHEMA, SPECIALS, VOCAB, allowed_ids, runner_req


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    from transformers import AutoTokenizer

    folder = save_synthetic_tokenizer_folder(tmp_path_factory.mktemp("synthetic"), VOCAB, SPECIALS)
    return Tokenizer(AutoTokenizer.from_pretrained(folder, local_files_only=True), (EOS,))


@pytest.fixture()
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler.for_tokenizer(tokenizer, MODEL_VOCAB)


def test_the_grammar_starts_after_the_marker(compiler, tokenizer):
    mask = GrammarMask(compiler, max_rows=4, device=torch.device("cpu"))
    gated = SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA, start_after="</think>"))
    plain = SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA))
    a = runner_req("a", [5, 6], [], gated)
    fresh = runner_req("b", [5, 6], [], plain)
    first = mask.build([a, fresh])
    assert allowed_ids(first.bitmask[0]) == set(range(MODEL_VOCAB))  # reasoning: anything goes
    start = allowed_ids(first.bitmask[1])
    assert start != set(range(MODEL_VOCAB))
    thinking = tokenizer.encode("hmm, a cat </thi", add_special_tokens=False)
    for t in thinking:
        a.token_ids.append(t)
        m = mask.build([a])
        assert allowed_ids(m.bitmask[0]) == set(range(MODEL_VOCAB))
    a.token_ids += tokenizer.encode("nk>", add_special_tokens=False)
    m = mask.build([a])
    assert a.guide.waiting_for is None
    assert allowed_ids(m.bitmask[0]) == start  # the answer starts where a fresh grammar does
    a.token_ids += tokenizer.encode('{"name": "x', add_special_tokens=False)
    m = mask.build([a])
    assert allowed_ids(m.bitmask[0]) != start and a.guide.matcher is not None


def test_a_resumed_request_replays_the_reasoning_and_the_answer(compiler, tokenizer):
    mask = GrammarMask(compiler, max_rows=2, device=torch.device("cpu"))
    gated = SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA, start_after="</think>"))
    outputs = tokenizer.encode("ok</think>", add_special_tokens=False)
    outputs += tokenizer.encode('{"name": "x', add_special_tokens=False)
    resumed = runner_req("a", [5], outputs, gated)
    m = mask.build([resumed])
    straight = runner_req(
        "b", [5], [], SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA))
    )
    mask.build([straight])
    straight.token_ids += tokenizer.encode('{"name": "x', add_special_tokens=False)
    assert not resumed.guide.ended and resumed.guide.waiting_for is None
    assert torch.equal(m.bitmask[0], mask.build([straight]).bitmask[0])


def test_the_plan_gates_structured_outputs_only_while_reasoning_is_open():
    chat = ChatOptions(reasoning_parser="qwen3")
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True))
    plan, p = plan_message(chat, params, "<|im_start|>assistant\n")
    assert p.structured_outputs.start_after == "</think>" and not plan.starts_in_reasoning
    plan, p = plan_message(chat, params, "<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking off
    assert p.structured_outputs.start_after is None
    plan, p = plan_message(chat, params, "<|im_start|>assistant\n<think>\n")
    assert p.structured_outputs.start_after == "</think>" and plan.starts_in_reasoning
    assert p.structured_outputs.key == params.structured_outputs.key  # one compiled grammar either way
    _, p = plan_message(None, params, "<|im_start|>assistant\n")
    assert p.structured_outputs.start_after is None
