"""Tier (c): the whole engine against HF transformers, token-exact greedy in fp32.

Every family is served by our engine in one batch of prompts of different lengths; the reference is
transformers' generate on each prompt alone. Logprobs equal transformers' log_softmax to 1e-4 on the
real SmolLM2 weights (the tiny random models have logits of magnitude ~40, where fp32 noise alone is
~1e-4, so there they are checked at a looser bound).
"""

from __future__ import annotations

import pytest
import torch

from overnight import LLM, SamplingParams
from tests.parity_helpers import hf_greedy, prompts_for
from tests.tiny_models import load_reference, make_tiny_checkpoint

pytestmark = pytest.mark.slow  # real models beside transformers

NEW_TOKENS = 12


@pytest.fixture(scope="module", params=["qwen3", "qwen2", "llama", "llama-tied"])
def family_pair(request, tmp_path_factory):
    family = request.param
    overrides = {}
    if family == "llama-tied":
        family, overrides = "llama", {"tie_word_embeddings": True}
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), family, **overrides)
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="float32", kv_cache_memory_bytes=16 << 20)
    return llm, load_reference(folder)


def test_greedy_token_exact_in_one_batch(family_pair):
    llm, ref = family_pair
    prompts = prompts_for(ref.config.vocab_size)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        tokens, scores = hf_greedy(ref, prompt, NEW_TOKENS)
        comp = out.outputs[0]
        assert comp.token_ids == tokens, f"prompt of {len(prompt)} tokens"
        for step, (tok, lp) in enumerate(zip(comp.token_ids, comp.logprobs)):
            assert abs(lp[tok].logprob - scores[step][tok].item()) < 1e-2
            assert lp[tok].rank == 1


@pytest.fixture(scope="module")
def smollm2():
    """The embedded default model (SmolLM2-135M-Instruct GGUF) and transformers on the same weights."""
    from overnight.bench.hf_reference import build_hf_model
    from overnight.loader.resolve import resolve_source

    llm = LLM(dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=1024)
    ref = build_hf_model(resolve_source(None), torch.device("cpu"), dummy=False, dtype=torch.float32)
    return llm, ref


def test_smollm2_gguf_greedy_token_exact(smollm2):
    llm, ref = smollm2
    tok = llm.get_tokenizer()
    texts = [
        "Hi",
        "The capital of France is",
        "def fibonacci(n):",
        "List three colors:",
        "Once upon a time, in a small village by the sea,",
        "2 + 2 =",
        "Translate to French: good morning",
        "Explain why the sky is blue in one sentence.",
    ]
    convs = [[{"role": "user", "content": t}] for t in texts]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    outs = llm.chat(convs, params, use_tqdm=False)
    for conv, out in zip(convs, outs):
        ids = tok.apply_chat_template(conv, add_generation_prompt=True)
        assert out.prompt_token_ids == ids
        tokens, _ = hf_greedy(ref, ids, 10)
        assert out.outputs[0].token_ids == tokens, conv[0]["content"]
        assert out.outputs[0].text == tok.decode(tokens)


def test_smollm2_logprobs_equal_transformers_log_softmax(smollm2):
    llm, ref = smollm2
    tok = llm.get_tokenizer()
    convs = [[{"role": "user", "content": t}] for t in ["Hi", "def fibonacci(n):", "Name a fruit."]]
    outs = llm.chat(
        convs, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=5), use_tqdm=False
    )
    worst = 0.0
    for conv, out in zip(convs, outs):
        ids = tok.apply_chat_template(conv, add_generation_prompt=True)
        comp = out.outputs[0]
        with torch.inference_mode():
            ref_lp = ref(torch.tensor([ids + comp.token_ids])).logits[0].float().log_softmax(-1)
        for step, lp in enumerate(comp.logprobs):
            row = ref_lp[len(ids) - 1 + step]
            assert list(lp)[:5] == row.topk(5).indices.tolist()
            for tid, value in lp.items():
                worst = max(worst, abs(value.logprob - row[tid].item()))
        expected = sum(ref_lp[len(ids) - 1 + i, t].item() for i, t in enumerate(comp.token_ids))
        assert abs(comp.cumulative_logprob - expected) < 1e-3
    assert worst < 1e-4, worst


def test_smollm2_answers_sensibly(smollm2):
    llm, _ = smollm2
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(max_tokens=24, temperature=0),
        use_tqdm=False,
    )[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # ended at <|im_end|>, the GGUF's stop id
