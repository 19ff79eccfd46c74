"""What linear-attention layers (Gated DeltaNet, Mamba2) see of one engine step: their per-request states.

A linear layer keeps no KV cache. Each running request owns one slot of a state pool instead, the
same slot in every linear layer (runner/state_cache.py):

    conv[layer]  [num_slots + 1, K - 1, conv_dim]   the last K-1 inputs of the causal conv   float32
    ssm[layer]   [num_slots + 1, Hv, dk, dv]        the delta-rule state per value head      float32, or
                                                    float16 / bfloat16 by mamba_ssm_cache_dtype
                  ^ slot; the last one is scratch: padding rows of a CUDA-graph batch read and write it

A Mamba2 layer's (Granite 4.0) are the same pools with its own shapes (ModelArch.linear_state_shapes):
conv [.., K - 1, d_inner + 2 * groups * d_state] and ssm [.., heads, head_dim, d_state].

Request i of the step (the metadata's order: decodes first) uses slot slot_ids[i]. has_state[i] is 1
when it continues from its slot (it computed tokens before this step), 0 when it starts from zeros
(a new request, a resumed preemption, a recomputation): a slot is never cleared, the layer ignores its
old contents instead. slot_ids and has_state are views of static device buffers, so decode graphs
replay with new values; the host copies serve the prefill path, which loops over its requests.
Whatever the ssm pool's dtype, a layer computes each step in float32 and rounds once, as it stores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LinearStateBatch:
    conv: list[torch.Tensor]  # per linear layer (in model order), see the module docstring
    ssm: list[torch.Tensor]
    slot_ids: torch.Tensor  # [num_reqs] int64, device
    has_state: torch.Tensor  # [num_reqs] float32 (1.0 / 0.0), device
    slot_ids_cpu: list[int]  # the same, on the host (prefill requests)
    has_state_cpu: list[bool]

    def decode_slots(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot_ids, has_state) of the first n requests: a step's decode rows (views, no copy)."""
        return self.slot_ids[:n], self.has_state[:n]
