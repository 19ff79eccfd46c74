"""LFM2's short-conv ops (layers/short_conv_ops.py): the Triton path (the conv step kernel without its
activation, the batched varlen prefill conv) against the torch references, and both against one causal
conv over each whole sequence. On a CPU-only machine conftest.py turns on the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

from overnight.attention.linear_state import LinearStateBatch
from overnight.layers.gated_delta_ops import PrefillRows
from overnight.layers.short_conv_ops import ShortConvLayer, TorchShortConvOps, TritonShortConvOps
from tests.kernel_helpers import DEVICE, DTYPES, TOL

C, K, SLOTS = 24, 3, 6


def _states(slots: list[int], has: list[bool]) -> LinearStateBatch:
    flags = torch.tensor([1.0 if h else 0.0 for h in has], device=DEVICE)
    return LinearStateBatch([], [], torch.tensor(slots, device=DEVICE), flags, slots, has)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_the_kernel_ops_match_the_torch_ops_across_split_sequences(dtype: torch.dtype, bias: bool) -> None:
    """Prefill pieces (one from zeros over a NaN slot, one continuing), then two decode steps, on both
    backends from equal pools: outputs (no activation) and pools agree; split anywhere, each sequence's
    outputs equal one causal conv over it."""
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(C, K, generator=gen) * 0.5).to(DEVICE, dtype)
    b = (0.2 * torch.randn(C, generator=gen)).to(DEVICE, dtype) if bias else None
    layer = ShortConvLayer(weight, b)
    pools = []
    outs: list[list[torch.Tensor]] = []
    lens, slots = [5, 3], [4, 1]
    prefill_1 = torch.randn(sum(lens), C, generator=gen).to(DEVICE, dtype)
    prefill_2 = torch.randn(sum(lens), C, generator=gen).to(DEVICE, dtype)
    steps = [torch.randn(2, C, generator=gen).to(DEVICE, dtype) for _ in range(2)]
    for ops in (TorchShortConvOps(), TritonShortConvOps()):
        pool = torch.full((SLOTS, K - 1, C), float("nan"), device=DEVICE)
        ssm = torch.zeros(SLOTS, 0, 0, 0, device=DEVICE)
        got = [ops.prefill(layer, prefill_1, pool, ssm, PrefillRows.of(lens, slots, [False, False], DEVICE))]
        got.append(
            ops.prefill(layer, prefill_2, pool, ssm, PrefillRows.of(lens, slots, [True, True], DEVICE))
        )
        for u in steps:
            got.append(ops.decode(layer, u, pool, ssm, _states(slots, [True, True])))
        pools.append(pool[slots])
        outs.append(got)
    for a, c in zip(*outs):
        torch.testing.assert_close(a, c, rtol=TOL[dtype], atol=TOL[dtype])
    torch.testing.assert_close(pools[0], pools[1], rtol=TOL[dtype], atol=TOL[dtype])
    # sequence 0, whole: its rows of each piece, then its decode rows
    whole = torch.cat([prefill_1[:5], prefill_2[:5], steps[0][:1], steps[1][:1]]).float()
    ref = torch.nn.functional.conv1d(
        torch.nn.functional.pad(whole.t(), (K - 1, 0))[None],
        weight.float()[:, None],
        None if b is None else b.float(),
        groups=C,
    )[0].t()
    mine = torch.cat([outs[0][0][:5], outs[0][1][:5], outs[0][2][:1], outs[0][3][:1]]).float()
    torch.testing.assert_close(mine, ref, rtol=TOL[dtype] * 4, atol=TOL[dtype] * 4)
