"""How fast a workload could possibly run: FLOPs over the matrix rate, bytes over memory bandwidth.

Counts, for decoder-only models with the engine's layout:
  linear layers   2 x (weights of q/k/v/o/gate/up/down) FLOPs per token computed; with experts, only
                  the router and the num_experts_per_tok experts a token goes through
  LM head         2 x hidden x vocab FLOPs per sampled token
  attention       4 x Hq x D FLOPs per (query, key) pair: causal prefill, and decode over the context
  memory          the KV cache read at each decode step, and the weights read once per decode step;
                  of the experts, only those some token of the batch chose (expected count for
                  uniform routing)
Weight bytes are the model's as loaded where the caller has it (loaded_weight_bytes: FP8 weights read
1 byte a parameter, packed int4 about half of one), else bf16's count from the config. Decode steps:
the output tokens over the requests that run at once, at most max_num_seqs and at most what the KV pool
holds at the requests' mean occupancy (prompt plus half the output: a request's tokens averaged over its
decode steps).
Ceilings default to what was measured on an H200 (bf16 matmul ~790 TFLOP/s, copy ~4.3 TB/s); the
matmul rate is bf16's for every weight form (an FP8 run's compute bound is then at most 2x too high,
which matters only where compute, not memory, is the bound).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from overnight.arch import ModelArch

H200_TFLOPS = 790.0
H200_TBPS = 4.3


@dataclass(frozen=True)
class Roofline:
    flops: float
    bytes: float
    t_compute: float
    t_memory: float

    @property
    def t_overlapped(self) -> float:
        """Lower bound when compute and memory traffic overlap perfectly."""
        return max(self.t_compute, self.t_memory)

    @property
    def t_serial(self) -> float:
        """Bound when they do not overlap at all."""
        return self.t_compute + self.t_memory


@dataclass(frozen=True)
class WeightBytes:
    """Bytes of the weights a decode step may read: the dense part (every linear layer, the LM head) and
    the routed experts (all of them: a step reads those its tokens chose)."""

    dense: float
    experts: float

    def read_per_step(self, arch: ModelArch, batch: int) -> float:
        """A step of `batch` tokens: the dense part, and of the experts the expected share hit when
        tokens choose uniformly, 1 - (1 - k/E)^batch."""
        if not arch.num_experts or not self.experts:
            return self.dense + self.experts
        e, k = arch.num_experts, arch.num_experts_per_tok
        return self.dense + self.experts * (1.0 - (1.0 - k / e) ** batch)


def config_weight_bytes(arch: ModelArch, dtype_bytes: int = 2) -> WeightBytes:
    """The weights counted from the config, every one held in a dtype of dtype_bytes (the LM head, not
    the embedding table: a step reads only its tokens' rows of that)."""
    experts = 0
    if arch.num_experts:
        sparse = sum(arch.is_moe_layer(i) for i in range(arch.num_hidden_layers))
        experts = sparse * arch.num_experts * 3 * arch.hidden_size * arch.moe_intermediate_size
    dense = arch.num_linear_parameters() - experts + arch.vocab_size * arch.hidden_size
    return WeightBytes(dense * dtype_bytes, experts * dtype_bytes)


def loaded_weight_bytes(model: nn.Module, arch: ModelArch) -> WeightBytes:
    """The weights as the model holds them, quantized or not.
    Experts: every module holding 3-D gate_up_proj and down_proj, with its scales (parameters, buffers
    or plain tensor attributes, as the FP8 stacks keep theirs).
    Dense: every other parameter, less the input embedding where it is not the LM head (a step reads
    only its tokens' rows of it). Other buffers (rotary tables, LoRA slots) are not weights a step must
    read."""
    experts = 0
    stacks: set[int] = set()
    for m in model.modules():
        up, down = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
        if isinstance(up, nn.Parameter) and isinstance(down, nn.Parameter) and up.dim() == 3:
            held = [*m.parameters(recurse=False), *m.buffers(recurse=False)]
            held += [
                t for t in vars(m).values() if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter)
            ]
            tensors = {id(t): t for t in held}
            experts += sum(t.numel() * t.element_size() for t in tensors.values())
            stacks.update(tensors)
    dense = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in stacks)
    tables = [p for p in model.parameters() if tuple(p.shape) == (arch.vocab_size, arch.hidden_size)]
    if len(tables) > 1:  # an untied input embedding beside the LM head
        dense -= tables[0].numel() * tables[0].element_size()
    return WeightBytes(float(dense), float(experts))


def estimate(
    arch: ModelArch,
    requests: list[tuple[int, int]],
    batch: int,
    kv_bytes_per_elem: int = 2,
    tflops: float = H200_TFLOPS,
    tbps: float = H200_TBPS,
    weights: WeightBytes | None = None,
    pool_tokens: int | None = None,
) -> Roofline:
    """requests: (input length, output length) pairs; batch: the most sequences a step may run
    (max_num_seqs); weights: as loaded (default: bf16 from the config); pool_tokens: the KV pool."""
    lin = 2.0 * arch.num_linear_parameters(active_only=True)
    head = 2.0 * arch.hidden_size * arch.vocab_size
    # q.k and p.v per head and (query, key) pair; latent attention counted in its decompressed form
    # (q.k over Dn + P, p.v over Dv: the fewest FLOPs; absorbed decodes do more, over the latent)
    pair = (
        2 * (arch.qk_nope_head_dim + arch.qk_rope_head_dim + arch.v_head_dim)
        if arch.is_mla
        else 4 * arch.head_dim
    )
    attn_pair = float(pair * arch.num_attention_heads * arch.num_hidden_layers)
    kv_per_token = arch.kv_bytes_per_token(kv_bytes_per_elem)
    flops = kv_bytes = 0.0
    total_out = 0
    for n_in, n_out in requests:
        flops += lin * (n_in + n_out - 1) + head * n_out
        flops += attn_pair * n_in * (n_in + 1) / 2
        # decode step t (1..n_out-1) attends over n_in + t keys
        ctx_sum = (n_out - 1) * n_in + (n_out - 1) * n_out / 2
        flops += attn_pair * ctx_sum
        kv_bytes += kv_per_token * ctx_sum
        total_out += n_out
    concurrent = max(1, min(batch, len(requests)))
    if pool_tokens and requests:
        occupancy = sum(n_in + n_out / 2 for n_in, n_out in requests) / len(requests)
        concurrent = max(1, min(concurrent, int(pool_tokens / occupancy)))
    steps = total_out / concurrent
    weight_bytes = steps * (weights or config_weight_bytes(arch)).read_per_step(arch, concurrent)
    total_bytes = kv_bytes + weight_bytes
    return Roofline(flops, total_bytes, flops / (tflops * 1e12), total_bytes / (tbps * 1e12))
