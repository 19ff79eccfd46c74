"""A forced tool_choice (named or "required") for gpt-oss's harmony format, at the grammar level: the
structural tag plan_message builds, compiled by our GrammarCompiler for a byte-level tokenizer holding
harmony's special tokens, accepts a call however harmony writes it (after free analysis or not) and
rejects every other ending; a reply sampled at random under its mask always ends in a valid call, which
the shared chat layer reads back as tool_calls."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

pytest.importorskip("openai_harmony")
xgr = pytest.importorskip("xgrammar")

import torch  # noqa: E402

from overnight.reasoning.harmony import encoding, render_prompt  # noqa: E402
from overnight.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402
from overnight.structured.compiler import GrammarCompiler  # noqa: E402
from overnight.tool_calls.forced import ToolError  # noqa: E402
from overnight.tool_calls.message import plan_message  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>"]
STOPS = ["<|return|>", "<|call|>"]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
TOOLS = [WEATHER, TIME]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def hf():
    """A byte-level BPE with no merges (every byte a token) plus harmony's special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS + STOPS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|return|>")


@pytest.fixture(scope="module")
def compiler(hf):
    stops = [hf.convert_tokens_to_ids(s) for s in [*STOPS, "<|endoftext|>"]]
    return GrammarCompiler(lambda: hf, len(hf), stops)


def _plan(tool_choice, params=None):
    prompt = encoding().decode_utf8(render_prompt([{"role": "user", "content": "Weather?"}], tools=TOOLS))
    return plan_message(None, params or SamplingParams(), prompt, tools=TOOLS, tool_choice=tool_choice)


def _accepts(hf, compiler, params: SamplingParams, text: str) -> bool:
    """Whether the grammar takes the reply `text` whole and may end there (its stop token next)."""
    matcher = compiler.matcher(params.structured_outputs)
    ids = hf.encode(text, add_special_tokens=False)
    if not all(matcher.accept_token(t) for t in ids):
        return False
    return matcher.accept_token(hf.convert_tokens_to_ids("<|call|>")) and matcher.is_terminated()


def _harmony_rendered_call(name: str, args: str) -> str:
    """openai-harmony's own rendering of an assistant call, less the prompt's "<|start|>assistant" and
    the closing <|call|> (the stop token)."""
    from openai_harmony import Message, Role

    msg = (
        Message.from_role_and_content(Role.ASSISTANT, args)
        .with_channel("commentary")
        .with_recipient(f"functions.{name}")
        .with_content_type("<|constrain|>json")
    )
    text = encoding().decode_utf8(encoding().render(msg))
    assert text.startswith("<|start|>assistant") and text.endswith("<|call|>")
    return text.removeprefix("<|start|>assistant").removesuffix("<|call|>")


ANALYSIS = (
    "<|channel|>analysis<|message|>The user wants the weather; a < b is fine here.<|end|><|start|>assistant"
)
MODEL_FORM = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'


def test_named_choice_accepts_only_a_call_of_that_function(hf, compiler):
    plan, params = _plan(NAMED)
    assert plan.harmony and plan.named and params.structured_outputs.structural_tag is not None
    assert not params.skip_special_tokens
    rendered = _harmony_rendered_call("get_weather", '{"city": "Oslo", "days": 3}')
    for text in [MODEL_FORM, ANALYSIS + MODEL_FORM, ANALYSIS * 2 + rendered, rendered]:
        assert _accepts(hf, compiler, params, text), text
    rejected = [
        "<|channel|>final<|message|>It is sunny.",  # an answer instead of the call
        ANALYSIS,  # reasoning, then stopping
        MODEL_FORM.replace("get_weather", "get_time"),  # another function
        MODEL_FORM.replace('"Paris"', "42"),  # arguments against the schema
        MODEL_FORM.replace('{"city": "Paris"}', '{"days": 2}'),  # a required argument missing
        MODEL_FORM.replace('"Paris"', '"Paris, France, Europe"'),  # maxLength 12
        MODEL_FORM + " and more",  # text after the call
        "<|channel|>analysis<|message|>x<|channel|>" + MODEL_FORM,  # a marker inside the analysis
        "I will call: " + MODEL_FORM,  # text before the header
    ]
    for text in rejected:
        assert not _accepts(hf, compiler, params, text), text


def test_required_accepts_a_call_of_any_tool(hf, compiler):
    plan, params = _plan("required")
    assert plan.read_calls and not plan.named
    assert _accepts(hf, compiler, params, ANALYSIS + MODEL_FORM)
    assert _accepts(hf, compiler, params, _harmony_rendered_call("get_time", "{}"))
    assert not _accepts(hf, compiler, params, "<|channel|>final<|message|>No tools needed.")
    assert not _accepts(hf, compiler, params, MODEL_FORM.replace("get_weather", "get_news"))


