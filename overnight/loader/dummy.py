"""Random weights of the right shapes, for benchmarks and tests that need no real checkpoint.

FP8 layers draw the float weight an nn.Linear of their shape would draw, in the same order, and store it
quantized: a quantized dummy model is the quantized version of the float dummy model with the same seed.
Experts held as e4m3 while loading (layers/moe.py store_fp8_) draw each float stack the same way.
"""

from __future__ import annotations

import torch
from torch import nn

from overnight.layers.moe import Experts
from overnight.layers.norm import RMSNorm
from overnight.quant.linear import Fp8Linear

# Small enough that activations stay far from overflow in fp16 through any depth.
DUMMY_RANGE = 1e-3


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Fill every parameter in place, on its own device: RMSNorm weights 1, everything else
    uniform(-DUMMY_RANGE, DUMMY_RANGE) from a generator seeded with `seed` (same seed, same weights);
    LayerNorm weights 1 and biases 0."""
    norm_weights = {id(m.weight) for m in model.modules() if isinstance(m, (RMSNorm, nn.LayerNorm))}
    norm_biases = {id(m.bias) for m in model.modules() if isinstance(m, nn.LayerNorm) and m.bias is not None}
    fp8_layers = {id(m.weight): m for m in model.modules() if isinstance(m, Fp8Linear)}
    fp8_scales = {id(m.weight_scale) for m in fp8_layers.values()}
    mxfp4_scales = {id(t) for t in _mxfp4_scales(model)}
    fp8_experts = _fp8_expert_stacks(model)
    generators: dict[torch.device, torch.Generator] = {}
    for param in model.parameters():  # a tied weight is visited once
        if param.is_meta or id(param) in fp8_scales:
            continue  # shape-only models (tests) have nothing to fill; scales come with their weight
        if id(param) in norm_weights or id(param) in norm_biases:
            param.fill_(1.0 if id(param) in norm_weights else 0.0)
            continue
        gen = generators.get(param.device)
        if gen is None:
            gen = generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        layer = fp8_layers.get(id(param))
        stack = fp8_experts.get(id(param))
        if stack is not None:  # the float stack drawn as the compute-dtype model draws it, stored e4m3
            experts, name = stack
            dense = torch.empty(param.shape, dtype=experts.compute_dtype, device=param.device)
            experts.load_fp8_rows_(name, dense.uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=gen))
        elif param.dtype == torch.uint8:  # MXFP4 experts (layers/moe.py): any codes, scales near DUMMY_RANGE
            if id(param) in mxfp4_scales:
                param.fill_(127 - 10)  # 2^-10, so weights stay below 6 * 2^-10
            else:
                param.random_(0, 256, generator=gen)
        elif layer is None:
            param.uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=gen)
        else:
            dense = torch.empty(param.shape, dtype=layer.out_dtype, device=param.device)
            layer.load_dense_(dense.uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=gen))


def _fp8_expert_stacks(model: nn.Module) -> dict[int, tuple[Experts, str]]:
    """id(projection) -> (its Experts, its name) for experts held as e4m3 while loading."""
    return {
        id(getattr(m, name)): (m, name)
        for m in model.modules()
        if isinstance(m, Experts) and m.stores_fp8
        for name in ("gate_up_proj", "down_proj")
    }


def _mxfp4_scales(model: nn.Module) -> list[torch.Tensor]:
    return [
        t
        for m in model.modules()
        if isinstance(m, Experts)
        for t in (m.gate_up_scales, m.down_scales)
        if t is not None
    ]
