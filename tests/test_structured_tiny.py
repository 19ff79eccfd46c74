"""Structured outputs on a tiny random Qwen3 whose logits are wider than its tokenizer (512 ids against a
448-id synthetic tokenizer): the padding ids are never drawn under a grammar, and tensor parallelism (2
gloo ranks, only rank 0 masks, the others adopt its tokens) gives one process's structured tokens."""

from __future__ import annotations

import json
import re

import pytest

from overnight import LLM, SamplingParams, StructuredOutputsParams
from overnight.tokenizer.synthetic import save_synthetic_tokenizer_folder
from tests.tiny_models import make_tiny_checkpoint
from tests.tp_helpers import generate_split

pytestmark = pytest.mark.slow  # starts tensor-parallel processes

MODEL_VOCAB = 512
TOKENIZER_VOCAB = 448
EOS = TOKENIZER_VOCAB - 1
OPTIONS = dict(device="cpu", dtype="float32", max_num_batched_tokens=16)  # chunked prefill too
SCHEMA = {
    "type": "object",
    "properties": {
        "a": {"enum": ["x", "yy"]},
        "b": {"type": "boolean"},
        "c": {"type": "integer", "maximum": 99},
    },
    "required": ["a", "b", "c"],
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("structured-tiny")
    folder = make_tiny_checkpoint(root, "qwen3", vocab_size=MODEL_VOCAB, eos_token_id=EOS)
    save_synthetic_tokenizer_folder(folder, TOKENIZER_VOCAB, {EOS: "<|endoftext|>"})
    return str(folder)


def requests() -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = [[5 + i, 60, 70 + 3 * i, 200, 300 + i] * (1 + i % 4) for i in range(8)]
    kinds = [
        StructuredOutputsParams(regex="[a-z ]{24}"),
        StructuredOutputsParams(json=SCHEMA),
        StructuredOutputsParams(choice=["left", "right", "up or down"]),
        StructuredOutputsParams(grammar='root ::= "<" [0-9]+ ">"'),
    ]
    params = [
        SamplingParams(
            temperature=0.0 if i % 2 else 1.0, seed=i, max_tokens=40, structured_outputs=kinds[i % len(kinds)]
        )
        for i in range(8)
    ]
    return prompts, params


def check_outputs(outs, params) -> None:
    for o, p in zip(outs, params):
        c = o.outputs[0]
        assert all(t < TOKENIZER_VOCAB for t in c.token_ids), c.token_ids  # never a padding id
        kind = p.structured_outputs.kind
        if kind == "regex":
            assert re.fullmatch("[a-z ]{24}", c.text) and c.finish_reason == "stop"
        elif kind == "json" and c.finish_reason == "stop":
            v = json.loads(c.text)
            assert v["a"] in ("x", "yy") and isinstance(v["b"], bool) and v["c"] <= 99
        elif kind == "choice":
            assert c.text in ("left", "right", "up or down") and c.finish_reason == "stop"
        elif kind == "grammar" and c.finish_reason == "stop":
            assert re.fullmatch("<[0-9]+>", c.text)


def test_one_step_ahead_loop_gives_the_same_tokens(folder, monkeypatch):
    """The CUDA loop on the CPU: step N+1 is launched before step N's tokens are read, so each structured
    step first waits for them, and requests whose grammar just ended are still sampled once."""
    from overnight.runner.model_runner import ModelRunner

    prompts, params = requests()
    sync = LLM(folder, **OPTIONS).generate(prompts, params, use_tqdm=False)
    monkeypatch.setattr(ModelRunner, "supports_async", property(lambda self: True))
    ahead = LLM(folder, **OPTIONS)
    assert ahead.engine._async
    outs = ahead.generate(prompts, params, use_tqdm=False)
    check_outputs(outs, params)
    for a, b in zip(sync, outs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert ahead.engine.timings.mask_s > 0


def test_padding_ids_are_never_drawn_and_tp2_matches_tp1(folder):
    prompts, params = requests()
    one = LLM(folder, **OPTIONS).generate(prompts, params, use_tqdm=False)
    check_outputs(one, params)
    plain = LLM(folder, **OPTIONS).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    )
    assert any(
        t >= TOKENIZER_VOCAB for o in plain for t in o.outputs[0].token_ids
    )  # the model does pick them
    two = generate_split(folder, prompts, params, **OPTIONS)
    for a, b in zip(one, two, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
