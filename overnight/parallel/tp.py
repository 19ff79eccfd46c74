"""Tensor parallelism applied to a built model from outside (apply_tp): each rank's modules are rewritten
in place to hold its share of every weight, the model files staying unaware of it.

Column-parallel layers (qkv_proj, gate_up_proj, the hybrids' and latent attention's per-head projections)
keep their rows of r; row-parallel ones (o_proj, down_proj, the mixers' out_proj) become modules that
all-reduce their partial outputs (parallel/tp_modules.py, tp_int.py for integer layers); stacked experts
become RowParallelExperts (parallel/tp_experts.py); the embedding and LM head become vocab-parallel. Which
rows and columns a rank keeps is TPShards' rule (parallel/tp_shards.py, with the layout table);
loading a rank's share without ever holding the whole model is parallel/tp_load.py.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from overnight.layers.moe import Experts
from overnight.layers.norm import RMSNorm
from overnight.models.deepseek import MLAttention
from overnight.models.gated_deltanet import GatedDeltaNet
from overnight.models.interface import as_causal_lm
from overnight.models.mamba2_mixer import Mamba2Mixer
from overnight.parallel.tp_experts import RowParallelExperts, keep
from overnight.parallel.tp_gemma4 import PER_LAYER_TABLE, is_gemma4, local_fused_shards
from overnight.parallel.tp_hybrid import COLUMN_PARALLEL, shard_gated_deltanet
from overnight.parallel.tp_int import (
    RowParallelInt8Linear,
    RowParallelIntExperts,
    RowParallelWeightOnlyIntLinear,
)
from overnight.parallel.tp_mamba2 import COLUMN_PARALLEL as MAMBA2_COLUMN_PARALLEL
from overnight.parallel.tp_mamba2 import ROW_PARALLEL as MAMBA2_ROW_PARALLEL
from overnight.parallel.tp_mamba2 import reduce_moe_blocks_once, shard_mamba2_mixer
from overnight.parallel.tp_mla import COLUMN_PARALLEL as MLA_COLUMN_PARALLEL
from overnight.parallel.tp_modules import (
    ParallelLMHead,
    RowParallelFp8Linear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from overnight.parallel.tp_shards import ROW_PARALLEL, TOWER_MODULES, TPShards
from overnight.quant.int_linear import Int8Linear, WeightOnlyIntLinear
from overnight.quant.int_moe import IntExperts
from overnight.quant.linear import Fp8Linear


def _set_module(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, module)


@torch.no_grad()
def apply_tp(model: nn.Module, rank: int, world: int, group: dist.ProcessGroup | None = None) -> nn.Module:
    """Shard `model` in place for rank `rank` of `world` and return it.

    Works on a loaded model (its weights are sliced) and on a meta model (only shapes change; fill it
    afterwards with load_sharded_model's loaders). The model must have .arch, .packed_modules_mapping,
    attention modules with qkv_proj / o_proj and num_heads / num_kv_heads, and MLPs with gate_up_proj /
    down_proj or Experts. Afterwards model.arch is the rank's local arch, so load_weights fuses checkpoint tensors
    into the local layout.
    """
    lm = as_causal_lm(model)  # the model's contract, beside its nn.Module side
    shards = TPShards(lm.arch, rank, world)
    shards.check()
    fused = {fused_name for fused_name, _ in lm.packed_modules_mapping.values()}
    row_parallel = set(ROW_PARALLEL)
    if lm.arch.is_mamba2:  # Mamba2 mixers and the Granite / Nemotron-H MLPs: tp_mamba2.py
        fused |= set(MAMBA2_COLUMN_PARALLEL)
        row_parallel |= set(MAMBA2_ROW_PARALLEL)
    elif lm.arch.num_linear_layers:
        fused |= set(COLUMN_PARALLEL)
        row_parallel.add("out_proj")
    if is_gemma4(lm.arch):
        fused.add("q_proj")  # a KV-shared layer's own q projection
    if lm.arch.shared_expert_intermediate_size:  # shared experts keep separate gate / up projections
        fused |= {"gate_proj", "up_proj"}
    if lm.arch.is_mla:  # latent attention's per-head projections: tp_mla.py
        fused |= set(MLA_COLUMN_PARALLEL)
    head = getattr(model, "lm_head", None)
    embed_name = next(
        n
        for n, m in model.named_modules()
        if n.endswith("embed_tokens") or (n.endswith(".embeddings") and isinstance(m, nn.Embedding))
    )
    embed = model.get_submodule(embed_name)
    assert isinstance(embed, nn.Embedding)
    tied = head is not None and head.weight is embed.weight

    for name, module in list(model.named_modules()):
        leaf = name.rpartition(".")[2]
        if not TOWER_MODULES.isdisjoint(name.split(".")):
            continue
        if isinstance(module, GatedDeltaNet):  # its conv channels and per-head parameters
            shard_gated_deltanet(module, name, shards.shard, shards.local_arch)
        if isinstance(module, Mamba2Mixer):  # its conv channels, per-head parameters, gated norm
            shard_mamba2_mixer(module, name, shards.shard, shards.local_arch, rank, world, group)
        if isinstance(module, IntExperts):  # packed integer experts: tp_int.py
            _set_module(model, name, RowParallelIntExperts(module, name, shards.shard, group))
        if leaf in fused and isinstance(module, (nn.Linear, Fp8Linear, WeightOnlyIntLinear, Int8Linear)):
            for pname, param in list(module.named_parameters(recurse=False)):  # weight, scales, bias
                sliced = keep(shards.shard(f"{name}.{pname}", param))
                setattr(module, pname, nn.Parameter(sliced, requires_grad=False))
            rows = module.packed_weight if isinstance(module, WeightOnlyIntLinear) else module.weight
            assert isinstance(rows, torch.Tensor)
            module.out_features = rows.shape[0]
        elif leaf in row_parallel and isinstance(module, WeightOnlyIntLinear):
            _set_module(model, name, RowParallelWeightOnlyIntLinear(module, name, shards.shard, group))
        elif leaf in row_parallel and isinstance(module, Int8Linear):
            _set_module(model, name, RowParallelInt8Linear(module, name, shards.shard, group))
        elif leaf in row_parallel and isinstance(module, Fp8Linear):
            weight = keep(shards.shard(f"{name}.weight", module.weight))
            scale = keep(shards.shard(f"{name}.weight_scale", module.weight_scale))
            _set_module(model, name, RowParallelFp8Linear(module, weight, scale, group))
        elif leaf in row_parallel and isinstance(module, nn.Linear):
            weight = keep(shards.shard(f"{name}.weight", module.weight))
            _set_module(model, name, RowParallelLinear(weight, module.bias, group))
        elif isinstance(module, Experts):
            sharded = RowParallelExperts(module, name, shards.shard, group)
            if module.gate_up_scale is not None:  # FP8 experts already quantized: rows keep their scales
                rows = shards.shard(f"{name}.gate_up_proj", module.gate_up_scale[:, :, None])
                sharded.gate_up_scale = keep(rows[:, :, 0])
                sharded.down_scale = module.down_scale  # down keeps its rows (its columns are split)
                sharded.compute_dtype = module.compute_dtype
            _set_module(model, name, sharded)
        if leaf in ("q_norm", "k_norm") and lm.arch.qk_norm_whole and isinstance(module, RMSNorm):
            module.weight = nn.Parameter(
                keep(shards.shard(f"{name}.weight", module.weight)), requires_grad=False
            )
        if getattr(module, "qk_norm_whole", False):  # its norms' statistics summed over the ranks
            module.qk_norm_world = world
            module.qk_norm_reduce = partial(dist.all_reduce, group=group)
        sinks = getattr(module, "sinks", None)
        if isinstance(sinks, nn.Parameter):  # gpt-oss: split with their heads
            module.sinks = nn.Parameter(keep(shards.shard(f"{name}.sinks", sinks)), requires_grad=False)
        if isinstance(module, MLAttention):
            module.num_heads //= world
        if hasattr(module, "num_kv_heads") and hasattr(module, "num_heads"):
            module.num_heads //= world
            module.num_kv_heads = max(1, module.num_kv_heads // world)
            local_fused_shards(module)  # Gemma 4's per-layer q | k | v rows

    if lm.arch.is_mamba2 and lm.arch.moe_blocks:  # Nemotron 3: routed + shared reduced once a block
        reduce_moe_blocks_once(model, group)
    new_embed = VocabParallelEmbedding(
        keep(shards.shard(f"{embed_name}.weight", embed.weight)), shards.vocab_start, group
    )
    _set_module(model, embed_name, new_embed)
    if head is not None:
        weight = new_embed.weight if tied else keep(shards.shard("lm_head.weight", head.weight))
        _set_module(model, "lm_head", ParallelLMHead(weight, lm.arch.vocab_size, group))
    if is_gemma4(lm.arch) and lm.arch.hidden_size_per_layer_input:  # its per-layer-input table
        name = next(n for n, _ in model.named_modules() if n.endswith(PER_LAYER_TABLE))
        table = model.get_submodule(name)
        assert isinstance(table, nn.Embedding)
        rows = keep(shards.shard(f"{name}.weight", table.weight))
        _set_module(model, name, VocabParallelEmbedding(rows, rank * rows.shape[0], group))
    lm.arch = shards.local_arch
    return model
