"""The Gated DeltaNet kernels (kernels/gated_delta_decode.py) against the torch references of
layers/gated_delta.py: the conv step, the delta-rule step and its varlen (prefill) form, with states
read and written in place at slots that are not 0..n-1, sequences starting from zeros over poisoned
slots, and states carried over several steps and chunks. Also the batched varlen conv of the GPU
prefill path, the backend choice, and (GPU machines with fla-core) fla's prefill.

On a CPU-only machine conftest.py turns on the Triton interpreter (fp32/fp16, tiny shapes)."""

from __future__ import annotations

import pytest
import torch

from overnight.kernels.gated_delta_decode import conv_step, delta_step
from overnight.layers.gated_delta import (
    causal_conv1d_ref,
    causal_conv1d_step_ref,
    gdn_gates,
    recurrent_gated_delta_rule_ref,
)
from overnight.layers.gated_delta_ops import varlen_causal_conv1d
from tests.kernel_helpers import DEVICE, DTYPES, TOL

HK, HV, DK, DV, KW = 2, 4, 16, 24, 4  # r = 2 value heads per key head; dv not a power of two
NUM_SLOTS = 7


def _params(dtype: torch.dtype, gen: torch.Generator):
    conv_dim = 2 * HK * DK + HV * DV
    weight = (torch.randn(conv_dim, KW, generator=gen) * 0.5).to(DEVICE, dtype)
    A_log = torch.rand(HV, generator=gen).log().to(DEVICE)
    dt_bias = torch.rand(HV, generator=gen).to(DEVICE, dtype)
    return conv_dim, weight, A_log, dt_bias


def _step_inputs(t: int, conv_dim: int, dtype: torch.dtype, gen: torch.Generator):
    """mixed [t, conv_dim], a, b [t, Hv]: one step's rows of the conv's and the gates' inputs."""
    mixed = torch.randn(t, conv_dim, generator=gen).to(DEVICE, dtype)
    a = torch.randn(t, HV, generator=gen).to(DEVICE, dtype)
    b = torch.randn(t, HV, generator=gen).to(DEVICE, dtype)
    return mixed, a, b


