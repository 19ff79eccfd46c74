"""One rank's share of a model loaded without ever holding the whole model on one device
(load_sharded_model): the model is built shapeless (meta) and sharded by apply_tp (parallel/tp.py), then
each checkpoint tensor is sliced by TPShards (parallel/tp_shards.py) as it streams in. Dummy weights
replay the unsharded loader's draws, so every tensor_parallel_size runs the same random model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from overnight.layers.moe import Experts
from overnight.layers.norm import RMSNorm
from overnight.loader.source import ModelSource
from overnight.models.interface import CausalLM, as_causal_lm
from overnight.parallel.tp import apply_tp
from overnight.parallel.tp_shards import TPShards
from overnight.quant.linear import Fp8Linear


@torch.no_grad()
def load_sharded_model(
    source: ModelSource,
    dtype: torch.dtype,
    device: torch.device | str,
    rank: int,
    world: int,
    seed: int = 0,
    group: dist.ProcessGroup | None = None,
) -> CausalLM:
    """Rank `rank`'s share of the model of `source`, loaded onto `device` without ever holding the whole
    model there: the model is sharded while shapeless (meta), then each checkpoint tensor is sliced as
    it streams in. Dummy weights are drawn whole, tensor by tensor, exactly as the unsharded loader
    draws them, so every tensor_parallel_size runs the same random model."""
    from overnight.loader.expert_form import check_expert_form_device
    from overnight.loader.model_loader import _materialize, build_model, checkpoint_weights
    from overnight.quant.apply import quantize_experts
    from overnight.quant.scheme import QuantScheme, check_fp8_device

    model = apply_tp(build_model(source, dtype, "meta", runs_on=device), rank, world, group)
    if isinstance(source.quantization, QuantScheme):
        check_fp8_device(device, source.quantization)
    check_expert_form_device(source.arch, device)
    _materialize(model, device)
    shards = TPShards(source.arch, rank, world)
    if source.kind == "dummy":
        _fill_dummy(model, build_model(source, dtype, "meta", runs_on=device), shards, seed)
    else:
        # FP8 layers' tensors are converted whole (quant/checkpoint.py), then sliced like the weights.
        weights = checkpoint_weights(source, model, device)
        # A model whose checkpoint layout differs from its load names (gpt-oss's interleaved, stacked
        # experts) lays the tensors out first, so each is sliced in the model's layout.
        layout = getattr(model, "checkpoint_layout", None)
        if layout is not None:
            weights = layout(weights)
        as_causal_lm(model).load_weights((n, shards.shard(n, t)) for n, t in weights)
    if isinstance(source.quantization, QuantScheme):
        quantize_experts(model)
    return as_causal_lm(model.requires_grad_(False).eval())


def _fill_dummy(model: nn.Module, whole: nn.Module, shards: TPShards, seed: int) -> None:
    """The unsharded dummy init, replayed: walk the whole (meta) model's parameters in the same order,
    draw each whole tensor from one seeded generator, keep this rank's slice."""
    from overnight.loader.dummy import DUMMY_RANGE
    from overnight.quant.fp8 import quantize_weight

    local = dict(model.named_parameters())
    norms = {id(m.weight) for m in whole.modules() if isinstance(m, RMSNorm)}
    fp8_layers = {f"{n}.weight": m for n, m in whole.named_modules() if isinstance(m, Fp8Linear)}
    gen = None
    for name, param in whole.named_parameters():
        target = local[name]
        if id(param) in norms:
            target.fill_(1.0)
            continue
        if name.endswith(".weight_scale") and name.removesuffix("_scale") in fp8_layers:
            continue  # filled with its weight
        if param.dtype == torch.uint8 and name.endswith(("gate_up_scales", "down_scales")):
            # MXFP4 scales: loader/dummy.py's constant, no draw (sliced: a padded tail stays zero)
            target.copy_(
                shards.shard(name, torch.full(param.shape, 127 - 10, dtype=torch.uint8, device=target.device))
            )
            continue
        if gen is None:
            gen = torch.Generator(device=target.device).manual_seed(seed)
        if param.dtype == torch.uint8:  # MXFP4 codes: any byte, as loader/dummy.py draws them
            codes = torch.empty(param.shape, dtype=torch.uint8, device=target.device)
            target.copy_(shards.shard(name, codes.random_(0, 256, generator=gen)))
            continue
        layer = fp8_layers.get(name)
        stack = model.get_submodule(name.rpartition(".")[0])
        if isinstance(stack, Experts) and stack.stores_fp8:  # e4m3 while loading: the float stack drawn
            full = torch.empty(param.shape, dtype=stack.compute_dtype, device=target.device)
            full.uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=gen)
            stack.load_fp8_rows_(name.rpartition(".")[2], shards.shard(name, full))
            continue
        dtype = param.dtype if layer is None else layer.out_dtype
        full = torch.empty(param.shape, dtype=dtype, device=target.device)
        full.uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=gen)
        if layer is None:
            target.copy_(shards.shard(name, full))
            continue
        data, scale = quantize_weight(full, layer.block_k)
        target.copy_(shards.shard(name, data))
        local[f"{name}_scale"].copy_(shards.shard(f"{name}_scale", scale))
