"""How fast a workload could possibly run: FLOPs over the matrix rate, bytes over memory bandwidth.

Counts, for decoder-only models with the engine's layout:
  linear layers   2 x (weights of q/k/v/o/gate/up/down) FLOPs per token computed; with experts, only
                  the router and the num_experts_per_tok experts a token goes through
  LM head         2 x hidden x vocab FLOPs per sampled token
  attention       4 x Hq x D FLOPs per (query, key) pair: causal prefill, and decode over the context
  memory          the KV cache read at each decode step, and the weights read once per decode step;
                  of the experts, only those some token of the batch chose (expected count for
                  uniform routing)
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


def model_bytes(arch: ModelArch, dtype_bytes: int = 2, batch: int | None = None) -> int:
    """Bytes of weights a forward pass reads; with experts and a batch, only the experts it hits
    (E * (1 - (1 - k/E)^batch) per sparse layer when tokens choose uniformly)."""
    emb = arch.vocab_size * arch.hidden_size * (1 if arch.tie_word_embeddings else 2)
    params = arch.num_linear_parameters() + emb
    if arch.num_experts and batch is not None:
        e, k = arch.num_experts, arch.num_experts_per_tok
        unused = e * (1.0 - k / e) ** batch
        sparse = sum(arch.is_moe_layer(i) for i in range(arch.num_hidden_layers))
        params -= int(unused * sparse * 3 * arch.hidden_size * arch.moe_intermediate_size)
    return params * dtype_bytes


def estimate(
    arch: ModelArch,
    requests: list[tuple[int, int]],
    batch: int,
    kv_bytes_per_elem: int = 2,
    tflops: float = H200_TFLOPS,
    tbps: float = H200_TBPS,
) -> Roofline:
    """requests: (input length, output length) pairs; batch: concurrent sequences during decode."""
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
    steps = total_out / concurrent
    weight_bytes = steps * model_bytes(arch, batch=concurrent)
    total_bytes = kv_bytes + weight_bytes
    return Roofline(flops, total_bytes, flops / (tflops * 1e12), total_bytes / (tbps * 1e12))
