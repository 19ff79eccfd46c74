"""How a Gated DeltaNet layer runs its conv and delta rule over one step's rows: the backend choice, in
one place.

    TorchDeltaRuleOps   the CPU path and the reference: layers/gated_delta.py's ops, decode rows batched
                        (states gathered from the pool by slot and scattered back), prefill rows one
                        request at a time with the chunked rule
    TritonDeltaRuleOps  CUDA: decode rows through kernels/gated_delta_decode.py (states updated in place
                        at their slots, capturable); prefill rows of the whole step after one batched
                        conv in one varlen call of fla-core's chunk_gated_delta_rule (the kernels vLLM
                        and SGLang derive theirs from), or without fla-core installed (the `gpu` extra)
                        in one launch of our token-by-token varlen kernel

delta_rule_ops(x) picks one by the input's device (kernels/dispatch.py's use_kernels, which tests can
force) and by whether fla-core imports; fla is imported on first CUDA use only, never on the CPU path.

Both take the same inputs: the step's rows decodes first (attention/metadata.py), `mixed` the
q|k|v projection [T, conv_dim] before the conv, a and b the raw decay/write projections [T, Hv], and
the slot of each request (runner/state_cache.py). They return the rule's output [T, Hv, dv].

The ssm pool may be 16-bit (mamba_ssm_cache_dtype): every path widens a request's state to float32
when it reads it, runs the step in float32 and rounds once when it writes the final state back (the
references compute in float32 whatever they are given; fla gets a float32 initial state and returns a
float32 final one).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from overnight.attention.linear_state import LinearStateBatch
from overnight.attention.metadata import AttentionMetadata
from overnight.kernels.dispatch import use_kernels
from overnight.layers.gated_delta import (
    causal_conv1d_ref,
    causal_conv1d_step_ref,
    chunk_gated_delta_rule_ref,
    gdn_gates,
    l2norm,
    recurrent_gated_delta_rule_ref,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeltaLayer:
    """One layer's sizes and parameters, as the ops need them."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_weight: torch.Tensor  # [conv_dim, K]
    A_log: torch.Tensor  # [Hv]
    dt_bias: torch.Tensor  # [Hv]

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv output [N, conv_dim] -> views q, k [N, Hk, dk], v [N, Hv, dv]."""
        key_dim = self.num_k_heads * self.head_k_dim
        q, k, v = y.split([key_dim, key_dim, self.num_v_heads * self.head_v_dim], dim=-1)
        n = y.shape[0]
        return (
            q.view(n, self.num_k_heads, self.head_k_dim),
            k.view(n, self.num_k_heads, self.head_k_dim),
            v.view(n, self.num_v_heads, self.head_v_dim),
        )


@dataclass(frozen=True)
class PrefillRows:
    """The step's prefill requests (rows num_decodes .. num_reqs of the metadata), host and device."""

    starts: list[int]  # [n + 1] row offsets, relative to the first prefill row
    slots: list[int]
    has_state: list[bool]
    cu_seqlens: torch.Tensor  # the same offsets on the device, int64
    slot_ids: torch.Tensor  # [n] device
    has_state_dev: torch.Tensor  # [n] float32 device

    @classmethod
    def of(
        cls, lens: list[int], slots: list[int], has_state: list[bool], device: torch.device
    ) -> PrefillRows:
        """Requests of lens[i] rows each, packed in order, at slots[i] (continuing from it when
        has_state[i]): what prefill_rows gives for such a step, for tests and benchmarks."""
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        return cls(
            starts,
            list(slots),
            list(has_state),
            torch.tensor(starts, device=device),
            torch.tensor(slots, device=device),
            torch.tensor([1.0 if h else 0.0 for h in has_state], device=device),
        )


