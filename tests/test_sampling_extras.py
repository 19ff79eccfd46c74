"""prompt_logprobs, logit_bias, allowed_token_ids, bad_words, best_of, truncate_prompt_tokens and
completions' echo on the real runner (a tiny random Qwen3, fp32, CPU).

prompt_logprobs are checked against transformers' log_softmax of one forward pass over the whole
prompt, while chunked prefill splits the prompt, a full prefix cache holds it and a tiny pool preempts.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from overnight import LLM, SamplingParams
from tests.batch_helpers import (
    MAX_MODEL_LEN,
    SERVED,
    completion_line,
    engine_flags,
    make_batch_model,
    read_jsonl,
    run_cli,
    write_jsonl,
)
from tests.engine_helpers import KV_BYTES_PER_TOKEN
from tests.tiny_models import load_reference, make_tiny_checkpoint

pytestmark = pytest.mark.slow  # runs the real model

# Tiny random models have logits of magnitude ~40, where float32 noise alone is ~1e-4 (test_engine_parity).
TOL = 2e-3


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("extras"), "qwen3"))


@pytest.fixture(scope="module")
def reference(folder):
    return load_reference(folder)


def hf_prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)


def check_prompt_logprobs(plp, prompt: list[int], ref: torch.Tensor, k: int) -> None:
    assert plp is not None and len(plp) == len(prompt) and plp[0] is None
    for j in range(1, len(prompt)):
        step, row, tid = plp[j], ref[j - 1], prompt[j]
        assert step is not None and tid in step, j
        assert abs(step[tid].logprob - float(row[tid])) < TOL, (j, step[tid].logprob, float(row[tid]))
        assert (
            step[tid].rank == int((row > row[tid]).sum()) + 1
            or abs(step[tid].logprob - float(row.max())) < TOL
        )
        top = sorted((lp.rank, t) for t, lp in step.items() if lp.rank <= k)
        assert [r for r, _ in top][:k] == list(range(1, k + 1)), (j, top)
        expected_top = torch.topk(row, k).values
        got_top = torch.tensor([step[t].logprob for _, t in top[:k]])
        assert torch.allclose(got_top, expected_top, atol=TOL), j


def test_prompt_logprobs_through_chunks_cache_hits_and_preemption(folder, reference):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 384) for _ in range(n)] for n in (61, 2, 33, 90)]
    # Chunks of 16 tokens; a pool of 480 tokens: 12 requests of ~100 tokens cannot all run at once.
    llm = LLM(
        folder,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=256,
        max_num_batched_tokens=16,
        kv_cache_memory_bytes=480 * KV_BYTES_PER_TOKEN,
        admission="greedy",  # planned admission would avoid the preemption this test exercises
    )
    # Fill the prefix cache with the first prompt: the request that asks for prompt logprobs must
    # compute every position anyway.
    llm.generate([prompts[0]], SamplingParams(max_tokens=1), use_tqdm=False)
    filler = [[rng.randrange(3, 384) for _ in range(60)] for _ in range(8)]
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, prompt_logprobs=3)] * 4
    params += [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * 8
    outs = llm.generate(prompts + filler, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions_total > 0, "the pool was meant to preempt"
    for prompt, out in zip(prompts, outs):
        check_prompt_logprobs(out.prompt_logprobs, prompt, hf_prompt_logprobs(reference, prompt), 3)
    assert all(o.prompt_logprobs is None for o in outs[4:])
    # k = 0: only the prompt token's own entry
    only = llm.generate([prompts[2]], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert all(len(step) == 1 for step in only.prompt_logprobs[1:])


def test_logit_bias_allowed_ids_and_best_of(folder):
    llm = LLM(folder, skip_tokenizer_init=True, dtype="float32", max_model_len=128)
    prompt = [5, 17, 99, 230]
    greedy = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False
    )
    first = greedy[0].outputs[0].token_ids[0]
    [banned, forced, allowed] = llm.generate(
        [prompt] * 3,
        [
            SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={first: -100.0}),
            SamplingParams(temperature=0.7, seed=3, max_tokens=6, ignore_eos=True, logit_bias={42: 100.0}),
            SamplingParams(
                temperature=1.0, seed=4, max_tokens=12, ignore_eos=True, allowed_token_ids=[7, 8, 9]
            ),
        ],
        use_tqdm=False,
    )
    assert banned.outputs[0].token_ids[0] != first
    assert forced.outputs[0].token_ids == [42] * 6
    assert set(allowed.outputs[0].token_ids) <= {7, 8, 9}

    # best_of 6, n 2: the two of the six samples (the same seeds as n=6) with the highest cumulative logprob.
    all_six = llm.generate(
        [prompt],
        SamplingParams(n=6, temperature=1.0, seed=11, max_tokens=5, ignore_eos=True, logprobs=0),
        use_tqdm=False,
    )[0].outputs
    best = llm.generate(
        [prompt],
        SamplingParams(n=2, best_of=6, temperature=1.0, seed=11, max_tokens=5, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs
    ranked = sorted(all_six, key=lambda c: -c.cumulative_logprob)[:2]
    assert len(best) == 2 and [c.index for c in best] == [0, 1]
    assert sorted(c.token_ids for c in best) == sorted(c.token_ids for c in ranked)
    assert all(c.logprobs is None for c in best)  # not asked for: only used to choose


@pytest.fixture(scope="module")
def batch_model(tmp_path_factory) -> str:
    return make_batch_model(tmp_path_factory.mktemp("extras-batch-model"))


def test_bad_words_with_a_tokenizer(batch_model):
    llm = LLM(batch_model, max_model_len=MAX_MODEL_LEN, dtype="float32", device="cpu")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    base = llm.generate(["w10 w20 w30"], params, use_tqdm=False)[0].outputs[0]
    words = base.text.split()
    one = words[0]
    pair = words[1:3]  # the second and third words, as one two-token bad word
    out = llm.generate(
        ["w10 w20 w30"] * 2,
        [
            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, bad_words=[one]),
            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, bad_words=[" ".join(pair)]),
        ],
        use_tqdm=False,
    )
    assert one not in out[0].outputs[0].text.split()
    got = out[1].outputs[0].text.split()
    # Greedy text is unchanged up to where it would complete the pair; only that completion is banned.
    first = next(i for i in range(1, len(words)) if words[i - 1 : i + 1] == pair)
    assert got[:first] == words[:first] and got[first] != pair[1]
    assert all(got[i : i + 2] != pair for i in range(len(got) - 1))


def test_echo_logprobs_and_max_tokens_zero_in_run_batch(batch_model, tmp_path):
    prompt = "w10 w11 w12 w13"
    lines = [
        completion_line("score", prompt, echo=True, logprobs=2, max_tokens=0),
        completion_line("echo", prompt, echo=True, max_tokens=3, temperature=0),
        completion_line("plp", prompt, prompt_logprobs=1, max_tokens=1, temperature=0),
        completion_line("trunc", "w5 " * 200 + prompt, truncate_prompt_tokens=4, max_tokens=2, temperature=0),
        completion_line("best", prompt, n=1, best_of=3, max_tokens=3, seed=1),
    ]
    write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    assert run_cli(["-i", str(tmp_path / "in.jsonl"), "-o", str(out), *engine_flags(batch_model)]) == 0
    by_id = {r["custom_id"]: r for r in read_jsonl(out)}
    assert all(r["error"] is None for r in by_id.values()), json.dumps(by_id)[:2000]

    llm = LLM(
        batch_model, max_model_len=MAX_MODEL_LEN, dtype="float32", device="cpu", served_model_name=SERVED
    )
    ref = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]

    score = by_id["score"]["response"]["body"]
    choice = score["choices"][0]
    assert choice["text"] == prompt
    lp = choice["logprobs"]
    assert (
        lp["tokens"] == prompt.split() and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    )
    for j in range(1, 4):
        tid = ref.prompt_token_ids[j]
        assert abs(lp["token_logprobs"][j] - ref.prompt_logprobs[j][tid].logprob) < 1e-4
        assert len(lp["top_logprobs"][j]) >= 2
    assert score["usage"] == {"prompt_tokens": 4, "completion_tokens": 0, "total_tokens": 4}

    echo = by_id["echo"]["response"]["body"]["choices"][0]
    # The prompt, then the completion's text (this word-level tokenizer starts it without a space).
    assert echo["text"].startswith(prompt) and len(echo["text"]) > len(prompt) and echo["logprobs"] is None
    plp = by_id["plp"]["response"]["body"]["choices"][0]["prompt_logprobs"]
    assert (
        plp[0] is None
        and len(plp) == 4
        and all(str(t) in plp[j] for j, t in enumerate(ref.prompt_token_ids) if j)
    )
    assert by_id["trunc"]["response"]["body"]["usage"]["prompt_tokens"] == 4
    assert len(by_id["best"]["response"]["body"]["choices"]) == 1
