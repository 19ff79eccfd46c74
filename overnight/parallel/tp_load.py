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
from overnight.loader.source import ModelSource
from overnight.models.interface import CausalLM, as_causal_lm, finish_loading
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
    finish_loading(model)
    if isinstance(source.quantization, QuantScheme):
        quantize_experts(model)
    return as_causal_lm(model.requires_grad_(False).eval())


def _fill_dummy(model: nn.Module, whole: nn.Module, shards: TPShards, seed: int) -> None:
    """The unsharded dummy init (loader/dummy.py init_dummy_weights) replayed by its rules: the
    constants (dummy_constants: norms, quantized layers' scales and zero points, buffers included)
    filled on this rank, drawing nothing; then the whole (meta) model's parameters walked in the same
    order, each whole tensor drawn from one seeded generator (draw_: floats, and integer codes such as
    packed int32 words, int8 weights, MXFP4 blocks) and this rank's slice kept; then the act-order
    input permutations drawn, which stay whole on every rank (parallel/tp_int.py)."""
    from overnight.loader.dummy import DUMMY_RANGE, draw_, dummy_constants, input_perms
    from overnight.quant.fp8 import quantize_weight

    local = dict(model.named_parameters())
    local_buffers = dict(model.named_buffers())  # packed experts' scales and zeros, input_perm
    names = {id(t): n for n, t in (*whole.named_parameters(), *whole.named_buffers())}
    constants = {names[id(t)]: (t, value) for t, value in dummy_constants(whole).values()}
    fp8_layers = {f"{n}.weight": m for n, m in whole.named_modules() if isinstance(m, Fp8Linear)}
    gen: torch.Generator | None = None

    def generator(device: torch.device) -> torch.Generator:
        nonlocal gen
        if gen is None:
            gen = torch.Generator(device=device).manual_seed(seed)
        return gen

    for name, (t, value) in constants.items():
        target = local[name] if name in local else local_buffers[name]
        if isinstance(whole.get_submodule(name.rpartition(".")[0]), Experts):
            # MXFP4 scales: cut from a whole one, as apply_tp cuts the unsharded model's, so that a
            # padded tail (TPShards.moe_share) stays zero
            target.copy_(shards.shard(name, torch.full(t.shape, value, dtype=t.dtype, device=target.device)))
        else:
            target.fill_(value)
    for name, param in whole.named_parameters():
        if name in constants:
            continue
        if name.endswith(".weight_scale") and name.removesuffix("_scale") in fp8_layers:
            continue  # filled with its weight
        target = local[name]
        g = generator(target.device)
        layer = fp8_layers.get(name)
        stack = model.get_submodule(name.rpartition(".")[0])
        if isinstance(stack, Experts) and stack.stores_fp8:  # e4m3 while loading: the float stack drawn
            full = torch.empty(param.shape, dtype=stack.compute_dtype, device=target.device)
            full.uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=g)
            stack.load_fp8_rows_(name.rpartition(".")[2], shards.shard(name, full))
        elif layer is not None:
            full = torch.empty(param.shape, dtype=layer.out_dtype, device=target.device)
            data, scale = quantize_weight(
                full.uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=g), layer.block_k
            )
            target.copy_(shards.shard(name, data))
            local[f"{name}_scale"].copy_(shards.shard(f"{name}_scale", scale))
        else:
            full = torch.empty(param.shape, dtype=param.dtype, device=target.device)
            draw_(full, g)
            target.copy_(shards.shard(name, full))
    for name, perm in input_perms(whole).items():
        target = local_buffers[name]
        target.copy_(torch.randperm(perm.numel(), generator=generator(target.device), device=target.device))