class DeltaRuleOps(Protocol):
    name: str

    def decode(
        self,
        layer: DeltaLayer,
        mixed: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        conv_pool: torch.Tensor,
        ssm_pool: torch.Tensor,
        st: LinearStateBatch,
    ) -> torch.Tensor:
        """One token per request (rows 0 .. N of st); captured in CUDA graphs on the GPU."""
        ...

    def prefill(
        self,
        layer: DeltaLayer,
        mixed: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        conv_pool: torch.Tensor,
        ssm_pool: torch.Tensor,
        rows: PrefillRows,
    ) -> torch.Tensor:
        """Whole or partial prompts, each continuing from its slot when has_state (never captured)."""
        ...


class TorchDeltaRuleOps:
    name = "torch"

    def decode(
        self,
        layer: DeltaLayer,
        mixed: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        conv_pool: torch.Tensor,
        ssm_pool: torch.Tensor,
        st: LinearStateBatch,
    ) -> torch.Tensor:
        idx, keep = st.decode_slots(mixed.shape[0])
        y, conv_new = causal_conv1d_step_ref(mixed, layer.conv_weight, conv_pool[idx] * keep[:, None, None])
        conv_pool.index_copy_(0, idx, conv_new)
        q, k, v = layer.split(y)
        g, beta = gdn_gates(a, b, layer.A_log, layer.dt_bias)
        # where, not a product: a slot's old contents are ignored, even a 16-bit state that overflowed
        s0 = torch.where(keep[:, None, None, None] != 0, ssm_pool[idx].float(), 0.0)
        o, s = recurrent_gated_delta_rule_ref(
            q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], s0
        )
        ssm_pool.index_copy_(0, idx, s.to(ssm_pool.dtype))  # float32 -> the pool's dtype: one rounding
        return o[:, 0]

    def prefill(
        self,
        layer: DeltaLayer,
        mixed: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        conv_pool: torch.Tensor,
        ssm_pool: torch.Tensor,
        rows: PrefillRows,
    ) -> torch.Tensor:
        g, beta = gdn_gates(a, b, layer.A_log, layer.dt_bias)
        out = mixed.new_empty(mixed.shape[0], layer.num_v_heads, layer.head_v_dim)
        for i, slot in enumerate(rows.slots):
            lo, hi, has = rows.starts[i], rows.starts[i + 1], rows.has_state[i]
            y, conv_new = causal_conv1d_ref(mixed[lo:hi], layer.conv_weight, conv_pool[slot] if has else None)
            conv_pool[slot] = conv_new
            q, k, v = layer.split(y)
            o, s = chunk_gated_delta_rule_ref(q, k, v, g[lo:hi], beta[lo:hi], ssm_pool[slot] if has else None)
            ssm_pool[slot] = s  # rounded once to the pool's dtype (the copy casts)
            out[lo:hi] = o
        return out


