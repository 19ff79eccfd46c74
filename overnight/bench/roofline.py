"""How fast a workload could possibly run: FLOPs over the matrix rate, bytes over memory bandwidth.

Counts, for decoder-only models with the engine's layout:
  linear layers   2 x (weights of q/k/v/o/gate/up/down) FLOPs per token computed
  LM head         2 x hidden x vocab FLOPs per sampled token
  attention       4 x Hq x D FLOPs per (query, key) pair: causal prefill, and decode over the context
  memory          the KV cache read at each decode step, and the weights read once per decode step
Ceilings default to what was measured on an H200 (bf16 matmul ~790 TFLOP/s, copy ~4.3 TB/s).
"""

from __future__ import annotations

from dataclasses import dataclass

from overnight.config import ModelArch

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


def model_bytes(arch: ModelArch, dtype_bytes: int = 2) -> int:
    emb = arch.vocab_size * arch.hidden_size * (1 if arch.tie_word_embeddings else 2)
    return (arch.num_linear_parameters() + emb) * dtype_bytes


def estimate(
    arch: ModelArch,
    requests: list[tuple[int, int]],
    batch: int,
    kv_bytes_per_elem: int = 2,
    tflops: float = H200_TFLOPS,
    tbps: float = H200_TBPS,
) -> Roofline:
    """requests: (input length, output length) pairs; batch: concurrent sequences during decode."""
    lin = 2.0 * arch.num_linear_parameters()
    head = 2.0 * arch.hidden_size * arch.vocab_size
    attn_pair = 4.0 * arch.num_attention_heads * arch.head_dim * arch.num_hidden_layers
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
    steps = total_out / max(1, min(batch, len(requests)))
    weight_bytes = steps * model_bytes(arch)
    total_bytes = kv_bytes + weight_bytes
    return Roofline(flops, total_bytes, flops / (tflops * 1e12), total_bytes / (tbps * 1e12))
