"""The sampler on synthetic logits: seeds, filtering sets, penalties, logprobs."""

from __future__ import annotations

import torch

from overnight.runner.inputs import build_sampling_batch
from overnight.runner.sampler import Sampler, gumbel_noise
from overnight.sampling_params import SamplingParams
from tests.engine_helpers import V, req, sample


def test_noise_is_a_function_of_seed_and_position_only():
    seeds = torch.tensor([5, 7, 5], dtype=torch.int64)
    pos = torch.tensor([3, 3, 3], dtype=torch.int64)
    g = gumbel_noise(seeds, pos, 1000)
    assert torch.equal(g[0], g[2]) and not torch.equal(g[0], g[1])
    alone = gumbel_noise(seeds[1:2], pos[1:2], 1000)
    assert torch.equal(alone[0], g[1])
    assert torch.isfinite(g).all()
    # Roughly Gumbel(0,1): mean ~ 0.5772
    big = gumbel_noise(torch.arange(50, dtype=torch.int64), torch.zeros(50, dtype=torch.int64), 4000)
    assert abs(big.mean().item() - 0.5772) < 0.02


def test_same_seed_same_token_whatever_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(8, V)
    p = SamplingParams(temperature=0.9, seed=123)
    mine = [req(p, seed=123)]
    alone = sample(logits[3:4], mine)[0]
    others = [req(SamplingParams(temperature=0.7), seed=s) for s in range(7)]
    batch_reqs = others[:3] + mine + others[3:]
    together = sample(logits, batch_reqs)[0]
    assert together[3] == alone[0]


def test_different_seeds_differ():
    logits = torch.zeros(1, V)  # uniform: every token equally likely
    draws = {sample(logits, [req(SamplingParams(temperature=1.0), seed=s)])[0].item() for s in range(40)}
    assert len(draws) > 20


def test_draws_stay_inside_top_k_top_p_min_p_sets():
    torch.manual_seed(1)
    logits = torch.randn(1, V) * 2
    probs = logits.softmax(-1)[0]
    order = probs.argsort(descending=True).tolist()
    top_k_set = set(order[:5])
    cum, top_p_set = 0.0, set()
    for t in order:
        top_p_set.add(t)
        cum += probs[t].item()
        if cum >= 0.6:
            break
    min_p_set = {t for t in range(V) if probs[t] >= 0.2 * probs.max()}
    cases = [
        (SamplingParams(temperature=1.0, top_k=5), top_k_set),
        (SamplingParams(temperature=1.0, top_p=0.6), top_p_set),
        (SamplingParams(temperature=1.0, min_p=0.2), min_p_set),
    ]
    for params, allowed in cases:
        reqs = [req(params, seed=s) for s in range(300)]
        tokens = sample(logits.expand(300, V).contiguous(), reqs)[0].tolist()
        assert set(tokens) <= allowed, (params, set(tokens) - allowed)
        assert len(set(tokens)) > 1  # it does sample, not argmax


def test_greedy_is_argmax_and_mixed_batch():
    torch.manual_seed(2)
    logits = torch.randn(4, V)
    reqs = [
        req(SamplingParams(temperature=0)),
        req(SamplingParams(temperature=1.0), seed=1),
        req(SamplingParams(temperature=0)),
        req(SamplingParams(temperature=0.5), seed=2),
    ]
    tokens = sample(logits, reqs)[0]
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


def test_penalties_change_the_argmax_as_defined():
    logits = torch.zeros(1, V)
    logits[0, 10] = 2.0
    logits[0, 11] = 1.9
    # Token 10 appeared twice in the output: frequency 0.2*2 + presence 0.1 pushes it below 11.
    r = req(SamplingParams(temperature=0, frequency_penalty=0.2, presence_penalty=0.1), output=(10, 10))
    assert sample(logits, [r])[0].item() == 11
    # Repetition penalty divides positive logits of seen tokens (prompt included).
    r = req(SamplingParams(temperature=0, repetition_penalty=1.2), prompt=(10,))
    assert sample(logits, [r])[0].item() == 11
    assert sample(logits, [req(SamplingParams(temperature=0))])[0].item() == 10


def test_min_tokens_bans_eos_and_stop_ids():
    logits = torch.zeros(1, V)
    logits[0, 0] = 5.0  # eos
    logits[0, 7] = 4.0  # a stop token id
    r = req(SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[7]))
    assert sample(logits, [r])[0].item() not in (0, 7)
    r = req(SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[7]), output=(5, 6))
    assert sample(logits, [r])[0].item() == 0


def test_logprobs_are_raw_log_softmax():
    torch.manual_seed(3)
    logits = torch.randn(2, V)
    reqs = [req(SamplingParams(temperature=0, logprobs=3)), req(SamplingParams(temperature=0))]
    tokens, lps = sample(logits, reqs)
    ref = logits.log_softmax(-1)
    assert lps[1] is None
    lp = lps[0]
    assert abs(lp.sampled_logprob - ref[0, tokens[0]].item()) < 1e-6
    assert lp.sampled_rank == 1
    assert lp.top_ids == ref[0].topk(3).indices.tolist()
    assert torch.allclose(torch.tensor(lp.top_logprobs), ref[0].topk(3).values, atol=1e-6)


def test_noise_is_finite_where_the_uniform_rounds_to_one():
    # (seed 2, position 48, token 16034) hashes to the largest 24-bit value, whose uniform rounds to 1.0
    # in float32: unclamped, its noise was +inf and a token masked to -inf there scored NaN and won.
    g = gumbel_noise(torch.tensor([2]), torch.tensor([48]), 16035)
    assert torch.isfinite(g).all()
    assert g[0, 16034] > 15  # still the largest noise a draw can get


def test_token_mask_rows_draw_only_allowed_tokens_and_logprobs_stay_raw():
    from overnight.runner.sampler import TokenMask

    torch.manual_seed(3)
    logits = torch.randn(3, V) * 3
    allowed = [5, 17, 40]
    bitmask = torch.zeros(2, V // 32, dtype=torch.int32)
    for t in allowed:
        bitmask[:, t // 32] |= 1 << (t % 32)
    for params in (SamplingParams(temperature=0, logprobs=2), SamplingParams(temperature=1.0, logprobs=2)):
        reqs = [req(params, seed=s) for s in range(3)]
        batch = build_sampling_batch(reqs, (0,), torch.device("cpu"))
        batch.token_mask = TokenMask(bitmask, torch.tensor([0, 2]))  # row 1 has no grammar
        tokens, lps = Sampler()(logits.clone(), batch)
        assert tokens[0].item() in allowed and tokens[2].item() in allowed
        if params.temperature == 0:
            assert tokens[1] == logits[1].argmax()  # untouched
        raw = logits.log_softmax(-1)
        for i, lp in enumerate(lps.to_host()):
            assert abs(lp.sampled_logprob - raw[i, tokens[i]].item()) < 1e-5  # before the mask
            assert lp.top_ids == raw[i].topk(2).indices.tolist()
