"""The Mamba2 kernels (kernels/mamba2_scan.py, and conv_step with a bias) against the torch references of
layers/mamba2.py: the chunked SSD form against the token recurrence (and a sequence split anywhere), the
decode step and the varlen (prefill) form with states read and written in place at slots that are not
0..n-1, sequences starting from zeros over NaN slots, states carried over several steps and chunks, a
16-bit state pool (rounded once per step), the dt limit, and the wrapper's checks.

On a CPU-only machine conftest.py turns on the Triton interpreter (fp32/fp16, tiny shapes)."""

from __future__ import annotations

import pytest
import torch

from overnight.attention.linear_state import LinearStateBatch
from overnight.kernels.mamba2_chunked import ssd_varlen_chunked
from overnight.kernels.mamba2_scan import ssd_step, ssd_varlen
from overnight.layers.gated_delta_ops import PrefillRows
from overnight.layers.mamba2 import mamba2_dt, ssd_chunk_ref, ssd_step_ref
from overnight.layers.mamba2_ops import Mamba2Layer, TorchMamba2Ops, TritonMamba2Ops
from tests.kernel_helpers import DEVICE, DTYPES, TOL

H, G, P, N, KW = 4, 2, 12, 8, 4  # 2 heads per B/C group; P not a power of two
CONV_DIM = H * P + 2 * G * N
NUM_SLOTS = 7


def _layer(dtype: torch.dtype, gen: torch.Generator, dt_limit=(0.0, float("inf"))) -> Mamba2Layer:
    weight = (torch.randn(CONV_DIM, KW, generator=gen) * 0.5).to(DEVICE, dtype)
    bias = (0.2 * torch.randn(CONV_DIM, generator=gen)).to(DEVICE, dtype)
    A_log = torch.randn(H, generator=gen).to(DEVICE)
    dt_bias = torch.randn(H, generator=gen).to(DEVICE, dtype)
    D = torch.randn(H, generator=gen).to(DEVICE, dtype)
    return Mamba2Layer(H, P, G, N, weight, bias, A_log, dt_bias, D, dt_limit)


