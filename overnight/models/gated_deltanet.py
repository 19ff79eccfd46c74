"""The Gated DeltaNet token mixer of Qwen3.5 / Qwen3-Next, reading and writing its per-request states.

    x -> in_proj -> q|k|v (conv channels), z (output gate), b (write strength), a (decay)
      -> causal conv + SiLU over q|k|v (conv state) -> gated delta rule (delta state) per value head
      -> RMSNorm(o) * silu(z) -> out_proj

Qwen3.5 projects with four matrices (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a); Qwen3-Next fuses
them into in_proj_qkvz and in_proj_ba, grouped by key head:

    in_proj_qkvz rows, per key head j:  [ q_j (dk) | k_j (dk) | v of its r value heads (r dv) | z (r dv) ]
    in_proj_ba rows, per key head j:    [ b of its r value heads | a of its r value heads ]

The step's rows come decodes first (attention/metadata.py). Decode rows (one token each) run batched,
gathering their slots' states by the device tensor slot_ids and scattering them back, with no host
sync: CUDA graphs capture this path. Prefill rows run request by request with the chunked rule (host
offsets; prefill steps are never captured). Every request starts from zeros when has_state is 0.
"""

from __future__ import annotations

import torch
from torch import nn

from overnight.attention.metadata import AttentionBatch
from overnight.config import ModelArch
from overnight.layers.gated_delta import (
    GatedRMSNorm,
    causal_conv1d_ref,
    causal_conv1d_step_ref,
    chunk_gated_delta_rule_ref,
    gdn_gates,
    recurrent_gated_delta_rule_ref,
)


class GatedDeltaNet(nn.Module):
    def __init__(self, arch: ModelArch, state_index: int, fused_projections: bool) -> None:
        super().__init__()
        self.state_index = state_index  # this layer's place among the model's linear layers
        self.num_k_heads = arch.linear_num_key_heads
        self.num_v_heads = arch.linear_num_value_heads
        self.head_k_dim = arch.linear_key_head_dim
        self.head_v_dim = arch.linear_value_head_dim
        if self.num_v_heads % self.num_k_heads:
            raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        h = arch.hidden_size
        self.fused_projections = fused_projections
        if fused_projections:
            self.in_proj_qkvz = nn.Linear(h, 2 * self.key_dim + 2 * self.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(h, 2 * self.num_v_heads, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(h, self.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(h, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(h, self.num_v_heads, bias=False)
            self.in_proj_a = nn.Linear(h, self.num_v_heads, bias=False)
        k = arch.linear_conv_kernel_dim
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, k, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, arch.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, h, bias=False)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (q|k|v [T, conv_dim], z [T, Hv * dv], b [T, Hv], a [T, Hv])."""
        if not self.fused_projections:
            return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)
        t = x.shape[0]
        r = self.num_v_heads // self.num_k_heads
        dk, rv = self.head_k_dim, r * self.head_v_dim
        qkvz = self.in_proj_qkvz(x).view(t, self.num_k_heads, 2 * dk + 2 * rv)
        q, k, v, z = qkvz.split([dk, dk, rv, rv], dim=-1)
        b, a = self.in_proj_ba(x).view(t, self.num_k_heads, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return mixed, z.reshape(t, -1), b.reshape(t, -1), a.reshape(t, -1)

    def _split(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv output [..., conv_dim] -> q, k [..., Hk, dk], v [..., Hv, dv]."""
        q, k, v = y.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        lead = y.shape[:-1]
        return (
            q.reshape(*lead, self.num_k_heads, self.head_k_dim),
            k.reshape(*lead, self.num_k_heads, self.head_k_dim),
            v.reshape(*lead, self.num_v_heads, self.head_v_dim),
        )

    def forward(self, x: torch.Tensor, attn: AttentionBatch) -> torch.Tensor:
        st = attn.states
        if st is None:
            raise RuntimeError(
                "a linear-attention layer needs the step's state batch (AttentionBatch.states)"
            )
        meta = attn.meta
        mixed, z, b, a = self.project(x)
        g, beta = gdn_gates(a, b, self.A_log, self.dt_bias)
        conv_pool, ssm_pool = st.conv[self.state_index], st.ssm[self.state_index]
        weight = self.conv1d.weight[:, 0]  # [C, K]
        t = x.shape[0]
        core = x.new_empty(t, self.num_v_heads, self.head_v_dim)
        nd = meta.num_decodes
        if nd:
            idx, keep = st.slot_ids[:nd], st.has_state[:nd]
            y, conv_new = causal_conv1d_step_ref(mixed[:nd], weight, conv_pool[idx] * keep[:, None, None])
            conv_pool.index_copy_(0, idx, conv_new)
            q, k, v = self._split(y)
            s0 = ssm_pool[idx] * keep[:, None, None, None]
            o, s = recurrent_gated_delta_rule_ref(
                q[:, None], k[:, None], v[:, None], g[:nd, None], beta[:nd, None], s0
            )
            ssm_pool.index_copy_(0, idx, s)
            core[:nd] = o[:, 0]
        if meta.num_reqs > nd:
            assert meta.query_start_loc_cpu is not None
            qsl = meta.query_start_loc_cpu.tolist()
            for i in range(nd, meta.num_reqs):
                lo, hi = qsl[i], qsl[i + 1]
                slot, has = st.slot_ids_cpu[i], st.has_state_cpu[i]
                y, conv_new = causal_conv1d_ref(mixed[lo:hi], weight, conv_pool[slot] if has else None)
                conv_pool[slot] = conv_new
                q, k, v = self._split(y)
                o, s = chunk_gated_delta_rule_ref(
                    q, k, v, g[lo:hi], beta[lo:hi], ssm_pool[slot] if has else None
                )
                ssm_pool[slot] = s
                core[lo:hi] = o
        out = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(out.reshape(t, self.value_dim))