def _split(y: torch.Tensor):
    q, k, v = y.split([HK * DK, HK * DK, HV * DV], dim=-1)  # views, as the model passes them
    n = y.shape[0]
    return q.view(n, HK, DK), k.view(n, HK, DK), v.view(n, HV, DV)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_steps_match_reference_in_place(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    conv_dim, weight, A_log, dt_bias = _params(dtype, gen)
    conv_pool = torch.randn(NUM_SLOTS, KW - 1, conv_dim, generator=gen).to(DEVICE)
    ssm_pool = torch.randn(NUM_SLOTS, HV, DK, DV, generator=gen).to(DEVICE)
    slots = torch.tensor([5, 1, 3], device=DEVICE)
    has = torch.tensor([1.0, 0.0, 1.0], device=DEVICE)
    conv_pool[1], ssm_pool[1] = float("nan"), float("nan")  # a fresh request's slot is never read
    ref_conv, ref_ssm = conv_pool.clone(), ssm_pool.clone()
    ref_conv[1], ref_ssm[1] = 0.0, 0.0
    untouched = [0, 2, 4, 6]
    for step in range(3):  # states carried: the second and third steps continue every sequence
        n = len(slots)
        mixed, a, b = _step_inputs(n, conv_dim, dtype, gen)

        y = conv_step(mixed, weight, conv_pool, slots, has)
        o = delta_step(*_split(y), a, b, A_log, dt_bias, ssm_pool, slots, has)

        y_ref, conv_new = causal_conv1d_step_ref(mixed, weight, ref_conv[slots])
        ref_conv[slots] = conv_new
        g, beta = gdn_gates(a, b, A_log, dt_bias)
        q, k, v = _split(y_ref)
        o_ref, s_new = recurrent_gated_delta_rule_ref(
            q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], ref_ssm[slots]
        )
        ref_ssm[slots] = s_new
        tol = TOL[dtype]
        torch.testing.assert_close(y.float(), y_ref.float(), rtol=tol, atol=tol, msg=f"conv, step {step}")
        torch.testing.assert_close(o.float(), o_ref[:, 0].float(), rtol=tol, atol=tol, msg=f"o, step {step}")
        torch.testing.assert_close(conv_pool[slots], ref_conv[slots], rtol=tol, atol=tol)
        torch.testing.assert_close(ssm_pool[slots], ref_ssm[slots], rtol=1e-4, atol=1e-4)
        has = torch.ones_like(has)
    torch.testing.assert_close(conv_pool[untouched], ref_conv[untouched], rtol=0, atol=0)
    torch.testing.assert_close(ssm_pool[untouched], ref_ssm[untouched], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_prefill_matches_chunked_reference(dtype: torch.dtype) -> None:
    """TritonDeltaRuleOps' prefill without fla (batched conv, then the token-by-token varlen kernel)
    against the torch path (per request, chunked): four prompts, one of a single token, two continuing
    from their slots, two starting from zeros over NaN slots; then a second chunk of two of them."""
    from overnight.layers.gated_delta_ops import (
        DeltaLayer,
        PrefillRows,
        TorchDeltaRuleOps,
        TritonDeltaRuleOps,
    )

    gen = torch.Generator().manual_seed(5)
    conv_dim, weight, A_log, dt_bias = _params(dtype, gen)
    layer = DeltaLayer(HK, HV, DK, DV, weight, A_log, dt_bias)
    conv_pool = torch.randn(NUM_SLOTS, KW - 1, conv_dim, generator=gen).to(DEVICE)
    ssm_pool = (0.1 * torch.randn(NUM_SLOTS, HV, DK, DV, generator=gen)).to(DEVICE)
    conv_pool[[0, 2]], ssm_pool[[0, 2]] = float("nan"), float("nan")
    ref_conv, ref_ssm = conv_pool.clone(), ssm_pool.clone()
    tol = TOL[dtype]
    steps = [([1, 9, 70, 5], [6, 0, 2, 4], [True, False, False, True]), ([3, 66], [4, 0], [True, True])]
    for lens, slots, has in steps:
        rows = PrefillRows.of(lens, slots, has, DEVICE)
        mixed, a, b = _step_inputs(rows.starts[-1], conv_dim, dtype, gen)
        o = TritonDeltaRuleOps(fla_prefill=False).prefill(layer, mixed, a, b, conv_pool, ssm_pool, rows)
        o_ref = TorchDeltaRuleOps().prefill(layer, mixed, a, b, ref_conv, ref_ssm, rows)
        torch.testing.assert_close(o.float(), o_ref.float(), rtol=tol, atol=tol)
        torch.testing.assert_close(ssm_pool[slots], ref_ssm[slots], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(conv_pool[slots], ref_conv[slots], rtol=tol, atol=tol)
    others = [1, 3, 5]
    assert torch.equal(ssm_pool[others], ref_ssm[others]) and torch.equal(conv_pool[others], ref_conv[others])


# One rounding of a float32 value to a 16-bit state, relative: an ulp (2^-7 for bfloat16's 8 significant
# bits, 2^-10 for float16's 11). Round-to-nearest needs half of it; the Triton interpreter's bfloat16
# conversion is not round-to-nearest, so the tests allow the whole ulp. A state rounded at every token
# (or at every element of the update) adds such an error each time, and the outputs, computed from the
# unrounded float32 state, then miss float32's 1e-4: checked by rounding inside the kernel's loop.
STATE_ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def _assert_one_rounding(state: torch.Tensor, ref: torch.Tensor, msg: str) -> None:
    """state (16-bit) is ref (float32) rounded once: within an ulp of each value (float16's subnormal
    range below 2^-14 is absolute)."""
    bound = STATE_ULP[state.dtype] * ref.abs() + 2.0**-24
    err = (state.float() - ref).abs()
    assert (err <= bound).all(), f"{msg}: {(err / (ref.abs() + 1e-12)).max():.2e} relative, past one rounding"


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_decode_steps_with_a_16bit_state(state_dtype: torch.dtype) -> None:
    """mamba_ssm_cache_dtype bfloat16 / float16: the decode kernel widens each slot's state, runs the
    step in float32 (the output matches the float32 reference from the same stored state to float32's
    tolerance) and stores the new state rounded once. Over several steps the 16-bit run stays within
    one rounding a step of the all-float32 run (the decayed delta rule does not amplify an error: a
    decay <= 1 and (I - beta k k^T) with |k| = 1, 0 < beta < 1 are contractions)."""
    gen = torch.Generator().manual_seed(6)
    _, _, A_log, dt_bias = _params(torch.float32, gen)
    pool32 = torch.randn(NUM_SLOTS, HV, DK, DV, generator=gen).to(DEVICE)
    pool = pool32.to(state_dtype)
    pool[1] = float("nan")  # a fresh request's slot is never read
    slots = torch.tensor([5, 1, 3], device=DEVICE)
    has = torch.tensor([1.0, 0.0, 1.0], device=DEVICE)
    ref_all32 = pool32.clone()
    ref_all32[1] = 0.0
    steps = 4
    for step in range(steps):
        q = torch.randn(3, HK, DK, generator=gen).to(DEVICE)
        k = torch.randn(3, HK, DK, generator=gen).to(DEVICE)
        v = torch.randn(3, HV, DV, generator=gen).to(DEVICE)
        a = torch.randn(3, HV, generator=gen).to(DEVICE)
        b = torch.randn(3, HV, generator=gen).to(DEVICE)
        start = torch.where(has[:, None, None, None] != 0, pool[slots].float(), 0.0)  # the stored state
        o = delta_step(q, k, v, a, b, A_log, dt_bias, pool, slots, has)

        g, beta = gdn_gates(a, b, A_log, dt_bias)
        ref = (q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None])
        o_ref, s_ref = recurrent_gated_delta_rule_ref(*ref, start)
        torch.testing.assert_close(o, o_ref[:, 0], rtol=1e-4, atol=1e-4, msg=f"o, step {step}")
        assert pool.dtype == state_dtype
        _assert_one_rounding(pool[slots], s_ref, f"state, step {step}")

        o32, s32 = recurrent_gated_delta_rule_ref(*ref, ref_all32[slots])
        ref_all32[slots] = s32
        drift = (step + 1) * STATE_ULP[state_dtype] * s32.abs().max()  # one rounding per step, at most
        assert (pool[slots].float() - s32).abs().max() <= drift, f"state drift, step {step}"
        assert (o - o32[:, 0]).abs().max() <= drift, f"o drift, step {step}"
        has = torch.ones_like(has)
    assert torch.equal(pool[[0, 2, 4, 6]], pool32[[0, 2, 4, 6]].to(state_dtype))  # other slots untouched


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_varlen_prefill_rounds_a_16bit_state_once_per_sequence(state_dtype: torch.dtype) -> None:
    """The varlen kernel (prefill without fla), the torch path and (GPU machines with fla-core) fla's
    chunked prefill with a 16-bit pool against the chunked float32 reference: each request's final state
    is its float32 state rounded once (a state rounded at each of 40 tokens would be past the bound),
    the outputs those of float32 from the stored state (fla: to its tf32 dots' 2e-3 besides)."""
    from overnight.layers.gated_delta_ops import (
        DeltaLayer,
        PrefillRows,
        TorchDeltaRuleOps,
        TritonDeltaRuleOps,
        fla_importable,
    )

    gen = torch.Generator().manual_seed(7)
    conv_dim, weight, A_log, dt_bias = _params(torch.float32, gen)
    layer = DeltaLayer(HK, HV, DK, DV, weight, A_log, dt_bias)
    conv0 = torch.randn(NUM_SLOTS, KW - 1, conv_dim, generator=gen).to(DEVICE)
    ssm0 = (0.1 * torch.randn(NUM_SLOTS, HV, DK, DV, generator=gen)).to(DEVICE, state_dtype)
    ssm0[[0, 2]] = float("nan")
    ops = {"triton": TritonDeltaRuleOps(fla_prefill=False), "torch": TorchDeltaRuleOps()}
    if DEVICE == "cuda" and fla_importable():
        ops["fla"] = TritonDeltaRuleOps(fla_prefill=True)
    pools = {name: (conv0.clone(), ssm0.clone()) for name in ops}
    for lens, slots, has in [
        ([1, 9, 40, 5], [6, 0, 2, 4], [True, False, False, True]),
        ([3, 20], [4, 0], [True] * 2),
    ]:
        rows = PrefillRows.of(lens, slots, has, DEVICE)
        mixed, a, b = _step_inputs(rows.starts[-1], conv_dim, torch.float32, gen)
        for name, (conv_pool, ssm_pool) in pools.items():
            # the float32 reference from this path's own stored states (widened), conv states alike
            ref_conv, ref_ssm = conv_pool.clone(), ssm_pool.float()
            o = ops[name].prefill(layer, mixed, a, b, conv_pool, ssm_pool, rows)
            o_ref = TorchDeltaRuleOps().prefill(layer, mixed, a, b, ref_conv, ref_ssm, rows)
            assert ssm_pool.dtype == state_dtype
            if name == "fla":  # its dots run in tf32 on fp32 inputs (test_fla_prefill_matches_reference)
                torch.testing.assert_close(o, o_ref, rtol=2e-3, atol=2e-3, msg=name)
                tol = 2e-3 + STATE_ULP[state_dtype]
                torch.testing.assert_close(ssm_pool[slots].float(), ref_ssm[slots], rtol=tol, atol=tol)
            else:
                torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-4, msg=name)
                _assert_one_rounding(ssm_pool[slots], ref_ssm[slots], f"{name}, {lens}")
            torch.testing.assert_close(conv_pool[slots], ref_conv[slots], rtol=1e-5, atol=1e-5)


