"""Random weights of the right shapes, for benchmarks and tests that need no real checkpoint.

FP8 layers draw the float weight an nn.Linear of their shape would draw, in the same order, and store it
quantized: a quantized dummy model is the quantized version of the float dummy model with the same seed.
Experts held as e4m3 while loading (layers/moe.py store_fp8_) draw each float stack the same way.

Integer tensors (the packed codes of W4A16 / W8A16 layers and experts, quant/int_linear.py and
quant/int_moe.py; W8A8's int8 weights; MXFP4's uint8 blocks) are random bits over their dtype's whole
range from the same generator, so every code is as likely as any other; their scales and zero points
are constants, drawing nothing, that keep the dequantized weights within the float model's range
(dummy_constants). A float8 tensor outside FP8 layers and experts is drawn in float32 and rounded to it.
"""

from __future__ import annotations

import torch
from torch import nn

from overnight.layers.moe import Experts
from overnight.layers.norm import RMSNorm
from overnight.quant.int_linear import Int8Linear, WeightOnlyIntLinear
from overnight.quant.int_moe import IntExperts
from overnight.quant.linear import Fp8Linear

# Small enough that activations stay far from overflow in fp16 through any depth.
DUMMY_RANGE = 1e-3


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Fill every parameter in place, on its own device: float tensors uniform(-DUMMY_RANGE, DUMMY_RANGE)
    and integer ones random bits (draw_), from a generator seeded with `seed` (same seed, same weights);
    norm weights, LayerNorm biases and quantized layers' scales and zero points (buffers included)
    constants drawing nothing (dummy_constants); act-order layers' input permutations random, drawn
    after every parameter. parallel/tp_load.py replays these draws for one tensor-parallel rank."""
    fp8_layers = {id(m.weight): m for m in model.modules() if isinstance(m, Fp8Linear)}
    fp8_scales = {id(m.weight_scale) for m in fp8_layers.values()}
    fp8_experts = _fp8_expert_stacks(model)
    constants = dummy_constants(model)
    generators: dict[torch.device, torch.Generator] = {}

    def generator(device: torch.device) -> torch.Generator:
        gen = generators.get(device)
        if gen is None:
            gen = generators[device] = torch.Generator(device=device).manual_seed(seed)
        return gen

    for tensor, value in constants.values():
        if not tensor.is_meta:
            tensor.fill_(value)
    for param in model.parameters():  # a tied weight is visited once
        if param.is_meta or id(param) in fp8_scales or id(param) in constants:
            continue  # shape-only models (tests) have nothing to fill; scales come with their weight
        gen = generator(param.device)
        layer = fp8_layers.get(id(param))
        stack = fp8_experts.get(id(param))
        if stack is not None:  # the float stack drawn as the compute-dtype model draws it, stored e4m3
            experts, name = stack
            dense = torch.empty(param.shape, dtype=experts.compute_dtype, device=param.device)
            experts.load_fp8_rows_(name, dense.uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=gen))
        elif layer is not None:
            dense = torch.empty(param.shape, dtype=layer.out_dtype, device=param.device)
            layer.load_dense_(dense.uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=gen))
        else:
            draw_(param, gen)
    for perm in input_perms(model).values():  # act-order layers gather their input by a permutation
        if not perm.is_meta:
            gen = generator(perm.device)
            perm.copy_(torch.randperm(perm.numel(), generator=gen, device=perm.device))


def draw_(t: torch.Tensor, gen: torch.Generator) -> None:
    """Fill `t` from `gen`: floating point uniform(-DUMMY_RANGE, DUMMY_RANGE) (float8, which uniform_
    does not take, drawn in float32 and rounded: without a scale of its own most values round to 0),
    integers uniform over their dtype's whole range (packed int4 codes: any nibble), bool 0 or 1."""
    if t.dtype.is_floating_point and t.element_size() == 1:
        wide = torch.empty(t.shape, dtype=torch.float32, device=t.device)
        t.copy_(wide.uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=gen))
    elif t.dtype.is_floating_point:
        t.uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=gen)
    elif t.dtype == torch.bool:
        t.random_(generator=gen)
    else:  # random_(low, high) takes [low, high); None: up to the dtype's largest value (int64)
        info = torch.iinfo(t.dtype)
        t.random_(info.min, info.max + 1 if info.max < torch.iinfo(torch.int64).max else None, generator=gen)


def dummy_constants(model: nn.Module) -> dict[int, tuple[torch.Tensor, float]]:
    """id(tensor) -> (tensor, its value) for the tensors filled without a draw: RMSNorm and LayerNorm
    weights 1, LayerNorm biases 0, and the quantized weights' scales and zero points (parameters or
    buffers), below.

    MXFP4 experts' scales: 2^-10 (e8m0 exponent 117), so weights (e2m1 values up to 6) stay below
    6 * 2^-10, near DUMMY_RANGE.

    Integer codes are uniform over their whole range (draw_), so a b-bit code may sit anywhere in
    [0, 2^b). Drawn like the float parameters, a zero point would be ~0 and a scale in [-R, R]
    (R = DUMMY_RANGE): weights up to (2^b - 1) R (15 R in int4, 255 R in int8), every weight of a group
    of the scale's sign. Instead the zero point is the middle code 2^(b-1) (the symmetric formats' own,
    which a symmetric layer assumes without storing it) and the scale R / 2^(b-1), positive as
    checkpoints' are: code - zero is in [-2^(b-1), 2^(b-1)), so the dequantized weights take 2^b evenly
    spaced values in [-R, R), centred as the float model's uniform(-R, R) is. W8A8's int8 weights
    (symmetric, zero 0) are in [-128, 128) likewise, their per-row scale R / 128."""
    out: dict[int, tuple[torch.Tensor, float]] = {}

    def put(t: torch.Tensor | None, value: float) -> None:
        if t is not None:
            out[id(t)] = (t, value)

    for m in model.modules():
        if isinstance(m, (RMSNorm, nn.LayerNorm)):
            put(m.weight, 1.0)
            put(m.bias if isinstance(m, nn.LayerNorm) else None, 0.0)
        elif isinstance(m, Experts):
            put(m.gate_up_scales, 127 - 10)
            put(m.down_scales, 127 - 10)
        elif isinstance(m, WeightOnlyIntLinear):
            mid = float(1 << (m.bits - 1))
            put(m.group_scale, DUMMY_RANGE / mid)
            put(m.group_zero, mid)
        elif isinstance(m, IntExperts):  # scales and zero points are buffers here
            mid = float(1 << (m.bits - 1))
            put(m.gate_up_scale, DUMMY_RANGE / mid)
            put(m.down_scale, DUMMY_RANGE / mid)
            put(m.gate_up_zero, mid)
            put(m.down_zero, mid)
        elif isinstance(m, Int8Linear):
            put(m.weight_scale, DUMMY_RANGE / 128)
    return out


def input_perms(model: nn.Module) -> dict[str, torch.Tensor]:
    """name -> input_perm of the act-order layers, in the order the dummy init draws them."""
    return {
        f"{name}.input_perm": m.input_perm
        for name, m in model.named_modules()
        if isinstance(m, WeightOnlyIntLinear) and m.input_perm is not None
    }


def _fp8_expert_stacks(model: nn.Module) -> dict[int, tuple[Experts, str]]:
    """id(projection) -> (its Experts, its name) for experts held as e4m3 while loading."""
    return {
        id(getattr(m, name)): (m, name)
        for m in model.modules()
        if isinstance(m, Experts) and m.stores_fp8
        for name in ("gate_up_proj", "down_proj")
    }
