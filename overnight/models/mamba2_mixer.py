"""The Mamba2 token mixer of Granite 4.0's and Nemotron-H's hybrid models, reading and writing its
per-request states.

    x -> in_proj -> z (gate, mamba_intermediate) | x|B|C (conv channels) | dt (one per head)
      -> causal conv + bias + SiLU over x|B|C (conv state) -> SSD recurrence per head (ssm state)
      -> RMSNorm(y * silu(z)) over the whole width or per group (arch.mamba_norm_groups) -> out_proj
         (Falcon-H1: RMSNorm(y) * silu(z) with mamba_norm_before_gate, or y * silu(z) without a norm)

Attribute names are the checkpoint's (model.layers.N.mamba.*). The step's rows come decodes first
(attention/metadata.py). Decode rows (one token each) run batched by the device tensor slot_ids, with no
host sync: CUDA graphs capture this path. Prefill rows use host offsets (prefill steps are never
captured). Every request starts from zeros when has_state is 0. How the conv and the SSM run (torch on
the CPU, Triton kernels on the GPU) is layers/mamba2_ops.py's choice.

Under tensor parallelism (parallel/tp_mamba2.py) the sizes below become one rank's (its heads, the B/C
groups they read, their conv channels) and out_proj sums the ranks' outputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from overnight.arch import ModelArch
from overnight.attention.metadata import AttentionBatch
from overnight.layers.gated_delta_ops import decode_then_prefill
from overnight.layers.mamba2 import MambaGatedRMSNorm
from overnight.layers.mamba2_ops import Mamba2Layer, mamba2_ops


class Mamba2Mixer(nn.Module):
    def __init__(self, arch: ModelArch, state_index: int) -> None:
        super().__init__()
        self.state_index = state_index  # this layer's place among the model's linear layers
        self.num_heads = arch.mamba_n_heads
        self.head_dim = arch.mamba_d_head
        self.n_groups = arch.mamba_n_groups
        self.d_state = arch.mamba_d_state
        self.intermediate_size = arch.mamba_intermediate
        self.conv_dim = self.intermediate_size + 2 * self.n_groups * self.d_state
        self.dt_limit = arch.mamba_dt_limit
        h = arch.hidden_size
        proj = self.intermediate_size + self.conv_dim + self.num_heads  # z | x|B|C | dt
        self.in_proj = nn.Linear(h, proj, bias=arch.mamba_proj_bias)
        k = arch.mamba_d_conv
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, k, groups=self.conv_dim, bias=arch.mamba_conv_bias
        )
        self.dt_bias = nn.Parameter(torch.ones(self.num_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        # Falcon-H1 may have no norm (mamba_rms_norm False: y * silu(z)) or the norm before the gate.
        self.norm = (
            MambaGatedRMSNorm(
                self.intermediate_size, arch.rms_norm_eps, arch.mamba_norm_groups, arch.mamba_norm_before_gate
            )
            if arch.mamba_rms_norm
            else None
        )
        self.out_proj = nn.Linear(self.intermediate_size, h, bias=arch.mamba_proj_bias)

    def forward(self, x: torch.Tensor, attn: AttentionBatch) -> torch.Tensor:
        st = attn.states
        if st is None:
            raise RuntimeError("a Mamba2 layer needs the step's state batch (AttentionBatch.states)")
        z, xbc, dt = self.in_proj(x).split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
        layer = Mamba2Layer(
            self.num_heads,
            self.head_dim,
            self.n_groups,
            self.d_state,
            self.conv1d.weight[:, 0],  # [C, K]
            self.conv1d.bias,
            self.A_log,
            self.dt_bias,
            self.D,
            self.dt_limit,
        )
        pools = st.conv[self.state_index], st.ssm[self.state_index]
        shape = (self.num_heads, self.head_dim)
        y = decode_then_prefill(mamba2_ops(x), layer, (xbc, dt), pools, attn.meta, st, (x, shape))
        t = x.shape[0]
        y = y.reshape(t, self.intermediate_size)
        out = self.norm(y, z) if self.norm is not None else y * F.silu(z)
        return self.out_proj(out)
