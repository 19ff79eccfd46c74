"""How a Mamba2 mixer runs its conv and SSM over one step's rows: the backend choice, in one place (the
same pattern as layers/gated_delta_ops.py, whose conv ops and prefill bookkeeping it shares).

    TorchMamba2Ops   the CPU path and the reference: layers/mamba2.py's ops, decode rows batched (states
                     gathered from the pool by slot and scattered back), prefill rows one request at a
                     time with the chunked SSD form
    TritonMamba2Ops  kernels: decode rows through conv_step (kernels/gated_delta_decode.py) and ssd_step
                     (kernels/mamba2_scan.py), states updated in place at their slots (capturable);
                     prefill rows of the whole step through one batched conv and one launch of
                     ssd_varlen_chunked (chunks of 32 tokens as small matrix products)

mamba2_ops(x) picks one by the input's device (kernels/dispatch.py's use_kernels, which tests can force).
Both take the step's rows decodes first (attention/metadata.py): `xbc` the x|B|C projection [T, conv_dim]
before the conv, `dt` the raw step-size projection [T, H], and the slot of each request
(runner/state_cache.py). They return the SSM's output y [T, H, P] (D x included, before the gated norm).

The ssm pool may be 16-bit (mamba_ssm_cache_dtype): every path widens a request's state to float32 when
it reads it, runs the step in float32 and rounds once when it writes the final state back.
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
from overnight.layers.mamba2 import mamba2_dt, ssd_chunk_ref, ssd_step_ref


@dataclass(frozen=True)
class Mamba2Layer:
    """One mixer's sizes and parameters, as the ops need them."""

    num_heads: int
    head_dim: int
    n_groups: int
    d_state: int
    conv_weight: torch.Tensor  # [conv_dim, K]
    conv_bias: torch.Tensor | None  # [conv_dim]
    A_log: torch.Tensor  # [H]
    dt_bias: torch.Tensor  # [H]
    D: torch.Tensor  # [H]
    dt_limit: tuple[float, float]

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv output [N, conv_dim] -> views x [N, H, P], B and C [N, G, d_state]."""
        inner, gs = self.num_heads * self.head_dim, self.n_groups * self.d_state
        x, B, C = y.split([inner, gs, gs], dim=-1)
        n = y.shape[0]
        return (
            x.view(n, self.num_heads, self.head_dim),
            B.view(n, self.n_groups, self.d_state),
            C.view(n, self.n_groups, self.d_state),
        )


class Mamba2Ops(Protocol):
    name: str

    def decode(
        self,
        layer: Mamba2Layer,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        conv_pool: torch.Tensor,
        ssm_pool: torch.Tensor,
        st: LinearStateBatch,
    ) -> torch.Tensor:
        """One token per request (rows 0 .. N of st); captured in CUDA graphs on the GPU."""
        ...

    def prefill(
        self,
        layer: Mamba2Layer,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        conv_pool: torch.Tensor,
        ssm_pool: torch.Tensor,
        rows: PrefillRows,
    ) -> torch.Tensor:
        """Whole or partial prompts, each continuing from its slot when has_state (never captured)."""
        ...


class TorchMamba2Ops:
    name = "torch"

    def decode(
        self,
        layer: Mamba2Layer,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        conv_pool: torch.Tensor,
        ssm_pool: torch.Tensor,
        st: LinearStateBatch,
    ) -> torch.Tensor:
        idx, keep = st.decode_slots(xbc.shape[0])
        # where, not a product: a slot's old contents are ignored, whatever they hold
        conv_in = torch.where(keep[:, None, None] != 0, conv_pool[idx], 0.0)
        y, conv_new = causal_conv1d_step_ref(xbc, layer.conv_weight, conv_in, layer.conv_bias)
        conv_pool.index_copy_(0, idx, conv_new)
        x, B, C = layer.split(y)
        step = mamba2_dt(dt, layer.dt_bias, layer.dt_limit)
        s0 = torch.where(keep[:, None, None, None] != 0, ssm_pool[idx].float(), 0.0)
        out, s = ssd_step_ref(x, step, -layer.A_log.float().exp(), B, C, layer.D, s0)
        ssm_pool.index_copy_(0, idx, s.to(ssm_pool.dtype))  # float32 -> the pool's dtype: one rounding
        return out

    def prefill(
        self,
        layer: Mamba2Layer,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        conv_pool: torch.Tensor,
        ssm_pool: torch.Tensor,
        rows: PrefillRows,
    ) -> torch.Tensor:
        step = mamba2_dt(dt, layer.dt_bias, layer.dt_limit)
        A = -layer.A_log.float().exp()
        out = xbc.new_empty(xbc.shape[0], layer.num_heads, layer.head_dim)
        for i, slot in enumerate(rows.slots):
            lo, hi, has = rows.starts[i], rows.starts[i + 1], rows.has_state[i]
            conv_in = conv_pool[slot] if has else None
            y, conv_new = causal_conv1d_ref(xbc[lo:hi], layer.conv_weight, conv_in, layer.conv_bias)
            conv_pool[slot] = conv_new
            x, B, C = layer.split(y)
            o, s = ssd_chunk_ref(x, step[lo:hi], A, B, C, layer.D, ssm_pool[slot] if has else None)
            ssm_pool[slot] = s  # rounded once to the pool's dtype (the copy casts)
            out[lo:hi] = o
        return out


class TritonMamba2Ops:
    name = "triton"

    def __init__(self, chunked_prefill: bool = True) -> None:
        # False: prefill through the token-by-token ssd_varlen, the chunked kernel's reference on the GPU
        # and bench/mamba2_gpu.py's baseline (same arguments, same result up to rounding)
        self.chunked_prefill = chunked_prefill

    def decode(
        self,
        layer: Mamba2Layer,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        conv_pool: torch.Tensor,
        ssm_pool: torch.Tensor,
        st: LinearStateBatch,
    ) -> torch.Tensor:
        from overnight.kernels.gated_delta_decode import conv_step
        from overnight.kernels.mamba2_scan import ssd_step

        idx, keep = st.decode_slots(xbc.shape[0])
        y = conv_step(xbc, layer.conv_weight, conv_pool, idx, keep, bias=layer.conv_bias)
        x, B, C = layer.split(y)
        return ssd_step(
            x, dt, B, C, layer.A_log, layer.dt_bias, layer.D, ssm_pool, idx, keep, dt_limit=layer.dt_limit
        )

    def prefill(
        self,
        layer: Mamba2Layer,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        conv_pool: torch.Tensor,
        ssm_pool: torch.Tensor,
        rows: PrefillRows,
    ) -> torch.Tensor:
        from overnight.kernels.mamba2_chunked import ssd_varlen_chunked
        from overnight.kernels.mamba2_scan import ssd_varlen

        y = varlen_causal_conv1d(
            xbc, layer.conv_weight, conv_pool, rows.starts, rows.slots, rows.has_state, layer.conv_bias
        )
        x, B, C = layer.split(y)
        scan = ssd_varlen_chunked if self.chunked_prefill else ssd_varlen
        return scan(
            x,
            dt,
            B,
            C,
            layer.A_log,
            layer.dt_bias,
            layer.D,
            ssm_pool,
            rows.slot_ids,
            rows.has_state_dev,
            rows.cu_seqlens,
            dt_limit=layer.dt_limit,
        )


_TORCH = TorchMamba2Ops()


def mamba2_ops(x: torch.Tensor) -> Mamba2Ops:
    """The ops for a layer input x (see the module docstring)."""
    return _triton_ops() if use_kernels(x) else _TORCH


@functools.cache
def _triton_ops() -> TritonMamba2Ops:
    return TritonMamba2Ops()