def _inputs(t: int, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's rows as the mixer hands them over: views into one in_proj output (x|B|C, then dt)."""
    proj = torch.randn(t, CONV_DIM + H, generator=gen).to(DEVICE, dtype)
    xbc, dt = proj.split([CONV_DIM, H], dim=-1)
    return xbc, dt


def _states(n: int, slots: list[int], has: list[bool]) -> LinearStateBatch:
    return LinearStateBatch(
        [],
        [],
        torch.tensor(slots, device=DEVICE),
        torch.tensor([1.0 if h else 0.0 for h in has], device=DEVICE),
        slots,
        has,
    )


def test_chunked_form_matches_the_recurrence_and_splits_anywhere() -> None:
    gen = torch.Generator().manual_seed(0)
    t = 11
    x = torch.randn(t, H, P, generator=gen)
    dt = mamba2_dt(torch.randn(t, H, generator=gen), torch.randn(H, generator=gen), (0.0, float("inf")))
    A = -torch.rand(H, generator=gen).exp()
    B, C = torch.randn(t, G, N, generator=gen), torch.randn(t, G, N, generator=gen)
    D = torch.randn(H, generator=gen)
    s0 = torch.randn(H, P, N, generator=gen)
    s, ys = s0[None], []
    for i in range(t):  # token by token
        y, s = ssd_step_ref(x[i : i + 1], dt[i : i + 1], A, B[i : i + 1], C[i : i + 1], D, s)
        ys.append(y)
    y_rec = torch.cat(ys)
    for chunk in (4, 16):  # a ragged last chunk; one chunk longer than the sequence
        y, s_end = ssd_chunk_ref(x, dt, A, B, C, D, s0, chunk=chunk)
        torch.testing.assert_close(y, y_rec, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(s_end, s[0], rtol=1e-4, atol=1e-4)
    y1, s1 = ssd_chunk_ref(x[:5], dt[:5], A, B[:5], C[:5], D, s0, chunk=4)
    y2, s2 = ssd_chunk_ref(x[5:], dt[5:], A, B[5:], C[5:], D, s1, chunk=4)
    torch.testing.assert_close(torch.cat([y1, y2]), y_rec, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s2, s[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_steps_match_reference_in_place(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    layer = _layer(dtype, gen)
    conv_pool = torch.randn(NUM_SLOTS, KW - 1, CONV_DIM, generator=gen).to(DEVICE)
    ssm_pool = torch.randn(NUM_SLOTS, H, P, N, generator=gen).to(DEVICE)
    conv_pool[1], ssm_pool[1] = float("nan"), float("nan")  # a fresh request's slot is never read
    ref_conv, ref_ssm = conv_pool.clone(), ssm_pool.clone()
    slots, has = [5, 1, 3], [True, False, True]
    untouched = [0, 2, 4, 6]
    tol = TOL[dtype]
    for step in range(3):  # states carried: later steps continue every sequence
        st = _states(3, slots, has)
        xbc, dt = _inputs(3, dtype, gen)
        y = TritonMamba2Ops().decode(layer, xbc, dt, conv_pool, ssm_pool, st)
        y_ref = TorchMamba2Ops().decode(layer, xbc, dt, ref_conv, ref_ssm, st)
        torch.testing.assert_close(y.float(), y_ref.float(), rtol=tol, atol=tol, msg=f"y, step {step}")
        torch.testing.assert_close(conv_pool[slots], ref_conv[slots], rtol=tol, atol=tol)
        torch.testing.assert_close(ssm_pool[slots], ref_ssm[slots], rtol=tol, atol=tol)
        has = [True] * 3
    torch.testing.assert_close(conv_pool[untouched], ref_conv[untouched], rtol=0, atol=0)
    torch.testing.assert_close(ssm_pool[untouched], ref_ssm[untouched], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_prefill_matches_chunked_reference(dtype: torch.dtype) -> None:
    """TritonMamba2Ops' prefill (batched conv, then one varlen launch) against the torch path (per
    request, chunked): four prompts, one of a single token, two continuing from their slots, two
    starting from zeros over NaN slots; then a second chunk of two of them."""
    gen = torch.Generator().manual_seed(2)
    layer = _layer(dtype, gen)
    conv_pool = torch.randn(NUM_SLOTS, KW - 1, CONV_DIM, generator=gen).to(DEVICE)
    ssm_pool = (0.1 * torch.randn(NUM_SLOTS, H, P, N, generator=gen)).to(DEVICE)
    conv_pool[[0, 2]], ssm_pool[[0, 2]] = float("nan"), float("nan")
    ref_conv, ref_ssm = conv_pool.clone(), ssm_pool.clone()
    tol = TOL[dtype] * 5  # 70 tokens of recurrence in 16 bits
    steps = [([1, 9, 70, 5], [6, 0, 2, 4], [True, False, False, True]), ([3, 66], [4, 0], [True, True])]
    for lens, slots, has in steps:
        rows = PrefillRows.of(lens, slots, has, DEVICE)
        xbc, dt = _inputs(rows.starts[-1], dtype, gen)
        y = TritonMamba2Ops().prefill(layer, xbc, dt, conv_pool, ssm_pool, rows)
        y_ref = TorchMamba2Ops().prefill(layer, xbc, dt, ref_conv, ref_ssm, rows)
        torch.testing.assert_close(y.float(), y_ref.float(), rtol=tol, atol=tol, msg=f"lens {lens}")
        torch.testing.assert_close(conv_pool[slots], ref_conv[slots], rtol=tol, atol=tol)
        torch.testing.assert_close(ssm_pool[slots], ref_ssm[slots], rtol=tol, atol=tol)
    for slot in (1, 3, 5):  # never scheduled
        assert torch.equal(ssm_pool[slot], ref_ssm[slot])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk", [16, 32])
def test_chunked_varlen_matches_token_by_token(dtype: torch.dtype, chunk: int) -> None:
    """The prefill kernel the engine runs (chunks as matrix products) against the token-by-token one:
    sequences of 1, 9, 70 (several chunks, a ragged last one) and 5 tokens, two continuing from their
    slots, one from zeros over a NaN slot; a float16 state pool."""
    gen = torch.Generator().manual_seed(6)
    layer = _layer(dtype, gen)
    lens = [1, 9, 70, 5]
    t = sum(lens)
    x = torch.randn(t, H, P, generator=gen).to(DEVICE, dtype)
    dt = torch.randn(t, H, generator=gen).to(DEVICE, dtype)
    B, C = (torch.randn(t, G, N, generator=gen).to(DEVICE, dtype) for _ in range(2))
    rows = PrefillRows.of(lens, [6, 0, 2, 4], [True, True, False, True], DEVICE)
    args = (layer.A_log, layer.dt_bias, layer.D)
    for pool_dtype in (torch.float32, torch.float16):
        pool = (0.5 * torch.randn(NUM_SLOTS, H, P, N, generator=gen)).to(DEVICE, pool_dtype)
        pool[2] = float("nan")
        ref_pool = pool.clone()
        y = ssd_varlen_chunked(
            x, dt, B, C, *args, pool, rows.slot_ids, rows.has_state_dev, rows.cu_seqlens, chunk=chunk
        )
        y_ref = ssd_varlen(x, dt, B, C, *args, ref_pool, rows.slot_ids, rows.has_state_dev, rows.cu_seqlens)
        tol = TOL[dtype] * 5
        torch.testing.assert_close(y.float(), y_ref.float(), rtol=tol, atol=tol, msg=f"y, {pool_dtype} pool")
        torch.testing.assert_close(
            pool.float(), ref_pool.float(), rtol=tol, atol=tol, msg=f"{pool_dtype} pool"
        )
        assert torch.equal(pool[[1, 3, 5]], ref_pool[[1, 3, 5]])  # never scheduled
    with pytest.raises(ValueError, match="powers of two, at least 16"):
        ssd_varlen_chunked(
            x, dt, B, C, *args, pool, rows.slot_ids, rows.has_state_dev, rows.cu_seqlens, chunk=8
        )


@pytest.mark.parametrize("mode", ["step", "varlen", "chunked"])
def test_limited_dt_and_a_16bit_pool_rounded_once(mode: str) -> None:
    """dt clamped to time_step_limit (both ends reached); a float16 state pool computed in float32 and
    rounded once, as the state is stored: the reference run from the same float16 start, rounded."""
    gen = torch.Generator().manual_seed(3)
    limit = (0.05, 0.4)
    layer = _layer(torch.float32, gen, dt_limit=limit)
    varlen = mode != "step"
    t = 6 if varlen else 2
    x = torch.randn(t, H, P, generator=gen).to(DEVICE)
    B, C = torch.randn(t, G, N, generator=gen).to(DEVICE), torch.randn(t, G, N, generator=gen).to(DEVICE)
    dt = (3 * torch.randn(t, H, generator=gen)).to(DEVICE)
    step = mamba2_dt(dt, layer.dt_bias, limit)
    assert (step == limit[0]).any() and (step == limit[1]).any()
    pool = torch.randn(3, H, P, N, generator=gen).half().to(DEVICE)
    start = pool.float()
    slots, has = torch.tensor([2, 0], device=DEVICE), torch.ones(2, device=DEVICE)
    args = (layer.A_log, layer.dt_bias, layer.D)
    A = -layer.A_log.exp()
    bounds = ((0, 4), (4, 6)) if varlen else ((0, 1), (1, 2))
    if varlen:
        run = ssd_varlen_chunked if mode == "chunked" else ssd_varlen
        y = run(x, dt, B, C, *args, pool, slots, has, torch.tensor([0, 4, 6], device=DEVICE), dt_limit=limit)
    else:
        y = ssd_step(x, dt, B, C, *args, pool, slots, has, dt_limit=limit)
    for (lo, hi), slot in zip(bounds, (2, 0)):
        y_ref, s_ref = ssd_chunk_ref(x[lo:hi], step[lo:hi], A, B[lo:hi], C[lo:hi], layer.D, start[slot])
        torch.testing.assert_close(y[lo:hi], y_ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(pool[slot], s_ref.half(), rtol=1e-3, atol=1e-3)
    assert torch.equal(pool[1], start[1].half())  # never scheduled


def test_wrapper_refuses_bad_shapes() -> None:
    gen = torch.Generator().manual_seed(4)
    layer = _layer(torch.float32, gen)
    x = torch.randn(2, H, P, device=DEVICE)
    dt = torch.randn(2, H, device=DEVICE)
    B = C = torch.randn(2, G, N, device=DEVICE)
    slots, has = torch.tensor([0, 1], device=DEVICE), torch.ones(2, device=DEVICE)
    args = (layer.A_log, layer.dt_bias, layer.D)
    with pytest.raises(ValueError, match="ssm_pool must be"):
        ssd_step(x, dt, B, C, *args, torch.zeros(3, H, N, P, device=DEVICE), slots, has)
    with pytest.raises(ValueError, match="has_state must be"):
        ssd_step(x, dt, B, C, *args, torch.zeros(3, H, P, N, device=DEVICE), slots, has.double())
    with pytest.raises(ValueError, match="do not fit"):
        ssd_step(
            x, dt, B[:, :1].expand(2, 3, N), C, *args, torch.zeros(3, H, P, N, device=DEVICE), slots, has
        )
