"""A PEFT LoRA folder: read and checked against the base model without touching its weights
(check_adapter, cheap enough for every new adapter a request names), then loaded (load_adapter).

A PEFT checkpoint stores, per adapted projection of layer i,
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight   [r, in]
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight   [out, r]
and the layer computes W x + s * B (A x), with s = lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)).
Our models fuse q/k/v into qkv_proj and gate/up into gate_up_proj: an adapted q_proj is slice 0 of
qkv_proj's LoRA, k_proj slice 1, and so on; a checkpoint's fused projection (Phi-3's qkv_proj) covers
all of a module's slices (targets.py has each family's table). Loading folds s into B, so the kernels
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

from overnight.arch import ModelArch
from overnight.errors import InvalidRequestError
from overnight.lora.request import LoRARequest
from overnight.lora.targets import (
    SUPPORTED_ARCHITECTURES,
    family_targets,
    is_sparse,
    locate,
    module_dims,
    num_layers,
)

if TYPE_CHECKING:
    import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# A decoder layer's projection, under the text model's own prefix or an image checkpoint's language model
# (transformers 5 saves model.language_model.layers, 4.x language_model.model.layers; Nemotron-H's
# published checkpoints backbone.layers).
_KEY = re.compile(
    r"(?:base_model\.model\.)?(?:model\.language_model\.|language_model\.model\.|model\.|backbone\.)"
    r"layers\.(\d+)\.([\w.]+?)\.lora_([AB])\.weight"
)
_UNSUPPORTED_TARGETS = {
    "embed_tokens": "the embeddings",
    "lm_head": "the LM head",
    "vision_tower": "the vision tower",
    "vision_model": "the vision tower",
    "visual": "the vision tower",
    "multi_modal_projector": "the multimodal projector",
}
# Paths inside a layer that belong to a mixture of experts (Mixtral's block_sparse_moe in older
# transformers, experts.N.{w1,w2,w3} or stacked experts, the router: mlp.gate / mlp.router), unless the
# family's table lists them (a shared expert of Llama 4 or Qwen3.5-MoE).
_EXPERT_PARTS = ("expert", "block_sparse_moe", "router")


@dataclass(frozen=True)
class AdapterSpec:
    """A checked adapter: its rank, scale, and which (layer, projection) it adapts. No weights."""

    request: LoRARequest
    rank: int
    scaling: float
    tensors: tuple[AdaptedTensor, ...]


@dataclass(frozen=True)
class AdaptedTensor:
    """One adapted projection of one layer: its lora_A key, and where its A / B go in our model."""

    key_a: str
    layer: int
    name: str  # the checkpoint projection (q_proj, Phi-3's fused qkv_proj, ...)
    module: str  # our wrapped module (MODULE_SLICES)
    slices: tuple[int, ...]  # the module's output slices it covers
    rows: tuple[int, ...]  # B's rows per slice, in order (a fused projection's B is split at these)


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
    if cfg.get("target_parameters"):
        raise _refuse(
            req,
            f"target_parameters {cfg['target_parameters']} (LoRA on parameters such as stacked MoE experts) "
            "is not supported",
        )
    if not family_targets(arch):
        raise _refuse(
            req,
            f"LoRA is not supported on {arch.architecture!r} models (supported families: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)})",
        )

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
) -> tuple[AdaptedTensor, ...]:
    targets = family_targets(arch)
    # "self_attn.q_proj" -> "q_proj": the path inside a layer at which the family's checkpoints hold it
    by_path = {where.path(name): name for name, where in targets.items()}
    supported = f"{', '.join(targets)} on {arch.architecture} models"
    # a MoE layer's attention / linear-attention part: not under its mixture of experts
    mixers = (
        "self_attn.",
        *{w.path(n).partition(".")[0] + "." for n, w in targets.items() if w.kind == "mixer"},
    )
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
        layer, path, ab = int(match.group(1)), match.group(2), match.group(3)
        if layer >= num_layers(arch):
            raise _refuse(
                req,
                f"tensor {key} is for layer {layer}, but the base model has {num_layers(arch)} "
                "layers: the adapter was trained for another base model",
            )
        proj = by_path.get(path)
        # a sparse layer's MLP or unknown parts of it (not an MLP beside the experts, nor attention or
        # a linear mixer; every part of a Nemotron-H MoE block)
        sparse = is_sparse(arch, layer) and (proj is None or targets[proj].kind == "mlp")
        sparse = sparse and (bool(arch.block_pattern) or not path.startswith(mixers))
        if sparse or (proj is None and any(part in path for part in _EXPERT_PARTS)):
            raise _refuse(
                req,
                f"target module {path!r} of layer {layer}: adapting a mixture of experts (its experts "
                f"or router) is not supported (supported: {supported})",
            )
        if proj is None:
            leaf = path.rpartition(".")[2]
            raise _refuse(
                req, f"target module {leaf!r} is not supported (layer {layer} {path}; supported: {supported})"
            )
        if locate(arch, proj, layer) is None:
            raise _refuse(
                req,
                f"tensor {key} adapts {path}, but layer {layer} of the base model is "
                f"{_layer_kind(arch, layer)} without it: the adapter was trained for another base model",
            )
        pairs.setdefault((layer, proj), {})[ab] = list(info["shape"])
        if ab == "A":
            keys[(layer, proj)] = key
    out = []
    for (layer, proj), shapes in sorted(pairs.items()):
        if set(shapes) != {"A", "B"}:
            raise _refuse(req, f"layer {layer} {proj}: lora_A and lora_B must both be present")
        found = locate(arch, proj, layer)
        assert found is not None  # checked above
        module, slices = found
        d_in, sizes = module_dims(arch, module, layer)
        rows = tuple(sizes[s] for s in slices)  # a fused projection's B covers its slices' rows
        d_out = sum(rows)
        want = {"A": [rank, d_in], "B": [d_out, rank]}
        for ab in "AB":
            if shapes[ab] != want[ab]:
                raise _refuse(
                    req,
                    f"layer {layer} {proj}.lora_{ab} has shape {shapes[ab]}, this base model needs "
                    f"{want[ab]} (rank {rank}): the adapter does not match the base model's architecture",
                )
        out.append(AdaptedTensor(keys[(layer, proj)], layer, proj, module, slices, rows))
    if not out:
        raise _refuse(req, f"{WEIGHTS_FILE} holds no LoRA weights")
    return tuple(out)


def _layer_kind(arch: ModelArch, layer: int) -> str:
    if arch.block_pattern:
        kind = {"M": "a Mamba2", "*": "an attention", "-": "an MLP", "E": "a mixture-of-experts"}
        return f"{kind[arch.block_pattern[layer]]} block"
    if arch.is_linear_layer(layer):
        return "a linear-attention layer"
    if arch.is_moe_layer(layer):
        return "a mixture-of-experts layer"
    if arch.kv_source_layer(layer) != layer:
        return f"a KV-shared layer (its keys and values are layer {arch.kv_source_layer(layer)}'s)"
    if arch.attention_k_eq_v and arch.layer_window(layer) is None:
        return "a full-attention layer whose values are its keys (attention_k_eq_v)"
    return "a full-attention layer" if arch.layer_types else "a layer"


def load_adapter(spec: AdapterSpec, dtype: torch.dtype) -> LoadedAdapter:
    """The adapter's weights on the host in `dtype`, B already multiplied by the scale."""
    from safetensors import safe_open

    path = os.path.join(spec.request.lora_path, WEIGHTS_FILE)
    weights: dict[tuple[int, str], list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    with safe_open(path, framework="pt") as f:
        for t in spec.tensors:
            a = f.get_tensor(t.key_a).float().to(dtype)
            b = f.get_tensor(t.key_a.replace("lora_A", "lora_B")).float() * spec.scaling
            # A fused projection's one A serves each slice; B's rows go to their slices.
            parts = weights.setdefault((t.layer, t.module), [])
            for s, b_s in zip(t.slices, b.split(list(t.rows))):
                parts.append((s, a, b_s.to(dtype).contiguous()))
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