class TritonDeltaRuleOps:
    """Triton decode kernels; for prefill, after one batched conv, fla-core's chunked rule when
    `fla_prefill`, else our token-by-token varlen kernel (one launch per layer, sequential in time)."""

    def __init__(self, fla_prefill: bool) -> None:
        self.fla_prefill = fla_prefill
        self.name = "triton+fla" if fla_prefill else "triton"

    def decode(
        self,
        layer: DeltaLayer,
        mixed: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        conv_pool: torch.Tensor,
        ssm_pool: torch.Tensor,
        st: LinearStateBatch,
    ) -> torch.Tensor:
        from overnight.kernels.gated_delta_decode import delta_step

        q, k, v, idx, keep = conv_step_split(layer, mixed, conv_pool, st)
        return delta_step(q, k, v, a, b, layer.A_log, layer.dt_bias, ssm_pool, idx, keep)

    def prefill(
        self,
        layer: DeltaLayer,
        mixed: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        conv_pool: torch.Tensor,
        ssm_pool: torch.Tensor,
        rows: PrefillRows,
    ) -> torch.Tensor:
        y = varlen_causal_conv1d(mixed, layer.conv_weight, conv_pool, rows.starts, rows.slots, rows.has_state)
        q, k, v = layer.split(y)
        if not self.fla_prefill:
            from overnight.kernels.gated_delta_decode import delta_rule_varlen

            return delta_rule_varlen(
                q,
                k,
                v,
                a,
                b,
                layer.A_log,
                layer.dt_bias,
                ssm_pool,
                rows.slot_ids,
                rows.has_state_dev,
                rows.cu_seqlens,
            )
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        g, beta = gdn_gates(a, b, layer.A_log, layer.dt_bias)
        keep = rows.has_state_dev[:, None, None, None] != 0
        # [n, Hv, dk, dv]: fla's layout, K before V; float32 whatever the pool holds (fla then carries and
        # returns the state in float32, rounded once below)
        h0 = torch.where(keep, ssm_pool[rows.slot_ids].float(), 0.0)
        # The q/k L2 norm here, in float32 as fla computes it, not fla's (use_qk_l2norm_in_kernel):
        # fla autotunes that kernel on its first call, 25 compiles that landed inside a timed Qwen3.5-9B
        # run on an H200 (session I, jit_watch), each a stall of the whole batch.
        q = l2norm(q.float()).to(q.dtype)
        k = l2norm(k.float()).to(k.dtype)
        o, final = chunk_gated_delta_rule(
            q[None],
            k[None],
            v[None],
            g[None],
            beta[None],
            scale=layer.head_k_dim**-0.5,
            initial_state=h0,
            output_final_state=True,
            use_qk_l2norm_in_kernel=False,
            cu_seqlens=rows.cu_seqlens,
            cu_seqlens_cpu=torch.tensor(rows.starts, dtype=torch.int64),
        )
        ssm_pool.index_copy_(0, rows.slot_ids, final.to(ssm_pool.dtype))
        return o[0]


def conv_step_split(
    layer: DeltaLayer, mixed: torch.Tensor, conv_pool: torch.Tensor, st: LinearStateBatch
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The decode rows' conv through the Triton step kernel (their conv states updated in place at
    their slots), split: (q, k, v, the rows' slots, their has-state flags). The Triton decode and the
    GPU benchmark's variants of the delta step start here."""
    from overnight.kernels.gated_delta_decode import conv_step

    idx, keep = st.decode_slots(mixed.shape[0])
    q, k, v = layer.split(conv_step(mixed, layer.conv_weight, conv_pool, idx, keep))
    return q, k, v, idx, keep


def varlen_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_pool: torch.Tensor,
    starts: list[int],
    slots: list[int],
    has_state: list[bool],
    bias: torch.Tensor | None = None,
    silu: bool = True,
) -> torch.Tensor:
    """causal_conv1d_ref over n sequences packed in x [T, C] (sequence i: rows starts[i] .. starts[i+1])
    in one conv call, each starting from its slot's conv state (zeros without one) and leaving its last
    K-1 inputs there. Returns silu(conv + bias) [T, C] in x's dtype (bias [C]: Mamba2's; None: none;
    silu False: conv + bias, LFM2's short conv).

    Each sequence gets its K-1 state rows in front of it in one long buffer; a window of K then never
    reaches into the previous sequence, so one unpadded conv over the buffer gives every sequence's
    outputs:

        ext: [ s0 s0 s0 | x0 x0 x0 x0 x0 | s1 s1 s1 | x1 | s2 s2 s2 | x2 x2 ... ]     (K = 4)
    """
    t, c = x.shape
    k1 = weight.shape[1] - 1
    n = len(slots)
    dev, wdt = x.device, weight.dtype
    lens = torch.tensor([hi - lo for lo, hi in zip(starts[:-1], starts[1:])], device=dev)
    seq = torch.repeat_interleave(torch.arange(n, device=dev), lens, output_size=t)
    tok_pos = torch.arange(t, device=dev) + (seq + 1) * k1  # each token's row in ext
    seg_start = torch.tensor(starts[:-1], device=dev) + torch.arange(n, device=dev) * k1  # [n]
    window = torch.arange(k1, device=dev)
    state_pos = (seg_start[:, None] + window).reshape(-1)
    slot_t = torch.tensor(slots, device=dev)
    keep = torch.tensor(has_state, device=dev)[:, None, None]
    ext = x.new_empty(t + n * k1, c, dtype=wdt)
    ext[tok_pos] = x.to(wdt)
    ext[state_pos] = torch.where(keep, conv_pool[slot_t], 0.0).to(wdt).reshape(n * k1, c)
    out = F.conv1d(ext.t().unsqueeze(0), weight.unsqueeze(1), bias, groups=c)[0].t()  # row p: ext p .. p+k1
    y = out[tok_pos - k1]
    y = (F.silu(y) if silu else y).to(x.dtype)
    seg_end = seg_start + k1 + lens  # exclusive
    conv_pool.index_copy_(0, slot_t, ext[(seg_end[:, None] - k1 + window).reshape(-1)].view(n, k1, c).float())
    return y


