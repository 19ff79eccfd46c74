"""Gemma 4's tensor-parallel rules (parallel/tp_shards.py and tp.py apply them): every size that the
common rules read from the whole model is per layer here.

    q_proj / qkv_proj   r's q heads of the layer's head size (global_head_dim in full layers), then r's
                        kv heads of the layer's kind (num_global_key_value_heads in full layers; fewer
                        heads than ranks: a group of ranks holds one); no v rows where k is v (k_eq_v)
    o_proj              the columns of r's q heads, all-reduced (parallel/tp_modules.py RowParallelLinear)
    mlp gate_up / down  r's slice of the layer's width (twice as wide in KV-shared layers)
    KV-shared layers    only q_proj / o_proj; they read the source layer's cache, which on every rank
                        holds the heads of that rank's q heads (the same split as the source layer's)
    experts, router     the common rules: experts by their intermediate size, the router replicated
    per-layer inputs    embed_tokens_per_layer (vocab x layers x P: the largest tensor of the small
                        Gemma 4s) split by vocabulary rows like embed_tokens, its lookups all-reduced
                        once a step; per_layer_model_projection and each layer's per_layer_input_gate
                        / per_layer_projection replicated (small: they run whole on every rank, on the
                        whole hidden state each rank holds after every all-reduce, with no collective)
    q/k/v norms         per head: replicated

Quantized layers by the other families' rules (parallel/tp_shards.py, tp_int.py): FP8 / W8A8 scales and packed
codes, scales and zeros of column-parallel layers with their rows; in row-parallel ones per-channel
scales whole, block scales and packed integers by whole blocks, groups and int32 words of the layer's
own input (check_gemma4_quantized_tp refuses other splits by name before any process starts).
"""

from __future__ import annotations

import torch
from torch import nn

from overnight.arch import ModelArch
from overnight.errors import ModelLoadError
from overnight.models.gemma4 import Gemma4Attention
from overnight.parallel.tp_int import INT_PACKED_PARTS, int_row_columns
from overnight.quant.fp8 import columns_per_scale

COLUMN = ("qkv_proj", "q_proj", "k_proj", "v_proj", "gate_up_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")
PER_LAYER_TABLE = "embed_tokens_per_layer"


def is_gemma4(arch: ModelArch) -> bool:
    return arch.architecture == "gemma4"


def gemma4_problems(arch: ModelArch, world: int) -> list[str]:
    """The per-kind sizes that `world` does not divide (the common check covers the rest)."""
    g = arch.num_global_key_value_heads
    if g and ((g % world) if g >= world else (world % g)):
        return [f"num_global_key_value_heads {g}"]
    return []