def test_decode_step_rejects_bad_inputs() -> None:
    gen = torch.Generator().manual_seed(1)
    conv_dim, weight, A_log, dt_bias = _params(torch.float32, gen)
    pool = torch.zeros(NUM_SLOTS, HV, DK, DV, device=DEVICE)
    y = torch.randn(2, conv_dim, device=DEVICE)
    a = b = torch.randn(2, HV, device=DEVICE)
    slots, has = torch.tensor([0, 1], device=DEVICE), torch.ones(2, device=DEVICE)
    with pytest.raises(ValueError, match="float32"):
        delta_step(*_split(y), a, b, A_log, dt_bias, pool.double(), slots, has)
    with pytest.raises(ValueError, match="ssm_pool"):
        delta_step(*_split(y), a, b, A_log, dt_bias, pool[:, :, :, :8], slots, has)
    with pytest.raises(ValueError, match="slot_ids"):
        delta_step(*_split(y), a, b, A_log, dt_bias, pool, slots[:1], has)
    with pytest.raises(ValueError, match="conv_pool"):
        conv_step(y, weight, torch.zeros(NUM_SLOTS, KW, conv_dim, device=DEVICE), slots, has)


def test_varlen_conv_matches_per_sequence_reference() -> None:
    gen = torch.Generator().manual_seed(2)
    c, lens = 10, [5, 1, 9, 2]  # a one-token sequence, and ones shorter than the window
    weight = torch.randn(c, KW, generator=gen)
    x = torch.randn(sum(lens), c, generator=gen)
    pool = torch.randn(NUM_SLOTS, KW - 1, c, generator=gen)
    slots, has = [4, 0, 6, 2], [True, False, True, False]
    pool[0] = float("nan")  # a fresh sequence's slot is never read
    starts = torch.tensor([0, *lens]).cumsum(0)
    want_pool = pool.clone()
    want = []
    for i, (lo, hi) in enumerate(zip(starts[:-1].tolist(), starts[1:].tolist())):
        out, st = causal_conv1d_ref(x[lo:hi], weight, pool[slots[i]] if has[i] else None)
        want.append(out)
        want_pool[slots[i]] = st
    y = varlen_causal_conv1d(x, weight, pool, starts.tolist(), slots, has)
    torch.testing.assert_close(y, torch.cat(want), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pool, want_pool, rtol=0, atol=0, equal_nan=True)


