"""The Gated DeltaNet ops (layers/gated_delta.py) against transformers' own torch references, and the
state contract: a sequence split anywhere, each piece starting from the states the previous one left
(prefill chunks, then decode steps), gives the outputs and final states of one pass. Also: Qwen3.5's
text-only M-RoPE is plain RoPE over the rotary dims."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated
from transformers.models.qwen3_next.modeling_qwen3_next import (
    causal_conv1d_fn,
    causal_conv1d_update,
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from overnight.layers.gated_delta import (
    causal_conv1d_ref,
    causal_conv1d_step_ref,
    chunk_gated_delta_rule_ref,
    gated_rms_norm_ref,
    gdn_gates,
    recurrent_gated_delta_rule_ref,
)

HK, HV, DK, DV = 2, 6, 8, 5  # grouped value heads (3 per key head), odd sizes


def inputs(t: int, seed: int = 0, n: int | None = None):
    gen = torch.Generator().manual_seed(seed)
    lead = (t,) if n is None else (n, t)
    q = torch.randn(*lead, HK, DK, generator=gen)
    k = torch.randn(*lead, HK, DK, generator=gen)
    v = torch.randn(*lead, HV, DV, generator=gen)
    a, b = torch.randn(*lead, HV, generator=gen), torch.randn(*lead, HV, generator=gen)
    A_log, dt_bias = torch.rand(HV, generator=gen).log(), torch.rand(HV, generator=gen)
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    return q, k, v, g, beta


def hf_rule(fn, q, k, v, g, beta, state):
    r = HV // HK  # transformers expands the key heads before calling its rule
    return fn(
        q.repeat_interleave(r, -2),
        k.repeat_interleave(r, -2),
        v,
        g,
        beta,
        initial_state=state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )


@pytest.mark.parametrize("t", [1, 5, 64, 150])
def test_chunked_rule_matches_transformers(t):
    q, k, v, g, beta = inputs(t)
    s0 = torch.randn(HV, DK, DV)
    o, s = chunk_gated_delta_rule_ref(q, k, v, g, beta, s0)
    want_o, want_s = hf_rule(
        torch_chunk_gated_delta_rule, q[None], k[None], v[None], g[None], beta[None], s0[None]
    )
    torch.testing.assert_close(o, want_o[0], rtol=0, atol=0)
    torch.testing.assert_close(s, want_s[0], rtol=0, atol=0)


def test_recurrent_rule_matches_transformers_batched():
    q, k, v, g, beta = inputs(7, n=3)
    s0 = torch.randn(3, HV, DK, DV)
    o, s = recurrent_gated_delta_rule_ref(q, k, v, g, beta, s0)
    want_o, want_s = hf_rule(torch_recurrent_gated_delta_rule, q, k, v, g, beta, s0)
    torch.testing.assert_close(o, want_o, rtol=0, atol=0)
    torch.testing.assert_close(s, want_s, rtol=0, atol=0)


def test_chunked_and_recurrent_agree():
    q, k, v, g, beta = inputs(100, seed=3)
    o, s = chunk_gated_delta_rule_ref(q, k, v, g, beta)
    o2, s2 = recurrent_gated_delta_rule_ref(
        q[None], k[None], v[None], g[None], beta[None], torch.zeros(1, HV, DK, DV)
    )
    torch.testing.assert_close(o, o2[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s, s2[0], rtol=1e-4, atol=1e-5)


def test_conv_matches_transformers_prefill_and_update():
    c, kw = 11, 4
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, c, generator=gen)
    w = torch.randn(c, kw, generator=gen)
    y, state = causal_conv1d_ref(x, w, None)
    torch.testing.assert_close(y, causal_conv1d_fn(x.t()[None], w, None, activation="silu")[0].t())
    torch.testing.assert_close(state, x[-(kw - 1) :])
    # a short prompt: the state keeps zeros before its first input
    _, short = causal_conv1d_ref(x[:2], w, None)
    torch.testing.assert_close(short, torch.cat([torch.zeros(1, c), x[:2]]))
    # one decode token against transformers' in-place update
    new = torch.randn(2, c, generator=gen)
    states = torch.stack([state, short])
    y1, s1 = causal_conv1d_step_ref(new, w, states)
    hf_state = states.transpose(1, 2).clone()
    want = causal_conv1d_update(new[:, :, None], hf_state, w, None, "silu")[:, :, 0]
    torch.testing.assert_close(y1, want)
    torch.testing.assert_close(s1, hf_state.transpose(1, 2))


def test_gated_rms_norm_matches_transformers():
    norm = Qwen3_5RMSNormGated(DV, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(DV))
    x, z = torch.randn(10, DV), torch.randn(10, DV)
    torch.testing.assert_close(gated_rms_norm_ref(x, z, norm.weight, 1e-6), norm(x, z), rtol=0, atol=0)


def run_pieces(x, q, k, v, g, beta, w, cuts):
    """Run conv + rule over [0, cut_1), [cut_1, cut_2), ... carrying both states; pieces of one token
    go through the decode (step / recurrent) path."""
    conv, ssm = None, None
    outs = []
    bounds = [0, *cuts, x.shape[0]]
    for lo, hi in zip(bounds, bounds[1:]):
        if hi - lo == 1 and conv is not None:
            y, conv1 = causal_conv1d_step_ref(x[lo:hi], w, conv[None])
            conv = conv1[0]
            o, s = recurrent_gated_delta_rule_ref(
                q[None, lo:hi], k[None, lo:hi], v[None, lo:hi], g[None, lo:hi], beta[None, lo:hi], ssm[None]
            )
            o, ssm = o[0], s[0]
        else:
            y, conv = causal_conv1d_ref(x[lo:hi], w, conv)
            o, ssm = chunk_gated_delta_rule_ref(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], ssm)
        outs.append((y, o))
    return torch.cat([y for y, _ in outs]), torch.cat([o for _, o in outs]), conv, ssm


@pytest.mark.parametrize("cuts", [[1], [2, 3], [63, 64, 65], [17, 100, 101, 102], [70]])
def test_split_anywhere_equals_one_pass(cuts):
    t, c = 130, 13
    q, k, v, g, beta = inputs(t, seed=5)
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(t, c, generator=gen), torch.randn(c, 4, generator=gen)
    y_one, o_one, conv_one, ssm_one = run_pieces(x, q, k, v, g, beta, w, [])
    y, o, conv, ssm = run_pieces(x, q, k, v, g, beta, w, cuts)
    torch.testing.assert_close(y, y_one, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(conv, conv_one)
    torch.testing.assert_close(o, o_one, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ssm, ssm_one, rtol=1e-4, atol=1e-5)


def test_gates_match_the_formula():
    a, b = torch.randn(4, HV), torch.randn(4, HV)
    A_log, dt_bias = torch.randn(HV), torch.randn(HV)
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    torch.testing.assert_close(g, -A_log.exp() * F.softplus(a + dt_bias))
    torch.testing.assert_close(beta, torch.sigmoid(b))
    assert (g <= 0).all()


def test_text_only_mrope_is_plain_rope_over_the_rotary_dims():
    """Qwen3.5's M-RoPE (interleaved sections over three position axes) with one position per token on
    every axis, as text tokens have, against our RoPE table over the first 64 of 256 dims."""
    from transformers.models.qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    from overnight.layers.rotary import RotaryEmbedding

    rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}
    rope |= {"mrope_interleaved": True, "mrope_section": [11, 11, 10]}
    cfg = Qwen3_5TextConfig(head_dim=256, num_attention_heads=2, rope_parameters=rope)
    hf = Qwen3_5TextRotaryEmbedding(cfg)
    positions = torch.tensor([0, 1, 7, 100, 4000])
    cos, sin = hf(torch.zeros(1), positions[None, None].expand(3, 1, -1))
    ours = RotaryEmbedding(64, 4096, 1e7)
    table = ours.cos_sin_cache[positions]
    torch.testing.assert_close(cos[0], torch.cat([table[:, :32]] * 2, dim=-1))
    torch.testing.assert_close(sin[0], torch.cat([table[:, 32:]] * 2, dim=-1))
