"""How LFM2's gated short convolution runs its conv over one step's rows: the backend choice, in one place
(the same pattern as layers/mamba2_ops.py, whose conv ops it reuses without their SiLU).

The short conv is a depthwise causal conv of K taps (LFM2: 3) over its input u = B * x, with no
activation after it; its per-request state is the conv's alone, the last K - 1 values of u
(runner/state_cache.py's conv pool, [slots, K - 1, hidden] float32; the ssm pool is empty). A
sequence may be split anywhere: the pieces run one after another, each from the state the previous one
left, give the whole sequence's outputs.

    TorchShortConvOps   the CPU path and the reference: layers/gated_delta.py's conv refs, decode rows
                        batched (states gathered by slot and scattered back), prefill rows one request
                        at a time
    TritonShortConvOps  decode rows through conv_step (kernels/gated_delta_decode.py; states shifted in
                        place at their slots, no host sync: capturable); prefill rows of the whole step
                        in one batched conv (layers/gated_delta_ops.py's varlen_causal_conv1d)

short_conv_ops(x) picks one by the input's device (kernels/dispatch.py's use_kernels, which tests can
force). Both take the step's rows decodes first (attention/metadata.py) and return conv(u) + bias [T, C]
in u's dtype; the ssm pool argument is there for decode_then_prefill's common signature and is unused.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

import torch

from overnight.attention.linear_state import LinearStateBatch
from overnight.kernels.dispatch import use_kernels
from overnight.layers.gated_delta import causal_conv1d_ref, causal_conv1d_step_ref
from overnight.layers.gated_delta_ops import PrefillRows, varlen_causal_conv1d


@dataclass(frozen=True)
class ShortConvLayer:
    """One layer's conv, as the ops need it."""

    weight: torch.Tensor  # [C, K] contiguous
    bias: torch.Tensor | None  # [C]


class ShortConvOps(Protocol):
    name: str

    def decode(
        self,
        layer: ShortConvLayer,
        u: torch.Tensor,
        conv_pool: torch.Tensor,
        ssm_pool: torch.Tensor,
        st: LinearStateBatch,
    ) -> torch.Tensor:
        """One token per request (rows 0 .. N of st); captured in CUDA graphs on the GPU."""
        ...

    def prefill(
        self,
        layer: ShortConvLayer,
        u: torch.Tensor,
        conv_pool: torch.Tensor,
        ssm_pool: torch.Tensor,
        rows: PrefillRows,
    ) -> torch.Tensor:
        """Whole or partial prompts, each continuing from its slot when has_state (never captured)."""
        ...


class TorchShortConvOps:
    name = "torch"

    def decode(
        self,
        layer: ShortConvLayer,
        u: torch.Tensor,
        conv_pool: torch.Tensor,
        ssm_pool: torch.Tensor,
        st: LinearStateBatch,
    ) -> torch.Tensor:
        idx, keep = st.decode_slots(u.shape[0])
        # where, not a product: a slot's old contents are ignored, whatever they hold
        conv_in = torch.where(keep[:, None, None] != 0, conv_pool[idx], 0.0)
        y, conv_new = causal_conv1d_step_ref(u, layer.weight, conv_in, layer.bias, silu=False)
        conv_pool.index_copy_(0, idx, conv_new)
        return y

    def prefill(
        self,
        layer: ShortConvLayer,
        u: torch.Tensor,
        conv_pool: torch.Tensor,
        ssm_pool: torch.Tensor,
        rows: PrefillRows,
    ) -> torch.Tensor:
        out = torch.empty_like(u)
        for i, slot in enumerate(rows.slots):
            lo, hi = rows.starts[i], rows.starts[i + 1]
            state = conv_pool[slot] if rows.has_state[i] else None
            out[lo:hi], conv_pool[slot] = causal_conv1d_ref(
                u[lo:hi], layer.weight, state, layer.bias, silu=False
            )
        return out


class TritonShortConvOps:
    name = "triton"

    def decode(
        self,
        layer: ShortConvLayer,
        u: torch.Tensor,
        conv_pool: torch.Tensor,
        ssm_pool: torch.Tensor,
        st: LinearStateBatch,
    ) -> torch.Tensor:
        from overnight.kernels.gated_delta_decode import conv_step

        idx, keep = st.decode_slots(u.shape[0])
        return conv_step(u, layer.weight, conv_pool, idx, keep, bias=layer.bias, silu=False)

    def prefill(
        self,
        layer: ShortConvLayer,
        u: torch.Tensor,
        conv_pool: torch.Tensor,
        ssm_pool: torch.Tensor,
        rows: PrefillRows,
    ) -> torch.Tensor:
        return varlen_causal_conv1d(
            u, layer.weight, conv_pool, rows.starts, rows.slots, rows.has_state, layer.bias, silu=False
        )


_TORCH = TorchShortConvOps()


def short_conv_ops(x: torch.Tensor) -> ShortConvOps:
    """The ops for a layer input x (see the module docstring)."""
    return _triton_ops() if use_kernels(x) else _TORCH


@functools.cache
def _triton_ops() -> TritonShortConvOps:
    return TritonShortConvOps()