def test_the_chat_layer_reads_the_forced_call(hf):
    for choice, finish in [(NAMED, "stop"), ("required", "tool_calls")]:
        plan, _ = _plan(choice)
        for text in [ANALYSIS + MODEL_FORM, _harmony_rendered_call("get_weather", '{"city": "Paris"}')]:
            message = plan.parse(text + "<|call|>")
            assert [(c.name, json.loads(c.arguments)) for c in message.tool_calls] == [
                ("get_weather", {"city": "Paris"})
            ]
            assert plan.finish_reason("stop", message) == finish
        assert plan.parse(ANALYSIS + MODEL_FORM + "<|call|>").reasoning_content.startswith("The user wants")


@pytest.mark.parametrize("choice", [NAMED, "required"])
def test_random_replies_under_the_mask_end_in_a_valid_call(hf, compiler, choice):
    """Tokens drawn at random from what the mask allows (a model that knows nothing, except that harmony's
    markers never go inside the JSON arguments): every reply is a harmony call of an allowed tool whose
    arguments validate."""
    plan, params = _plan(choice)
    stops = set(compiler.stop_token_ids)
    markers = [hf.convert_tokens_to_ids(s) for s in SPECIALS]
    gen = torch.Generator().manual_seed(0)
    forms = set()  # whether each reply reasoned first
    for _ in range(4):
        matcher = compiler.matcher(params.structured_outputs)
        mask = xgr.allocate_token_bitmask(1, len(hf))
        out: list[int] = []
        while len(out) < 4000:
            matcher.fill_next_token_bitmask(mask)
            logits = torch.rand(1, len(hf), generator=gen)
            # Favour the special tokens and the closing quote so replies end in a few hundred tokens.
            logits[0, -len(SPECIALS + STOPS) :] += 0.9
            logits[0, hf.convert_tokens_to_ids('"')] += 0.9
            if "json<|message|>" in hf.decode(out, skip_special_tokens=False):
                logits[0, markers] = float("-inf")
            xgr.apply_token_bitmask_inplace(logits, mask)
            tok = int(logits.argmax())
            assert matcher.accept_token(tok)
            out.append(tok)
            if tok in stops:
                break
        assert out[-1] in stops and matcher.is_terminated(), hf.decode(out, skip_special_tokens=False)
        text = hf.decode(out[:-1], skip_special_tokens=False) + "<|call|>"
        forms.add(text.startswith("<|channel|>analysis"))
        (call,) = plan.parse(text).tool_calls
        args = json.loads(call.arguments)
        if call.name == "get_weather":
            assert isinstance(args["city"], str) and len(args["city"]) <= 12
            assert set(args) <= {"city", "days"} and isinstance(args.get("days", 0), int)
        else:
            assert choice == "required" and call.name == "get_time" and args == {}
    assert forms == {True, False}  # replies with free analysis first, and replies calling at once


def test_forced_call_refusals():
    with pytest.raises(ToolError, match="combined with another structured output"):
        _plan("required", SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object"})))
    with pytest.raises(ToolError, match="not in tools"):
        _plan({"type": "function", "function": {"name": "nope"}})
    plan, params = _plan("none")
    assert not plan.read_calls and params.structured_outputs is None


@pytest.mark.slow
def test_engine_samples_forced_calls_with_a_random_model(hf, tmp_path):
    """The same tag through the engine (the runner's grammar mask): a tiny random model on this
    tokenizer, sampling, ends every reply in a call of the named function, read back by the chat layer."""
    from overnight import LLM
    from tests.tiny_models import make_tiny_checkpoint

    stops = [hf.convert_tokens_to_ids(s) for s in STOPS]
    folder = make_tiny_checkpoint(
        tmp_path, "qwen3", vocab_size=len(hf), eos_token_id=stops[0], eos_token_ids=stops
    )
    hf.save_pretrained(folder)
    llm = LLM(str(folder), device="cpu", dtype="float32")
    # A random model writes free text for ever (its logits are peaked on a few tokens): a large bias on
    # the tokens that close things, and on "c" (commentary, where analysis is the other way), ends it.
    bias = {hf.convert_tokens_to_ids(t): 30.0 for t in ["<|end|>", "c", '"', "}", "<|call|>"]}
    plan, params = _plan(NAMED, SamplingParams(temperature=1.0, max_tokens=1000, logit_bias=bias))
    prompt = hf.encode("Weather in Paris?", add_special_tokens=False)
    outs = llm.generate(
        [{"prompt_token_ids": prompt}] * 4,
        [replace(params, seed=i) for i in range(4)],
        use_tqdm=False,
    )
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop" and c.token_ids[-1] in stops, c.text[-200:]
        (call,) = plan.parse(c.text).tool_calls
        assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