@pytest.mark.slow  # an engine and transformers, the kernels through the interpreter
def test_models_token_exact_with_triton_ops(tmp_path, monkeypatch) -> None:
    """The GPU path's wiring on the CPU: TritonDeltaRuleOps without fla (decode kernels, batched conv
    and the varlen kernel for prefill) in a Qwen3-Next engine, fp32 greedy, token-exact with
    transformers; chunked prefill mixes decodes with later chunks, and decode steps also run padded as
    CUDA graphs replay them (padding rows on the scratch slot)."""
    import overnight.models.gated_deltanet as gdn_model
    from overnight import LLM, SamplingParams
    from overnight.layers.gated_delta_ops import TritonDeltaRuleOps
    from overnight.runner.cuda_graph import DecodeGraphs
    from tests.test_engine_parity import hf_greedy
    from tests.test_hybrid_models import load_hf, prompts_of
    from tests.tiny_hybrid import make_hybrid_checkpoint

    ops = TritonDeltaRuleOps(fla_prefill=False)
    monkeypatch.setattr(gdn_model, "delta_rule_ops", lambda x: ops)
    folder = make_hybrid_checkpoint(tmp_path, "qwen3_next")
    ref = load_hf(folder, "qwen3_next")
    llm = LLM(
        str(folder),
        skip_tokenizer_init=True,
        dtype="float32",
        device=DEVICE,  # Triton ops need the GPU on a GPU host (the interpreter only on the CPU)
        block_size=4,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        max_model_len=128,
    )
    runner = llm.engine.runner  # type: ignore[attr-defined]
    graphs = DecodeGraphs(runner.model, runner.attention_batch, runner.kv_caches, runner.buffers, 4, 128)
    replayed: list[int] = []

    def replay(b: int) -> torch.Tensor:
        replayed.append(b)
        return graphs._forward(b)

    graphs.replay = replay  # type: ignore[method-assign]
    runner.graphs = graphs
    prompts = prompts_of([1, 7, 30], seed=3)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(ref, prompt, 6)[0], f"{len(prompt)} tokens"
    assert 4 in replayed  # three decodes padded to the bucket of 4


