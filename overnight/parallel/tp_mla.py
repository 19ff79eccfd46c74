"""Tensor parallelism of multi-head latent attention (DeepSeek-V2 / V3, models/deepseek.py), by heads.

How rank r of `world` holds a latent-attention layer of H heads (H / world of them each):

    q_a_proj, q_a_layernorm,         replicated: every rank computes the whole latent query and the
    kv_a_proj_with_mqa, kv_a_layernorm   whole latent row of each token
    q_b_proj (q_proj)   rows [head 0 (Dn + P) | head 1 | ...] -> r's heads          column-parallel
    kv_b_proj           rows [head 0 (Dn + Dv) | ...]          -> r's heads          column-parallel
    o_proj              columns [head 0 (Dv) | ...]            -> r's heads; all-reduced  row-parallel

The latent cache is replicated: each rank writes and reads every token's [latent | k_pe] row (the
same values on every rank), so a rank's pool holds as many tokens as one GPU's would; its heads absorb
their own W_UK / W_UV slices. Experts, shared experts, dense MLPs, the router, embeddings and LM head
follow parallel/tp_shards.py's rules, as for GLM-4.5 and Qwen3-MoE.
"""

from __future__ import annotations

import torch

from overnight.arch import ModelArch
from overnight.errors import ModelLoadError
from overnight.quant.fp8 import columns_per_scale

# module -> the rows (or, for o_proj, columns) one head owns, as a function of the architecture
COLUMN_PARALLEL = ("q_proj", "q_b_proj", "kv_b_proj")


def _per_head(arch: ModelArch, module: str) -> int:
    if module in ("q_proj", "q_b_proj"):
        return arch.qk_nope_head_dim + arch.qk_rope_head_dim
    if module == "kv_b_proj":
        return arch.qk_nope_head_dim + arch.v_head_dim
    return arch.v_head_dim  # o_proj's input


def shard_mla_tensor(
    arch: ModelArch, rank: int, world: int, module: str, kind: str, t: torch.Tensor
) -> torch.Tensor | None:
    """Rank `rank`'s share of a latent-attention tensor (weights, biases, FP8 scales), None for tensors
    that are not one (the caller's rules apply)."""
    if module not in (*COLUMN_PARALLEL, "o_proj"):
        return None
    per = _per_head(arch, module)
    heads = arch.num_attention_heads // world
    start, n = rank * heads * per, heads * per
    if module in COLUMN_PARALLEL:
        return t.narrow(0, start, n)  # weight, per-row scales (and block scales of whole rows)
    if kind == "weight":
        return t.narrow(1, start, n)
    if kind == "weight_scale" and t.dim() == 2:  # block scales [N, KB]: whole blocks of r's columns
        whole = arch.num_attention_heads * per
        block = columns_per_scale(whole, t.shape[1])
        if start % block or n % block:
            raise ModelLoadError(
                f"tensor_parallel_size {world} splits o_proj's input ({whole} columns) into shares of {n}, "
                f"which are not whole {block}-column weight-scale blocks; use a smaller tensor_parallel_size"
            )
        return t.narrow(1, start // block, n // block)
    return t  # a bias or per-channel scale of o_proj: whole rows
