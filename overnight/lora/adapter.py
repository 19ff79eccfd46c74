"""A PEFT LoRA folder: read and checked against the base model without touching its weights
(check_adapter, cheap enough for every new adapter a request names), then loaded (load_adapter).

A PEFT checkpoint stores, per adapted projection of layer i,
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight   [r, in]
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight   [out, r]
and the layer computes W x + s * B (A x), with s = lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)).
Our models fuse q/k/v into qkv_proj and gate/up into gate_up_proj: an adapted q_proj is slice 0 of
qkv_proj's LoRA, k_proj slice 1, and so on (PROJECTIONS). Loading folds s into B, so the kernels
never see a scale.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

from overnight.config import ModelArch
from overnight.errors import InvalidRequestError
from overnight.lora.request import LoRARequest

if TYPE_CHECKING:
    import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# Architectures whose projections PROJECTIONS describes (the dense decoder blocks of models/llama.py;
# Qwen3-MoE shares its attention, and its sparse layers have no gate/up/down projection to adapt).
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3_moe")


@dataclass(frozen=True)
class Projection:
    """Where a checkpoint projection lives in our model: module (under model.layers.N), its slice index
    inside the fused module's LoRA, and its input / output sizes."""

    module: str
    slice: int
    kind: str  # "attention" | "mlp"

    def dims(self, arch: ModelArch, name: str) -> tuple[int, int]:
        h, q, kv, inter = arch.hidden_size, arch.q_size, arch.kv_size, arch.intermediate_size
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, inter),
            "up_proj": (h, inter),
            "down_proj": (inter, h),
        }[name]


PROJECTIONS: dict[str, Projection] = {
    "q_proj": Projection("self_attn.qkv_proj", 0, "attention"),
    "k_proj": Projection("self_attn.qkv_proj", 1, "attention"),
    "v_proj": Projection("self_attn.qkv_proj", 2, "attention"),
    "o_proj": Projection("self_attn.o_proj", 0, "attention"),
    "gate_proj": Projection("mlp.gate_up_proj", 0, "mlp"),
    "up_proj": Projection("mlp.gate_up_proj", 1, "mlp"),
    "down_proj": Projection("mlp.down_proj", 0, "mlp"),
}

# Output slices of each wrapped module, in the fused layout (their sizes come from ModelArch).
MODULE_SLICES: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "self_attn.o_proj": ("o_proj",),
    "mlp.gate_up_proj": ("gate_proj", "up_proj"),
    "mlp.down_proj": ("down_proj",),
}

_KEY = re.compile(
    r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight"
)
_UNSUPPORTED_TARGETS = {"embed_tokens": "the embeddings", "lm_head": "the LM head"}


@dataclass(frozen=True)
class AdapterSpec:
    """A checked adapter: its rank, scale, and which (layer, projection) it adapts. No weights."""

    request: LoRARequest
    rank: int
    scaling: float
    tensors: tuple[tuple[str, int, str], ...]  # (checkpoint key of lora_A, layer, projection name)


@dataclass
class LoadedAdapter:
    """An adapter's weights on the host: (layer, module) -> [(slice, A [r, in], s * B [out, r])]."""

    spec: AdapterSpec
    weights: dict[tuple[int, str], list[tuple[int, torch.Tensor, torch.Tensor]]]

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for parts in self.weights.values() for _, a, b in parts)


def _refuse(req: LoRARequest, problem: str) -> InvalidRequestError:
    return InvalidRequestError(f"LoRA adapter {req.lora_name!r} ({req.lora_path}): {problem}")