def test_backend_choice_by_device(monkeypatch) -> None:
    import sys

    from overnight.kernels import dispatch
    from overnight.layers.gated_delta_ops import delta_rule_ops

    x = torch.zeros(2, 3)
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", None)
    assert delta_rule_ops(x).name == "torch"
    monkeypatch.setattr(dispatch, "FORCE_KERNELS", True)
    assert delta_rule_ops(x).name == "triton"  # fla only ever for CUDA inputs
    if not torch.cuda.is_available():
        assert "fla" not in sys.modules  # the CPU path never imports it


@pytest.mark.skipif(DEVICE != "cuda", reason="fla-core's kernels need a GPU (not the interpreter)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_prefill_matches_reference(dtype: torch.dtype) -> None:
    """One varlen fla call over four prompts (two continuing from their slots) against the torch
    path's per-request chunked rule, then a second chunk of one of them."""
    from overnight.layers.gated_delta_ops import (
        DeltaLayer,
        PrefillRows,
        TorchDeltaRuleOps,
        TritonDeltaRuleOps,
        fla_importable,
    )

    if not fla_importable():
        pytest.skip("fla-core is not installed (the gpu extra)")
    gen = torch.Generator().manual_seed(4)
    conv_dim, weight, A_log, dt_bias = _params(dtype, gen)
    layer = DeltaLayer(HK, HV, DK, DV, weight, A_log, dt_bias)
    conv_pool = torch.randn(NUM_SLOTS, KW - 1, conv_dim, generator=gen).to(DEVICE)
    ssm_pool = (0.1 * torch.randn(NUM_SLOTS, HV, DK, DV, generator=gen)).to(DEVICE)
    ref_conv, ref_ssm = conv_pool.clone(), ssm_pool.clone()
    tol = 2e-3 if dtype == torch.float32 else 2e-2  # fla's dots run in tf32 on fp32 inputs
    for lens, slots, has in [
        ([1, 63, 100, 130], [6, 0, 2, 4], [True, False, False, True]),
        ([70], [4], [True]),
    ]:
        rows = PrefillRows.of(lens, slots, has, DEVICE)
        mixed, a, b = _step_inputs(rows.starts[-1], conv_dim, dtype, gen)
        o = TritonDeltaRuleOps(fla_prefill=True).prefill(layer, mixed, a, b, conv_pool, ssm_pool, rows)
        o_ref = TorchDeltaRuleOps().prefill(layer, mixed, a, b, ref_conv, ref_ssm, rows)
        torch.testing.assert_close(o.float(), o_ref.float(), rtol=tol, atol=tol)
        torch.testing.assert_close(ssm_pool, ref_ssm, rtol=tol, atol=tol)
        torch.testing.assert_close(conv_pool, ref_conv, rtol=tol, atol=tol)