def prefill_rows(meta: AttentionMetadata, st: LinearStateBatch) -> PrefillRows:
    """The step's prefill requests (after its num_decodes decode rows), from the metadata's host offsets."""
    nd, nr = meta.num_decodes, meta.num_reqs
    if meta.query_start_loc_cpu is None:
        raise RuntimeError("a prefill step needs the metadata's host offsets (query_start_loc_cpu)")
    qsl = meta.query_start_loc_cpu[nd : nr + 1].tolist()
    return PrefillRows(
        starts=[q - qsl[0] for q in qsl],
        slots=list(st.slot_ids_cpu[nd:nr]),
        has_state=list(st.has_state_cpu[nd:nr]),
        cu_seqlens=(meta.query_start_loc[nd : nr + 1] - meta.query_start_loc[nd]).long(),
        slot_ids=st.slot_ids[nd:nr],
        has_state_dev=st.has_state[nd:nr],
    )


def decode_then_prefill(
    ops: Any,
    layer: Any,
    inputs: tuple[torch.Tensor, ...],
    pools: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
    st: LinearStateBatch,
    out: tuple[torch.Tensor, tuple[int, ...]],
) -> torch.Tensor:
    """A linear mixer's core over one step's rows, decodes first: `ops` a DeltaRuleOps or Mamba2Ops
    (layers/mamba2_ops.py) and its `layer`, `inputs` the row-aligned [T, ...] tensors its decode and
    prefill take before the (conv, ssm) `pools`; `out` = (like, shape): the result is [T, *shape] in
    like's dtype and device."""
    conv_pool, ssm_pool = pools
    like, shape = out
    t = like.shape[0]
    nd = meta.num_decodes
    if nd == t:  # decode-only (the captured step): no host offsets, no copy of the output
        return ops.decode(layer, *inputs, conv_pool, ssm_pool, st)
    y = like.new_empty(t, *shape)  # rows past the last request's (padding) stay unwritten
    if nd:
        y[:nd] = ops.decode(layer, *(m[:nd] for m in inputs), conv_pool, ssm_pool, st)
    if meta.num_reqs > nd:
        rows = prefill_rows(meta, st)
        hi = nd + rows.starts[-1]
        y[nd:hi] = ops.prefill(layer, *(m[nd:hi] for m in inputs), conv_pool, ssm_pool, rows)
    return y


@functools.cache
def fla_importable() -> bool:
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except Exception as e:  # an ImportError, or a version clash at import time
        logger.info("fla-core not usable (%s): Gated DeltaNet prefill runs the recurrent Triton kernel", e)
        return False
    return True


_TORCH = TorchDeltaRuleOps()


def delta_rule_ops(x: torch.Tensor) -> DeltaRuleOps:
    """The ops for a layer input x (see the module docstring)."""
    if not use_kernels(x):
        return _TORCH
    return _triton_ops(x.is_cuda and fla_importable())


@functools.cache
def _triton_ops(fla_prefill: bool) -> TritonDeltaRuleOps:
    return TritonDeltaRuleOps(fla_prefill)