def read_safetensors_header(path: str) -> dict[str, dict]:
    """The tensor table of a safetensors file (name -> dtype, shape, offsets), without the data."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        if size > 100 * 2**20:
            raise ValueError(f"{path}: header of {size} bytes is not a safetensors header")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header


def check_adapter(req: LoRARequest, arch: ModelArch, max_lora_rank: int) -> AdapterSpec:
    """Read the adapter's config and tensor table and check them against the base model; raise
    InvalidRequestError naming the problem (rank, targets, DoRA, bias, shapes of another model)."""
    folder = req.lora_path
    config_path = os.path.join(folder, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise _refuse(req, f"no {CONFIG_FILE} in this folder (a PEFT LoRA adapter folder is expected)")
    try:
        with open(config_path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise _refuse(req, f"{CONFIG_FILE} cannot be read: {e}") from None
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise _refuse(req, f"peft_type {peft_type!r} is not LoRA")
    rank = int(cfg.get("r", 0))
    if rank < 1:
        raise _refuse(req, f"rank r={rank} must be at least 1")
    if rank > max_lora_rank:
        raise _refuse(
            req,
            f"rank r={rank} exceeds max_lora_rank {max_lora_rank}: start the engine with max_lora_rank >= {rank}",
        )
    if cfg.get("use_dora"):
        raise _refuse(req, "DoRA (use_dora) adapters are not supported")
    if cfg.get("bias", "none") != "none":
        raise _refuse(req, f"bias {cfg.get('bias')!r} is not supported (only 'none')")
    if cfg.get("lora_bias"):
        raise _refuse(req, "lora_bias (a bias on lora_B) is not supported")
    if cfg.get("modules_to_save"):
        raise _refuse(
            req, f"modules_to_save {cfg['modules_to_save']} is not supported (fully trained modules)"
        )
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise _refuse(req, f"{key} (per-module ranks or alphas) is not supported")
    targets = cfg.get("target_modules") or []
    if isinstance(targets, str):
        targets = [targets]
    for target in targets:
        for name, what in _UNSUPPORTED_TARGETS.items():
            if name in target:
                raise _refuse(req, f"target module {target!r} ({what}) is not supported")
    if arch.architecture not in SUPPORTED_ARCHITECTURES:
        raise _refuse(req, f"LoRA is not supported on {arch.architecture!r} models")

    weights_path = os.path.join(folder, WEIGHTS_FILE)
    if not os.path.isfile(weights_path):
        raise _refuse(req, f"no {WEIGHTS_FILE} in this folder (only the safetensors format is read)")
    try:
        header = read_safetensors_header(weights_path)
    except (OSError, ValueError) as e:
        raise _refuse(req, f"{WEIGHTS_FILE} cannot be read: {e}") from None
    tensors = _check_tensors(req, header, arch, rank)
    alpha = float(cfg.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return AdapterSpec(req, rank, scaling, tensors)


def _check_tensors(
    req: LoRARequest, header: dict[str, dict], arch: ModelArch, rank: int
) -> tuple[tuple[str, int, str], ...]:
    pairs: dict[tuple[int, str], dict[str, list[int]]] = {}
    keys: dict[tuple[int, str], str] = {}
    for key, info in header.items():
        match = _KEY.fullmatch(key)
        if match is None:
            for name, what in _UNSUPPORTED_TARGETS.items():
                if name in key:
                    raise _refuse(req, f"tensor {key} adapts {what}, which is not supported")
            if "lora_magnitude" in key:
                raise _refuse(req, "DoRA (use_dora) adapters are not supported")
            raise _refuse(req, f"tensor {key} is not a LoRA weight of a decoder layer's projection")
        layer, _, proj, ab = int(match.group(1)), match.group(2), match.group(3), match.group(4)
        if proj not in PROJECTIONS:
            raise _refuse(
                req, f"target module {proj!r} is not supported (supported: {', '.join(PROJECTIONS)})"
            )
        if layer >= arch.num_hidden_layers:
            raise _refuse(
                req,
                f"tensor {key} is for layer {layer}, but the base model has {arch.num_hidden_layers} "
                "layers: the adapter was trained for another base model",
            )
        if PROJECTIONS[proj].kind == "mlp" and arch.is_moe_layer(layer):
            raise _refuse(req, f"target module {proj!r} of layer {layer}: adapting experts is not supported")
        pairs.setdefault((layer, proj), {})[ab] = list(info["shape"])
        if ab == "A":
            keys[(layer, proj)] = key
    out = []
    for (layer, proj), shapes in sorted(pairs.items()):
        if set(shapes) != {"A", "B"}:
            raise _refuse(req, f"layer {layer} {proj}: lora_A and lora_B must both be present")
        d_in, d_out = PROJECTIONS[proj].dims(arch, proj)
        want = {"A": [rank, d_in], "B": [d_out, rank]}
        for ab in "AB":
            if shapes[ab] != want[ab]:
                raise _refuse(
                    req,
                    f"layer {layer} {proj}.lora_{ab} has shape {shapes[ab]}, this base model needs "
                    f"{want[ab]} (rank {rank}): the adapter does not match the base model's architecture",
                )
        out.append((keys[(layer, proj)], layer, proj))
    if not out:
        raise _refuse(req, f"{WEIGHTS_FILE} holds no LoRA weights")
    return tuple(out)


def load_adapter(spec: AdapterSpec, dtype: torch.dtype) -> LoadedAdapter:
    """The adapter's weights on the host in `dtype`, B already multiplied by the scale."""
    from safetensors import safe_open

    path = os.path.join(spec.request.lora_path, WEIGHTS_FILE)
    weights: dict[tuple[int, str], list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    with safe_open(path, framework="pt") as f:
        for key_a, layer, proj in spec.tensors:
            a = f.get_tensor(key_a).float()
            b = f.get_tensor(key_a.replace("lora_A", "lora_B")).float() * spec.scaling
            where = PROJECTIONS[proj]
            weights.setdefault((layer, where.module), []).append((where.slice, a.to(dtype), b.to(dtype)))
    return LoadedAdapter(spec, weights)


class AdapterChecks:
    """check_adapter once per adapter id (the engine's side: no weights are read). An id keeps the
    folder it was first seen with; a request naming another folder under it is refused."""

    def __init__(self, arch: ModelArch, max_lora_rank: int, capacity: int = 4096) -> None:
        self.arch = arch
        self.max_lora_rank = max_lora_rank
        self.capacity = capacity
        self.specs: dict[int, AdapterSpec] = {}

    def check(self, req: LoRARequest) -> AdapterSpec:
        spec = self.specs.get(req.lora_int_id)
        if spec is not None:
            if spec.request.lora_path != req.lora_path:
                raise InvalidRequestError(
                    f"lora_int_id {req.lora_int_id} names adapter {spec.request.lora_name!r} at "
                    f"{spec.request.lora_path}, not {req.lora_path}: give each adapter its own id"
                )
            return spec
        spec = check_adapter(req, self.arch, self.max_lora_rank)
        if len(self.specs) >= self.capacity:
            self.specs.pop(next(iter(self.specs)))
        self.specs[req.lora_int_id] = spec
        return spec