def check_gemma4_quantized_tp(
    arch: ModelArch, world: int, block_k: int | None, int_linear: tuple[int, int, bool] | None
) -> None:
    """Refuses, before any process starts, Gemma 4 quantized layers whose row-parallel shares (o_proj:
    a rank's q heads of each layer's head size; down_proj: its share of each layer's width) are not
    whole units: block_k, FP8 block scales' columns (None: per channel, or no FP8); int_linear
    (loader/fit.py's: bits, group size or 0, ...), packed integers' groups and int32 words."""
    if world == 1 or not is_gemma4(arch):
        return
    unit = block_k or 1
    if int_linear is not None:
        bits, group, _ = int_linear
        unit = max(unit, group or 1, 32 // bits)
    if unit == 1:
        return
    shares = {}
    for layer in range(arch.num_hidden_layers):
        shares[f"o_proj (layer {layer})"] = arch.num_attention_heads // world * arch.layer_head_dim(layer)
        shares[f"down_proj (layer {layer})"] = arch.layer_intermediate_size(layer) // world
    for where, n in shares.items():
        if n % unit:
            raise ModelLoadError(
                f"tensor_parallel_size {world} gives each rank {n} input columns of Gemma 4's {where}, "
                f"not whole {unit}-column groups of its quantized weights; use a smaller "
                "tensor_parallel_size"
            )


def vocab_rows(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s rows of the per-layer-input table: ceil(rows / world) of them, zero-padded."""
    per = -(-t.shape[0] // world)
    rows = t[rank * per : (rank + 1) * per]
    if rows.shape[0] < per:
        rows = torch.cat([rows, t.new_zeros(per - rows.shape[0], *t.shape[1:])])
    return rows


def _rows(t: torch.Tensor, start: int, n: int, dim: int = 0) -> torch.Tensor:
    return t.narrow(dim, start, n)


def shard_gemma4_tensor(
    arch: ModelArch, rank: int, world: int, parts: list[str], t: torch.Tensor
) -> torch.Tensor | None:
    """Rank `rank`'s share of one decoder-layer attention or dense-MLP tensor, or None for a tensor the
    common rules take (experts, embeddings, LM head) or that is replicated (norms, router, per-layer
    inputs)."""
    if len(parts) < 2:
        return None
    module, kind = parts[-2], parts[-1]
    if module == PER_LAYER_TABLE and kind == "weight":
        return vocab_rows(t, rank, world)
    if "layers" not in parts or "experts" in parts:
        return None
    if module not in COLUMN + ROW:
        return None
    if kind not in ("weight", "bias", "weight_scale", *INT_PACKED_PARTS):
        raise ModelLoadError(f"tensor parallelism cannot split Gemma 4's {'.'.join(parts)}")
    layer = int(parts[parts.index("layers") + 1])
    d, hq, hkv = arch.layer_head_dim(layer), arch.num_attention_heads, arch.layer_num_kv_heads(layer)
    q = (rank * (hq // world) * d, hq // world * d)
    kv = (rank * hkv // world * d, max(1, hkv // world) * d)  # with hkv < world ranks share a head
    width = arch.layer_intermediate_size(layer)
    ffn = (rank * (width // world), width // world)
    if module == "qkv_proj":
        k_eq_v = arch.attention_k_eq_v and arch.layer_window(layer) is None
        pieces = t.split([hq * d] + [hkv * d] * (1 if k_eq_v else 2))
        return torch.cat([_rows(pieces[0], *q)] + [_rows(p, *kv) for p in pieces[1:]])
    if module == "q_proj":
        return _rows(t, *q)
    if module in ("k_proj", "v_proj"):
        return _rows(t, *kv)
    if module == "gate_up_proj":
        gate, up = t.split([width, width])
        return torch.cat([_rows(gate, *ffn), _rows(up, *ffn)])
    if module in ("gate_proj", "up_proj"):
        return _rows(t, *ffn)
    if kind == "bias":  # a row-parallel bias: added once, after the reduce
        return t
    start, n = q if module == "o_proj" else ffn
    if kind in INT_PACKED_PARTS:  # int32 words and groups of the input (parallel/tp_int.py)
        return int_row_columns(module, kind, t, start, n, world)
    if kind == "weight_scale":
        return _scale_columns(module, t, start, n, world)
    return _rows(t, start, n, dim=1)


def _scale_columns(module: str, scale: torch.Tensor, start: int, n: int, world: int) -> torch.Tensor:
    """A row-parallel layer's FP8 / W8A8 scales for its input columns start .. start + n: per-channel
    ones whole (the outputs are whole rows), block scales [N, KB] the blocks of those columns."""
    if scale.dim() == 1 or scale.shape[1] == 1:
        return scale
    block = columns_per_scale(n * world, scale.shape[1])
    if start % block or n % block:
        raise ModelLoadError(
            f"tensor_parallel_size {world} splits the input of Gemma 4's {module} ({n * world} columns) "
            f"into shares of {n}, which are not whole {block}-column weight-scale blocks; use a smaller "
            "tensor_parallel_size, or a checkpoint without block scales"
        )
    return scale.narrow(1, start // block, n // block)


def local_fused_shards(module: nn.Module) -> None:
    """A sharded Gemma4Attention's fused_shards (its q | k | v rows of qkv_proj) for its local heads;
    other modules are left alone."""
    if not isinstance(module, Gemma4Attention):
        return
    start = 0
    for name, (attr, _, _) in list(module.fused_shards.items()):
        rows = (module.num_heads if name == "q_proj" else module.num_kv_heads) * module.head_dim
        module.fused_shards[name] = (attr, start, rows)
        start += rows
