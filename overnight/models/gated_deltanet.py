"""The Gated DeltaNet token mixer of Qwen3.5 / Qwen3-Next, reading and writing its per-request states.

    x -> in_proj -> q|k|v (conv channels), z (output gate), b (write strength), a (decay)
      -> causal conv + SiLU over q|k|v (conv state) -> gated delta rule (delta state) per value head
      -> RMSNorm(o) * silu(z) -> out_proj

Qwen3.5 projects with four matrices (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a); Qwen3-Next fuses
them into in_proj_qkvz and in_proj_ba, grouped by key head:

    in_proj_qkvz rows, per key head j:  [ q_j (dk) | k_j (dk) | v of its r value heads (r dv) | z (r dv) ]
    in_proj_ba rows, per key head j:    [ b of its r value heads | a of its r value heads ]

The step's rows come decodes first (attention/metadata.py). Decode rows (one token each) run batched
by the device tensor slot_ids, with no host sync: CUDA graphs capture this path. Prefill rows use host
offsets (prefill steps are never captured). Every request starts from zeros when has_state is 0. How
the conv and the rule run (torch on the CPU, Triton kernels and fla-core on the GPU) is
layers/gated_delta_ops.py's choice.
"""

from __future__ import annotations

import torch
from torch import nn

from overnight.arch import ModelArch
from overnight.attention.metadata import AttentionBatch
from overnight.layers.gated_delta import GatedRMSNorm
from overnight.layers.gated_delta_ops import DeltaLayer, decode_then_prefill, delta_rule_ops
from overnight.quant.fp8 import QuantizedActivation, dense_input, num_tokens


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

    def project(
        self, x: torch.Tensor | QuantizedActivation
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (q|k|v [T, conv_dim], z [T, Hv * dv], b [T, Hv], a [T, Hv]). x may come
        quantized for the FP8 projections, with its dense form for b / a, which stay in the compute
        dtype (models/qwen3_next.py, LINEAR_INPUT_PRODUCERS)."""
        dense = dense_input(x)
        if not self.fused_projections:
            return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(dense), self.in_proj_a(dense)
        t = num_tokens(x)
        r = self.num_v_heads // self.num_k_heads
        dk, rv = self.head_k_dim, r * self.head_v_dim
        qkvz = self.in_proj_qkvz(x).view(t, self.num_k_heads, 2 * dk + 2 * rv)
        q, k, v, z = qkvz.split([dk, dk, rv, rv], dim=-1)
        b, a = self.in_proj_ba(dense).view(t, self.num_k_heads, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return mixed, z.reshape(t, -1), b.reshape(t, -1), a.reshape(t, -1)

    def forward(self, x: torch.Tensor | QuantizedActivation, attn: AttentionBatch) -> torch.Tensor:
        st = attn.states
        if st is None:
            raise RuntimeError(
                "a linear-attention layer needs the step's state batch (AttentionBatch.states)"
            )
        mixed, z, b, a = self.project(x)
        x = dense_input(x)  # its device, dtype and rows
        layer = DeltaLayer(
            self.num_k_heads,
            self.num_v_heads,
            self.head_k_dim,
            self.head_v_dim,
            self.conv1d.weight[:, 0],  # [C, K]
            self.A_log,
            self.dt_bias,
        )
        pools = st.conv[self.state_index], st.ssm[self.state_index]
        shape = (self.num_v_heads, self.head_v_dim)
        core = decode_then_prefill(delta_rule_ops(x), layer, (mixed, a, b), pools, attn.meta, st, (x, shape))
        t = x.shape[0]
        out = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(out.reshape(t, self.value_dim))
