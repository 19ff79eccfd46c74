"""Checkpoint loading shared by every family built from the dense decoder's blocks: HF-named tensors into
the fused parameters (packed_modules_mapping), per-expert tensors into stacked experts, FP8 KV scales
collected, and the renames some families' checkpoints need first.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from typing import Protocol

import torch
from torch import nn

from overnight.arch import ModelArch
from overnight.errors import ModelLoadError
from overnight.layers.moe import Experts

logger = logging.getLogger(__name__)

# A stacked-experts MoE's per-expert checkpoint tensors (layers/moe.py's Experts, no nn.Linear): every MoE
# family lists them in dequantized_at_load, so an FP8 checkpoint's are dequantized with their scales as
# they load (quant/checkpoint.py) before the experts take them.
EXPERT_TENSORS = r"re:.*\.mlp\.experts\.\d+\.(gate|up|down)_proj$"


_VISION_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)
# transformers 5 saves model.language_model.*, earlier ones language_model.model.* / language_model.lm_head.*
_TEXT_RENAMES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.", ""),
)


def text_model_tensors(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    skipped = 0
    for name, tensor in weights:
        if name.startswith(_VISION_PREFIXES):
            skipped += 1
            continue
        for old, new in _TEXT_RENAMES:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        yield name, tensor
    if skipped:
        logger.info(
            "skipped %d vision tensors of the checkpoint: overnight runs its text model only", skipped
        )


def split_fused_tensors(
    arch: ModelArch, weights: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoints that store q/k/v or gate/up fused (Phi-3: self_attn.qkv_proj, mlp.gate_up_proj; GLM-4:
    mlp.gate_up_proj) as the separate tensors the loader fuses again (so FP8 scales, tensor-parallel
    shards and shape checks treat every family alike); other tensors pass unchanged."""
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".")
        if prefix.endswith("self_attn.qkv_proj") and leaf in ("weight", "bias"):
            base = prefix.removesuffix("qkv_proj")
            q, k, v = tensor.split([arch.q_size, arch.kv_size, arch.kv_size])
            yield from ((f"{base}{p}.{leaf}", t) for p, t in (("q_proj", q), ("k_proj", k), ("v_proj", v)))
        elif prefix.endswith("mlp.gate_up_proj") and leaf == "weight" and tensor.dim() == 2:
            base = prefix.removesuffix("gate_up_proj")
            gate, up = tensor.split([arch.intermediate_size, arch.intermediate_size])
            yield f"{base}gate_proj.weight", gate
            yield f"{base}up_proj.weight", up
        else:
            yield name, tensor


def _shard_range(arch: ModelArch, shard: str | int, in_expert: bool) -> tuple[int, int]:
    """(row offset, rows) of one checkpoint projection inside its fused parameter (full, unsharded)."""
    if shard == "q":
        return 0, arch.q_size
    if shard == "k":
        return arch.q_size, arch.kv_size
    if shard == "v":
        return arch.q_size + arch.kv_size, arch.kv_size
    inter = arch.moe_intermediate_size if in_expert else arch.intermediate_size
    return int(shard) * inter, inter


# Where one checkpoint tensor goes: (parameter name, expert, shard id). Stacked expert parameters
# ([E, ...], module "experts") take one checkpoint tensor per expert (expert is None elsewhere); the
# shard id names a projection's rows inside a fused parameter (None: all of it).
Target = tuple[str, int | None, str | int | None]


def _is_expert_stack(pname: str) -> bool:
    parts = pname.split(".")
    return len(parts) >= 2 and parts[-2] == "experts"


def _checkpoint_names(
    pname: str, num_rows: int, mapping: dict[str, tuple[str, str | int]]
) -> dict[str, Target]:
    """The checkpoint tensors that fill parameter `pname` (num_rows: its first dimension)."""
    parts = pname.split(".")
    if len(parts) >= 2 and parts[-2] == "experts":  # experts.gate_up_proj <- experts.{e}.gate_proj.weight
        prefix, leaf = ".".join(parts[:-1]), parts[-1]
        sources: list[tuple[str, str | int | None]] = [
            (src, shard) for src, (fused, shard) in mapping.items() if fused == leaf
        ] or [(leaf, None)]
        return {
            f"{prefix}.{e}.{src}.weight": (pname, e, shard) for e in range(num_rows) for src, shard in sources
        }
    for i, part in enumerate(parts):
        sources = [(src, shard) for src, (fused, shard) in mapping.items() if fused == part]
        if sources:
            return {
                ".".join(parts[:i] + [src] + parts[i + 1 :]): (pname, None, shard) for src, shard in sources
            }
    return {pname: (pname, None, None)}


_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_STACK_SCALES = ("gate_up_scale", "down_scale")  # e4m3 stacks' [E, rows] scales (Experts)
_KV_SCALE_NAME = re.compile(r"model\.layers\.(\d+)\.self_attn\.([kv])_scale")


def _kv_scale_of(name: str) -> tuple[int, int] | None:
    """(layer, 0 for k / 1 for v) when `name` is an FP8 checkpoint's per-layer KV-cache scale."""
    match = _KV_SCALE_NAME.fullmatch(name)
    return (int(match.group(1)), "kv".index(match.group(2))) if match else None


def _listing(names: Iterable[str], limit: int = 8) -> str:
    names = sorted(names)
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


class PackedModel(Protocol):
    """What load_packed_weights reads and writes of a model class (every family of the Llama blocks)."""

    arch: ModelArch
    packed_modules_mapping: dict[str, tuple[str, str | int]]
    checkpoint_kv_scales: dict[int, tuple[float, float]]

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...

    def get_submodule(self, target: str) -> nn.Module: ...


@torch.no_grad()
def load_packed_weights(model: PackedModel, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy HF-named tensors into `model` (which has .arch and .packed_modules_mapping), fusing the
    separate q/k/v and gate/up tensors and stacking per-expert tensors (mlp.experts.N.*) into the
    experts' parameters. Raises ModelLoadError naming every missing or unexpected tensor, and the first
    shape mismatch.

    KV-cache scales (model.layers.N.self_attn.k_scale / v_scale, as FP8 checkpoints ship them) are not
    parameters: they are collected into model.checkpoint_kv_scales, {layer: (k_scale, v_scale)} with
    1.0 for a missing one, for the runner's FP8 cache."""
    arch = model.arch
    mapping = model.packed_modules_mapping
    params = dict(model.named_parameters())  # a tied lm_head.weight appears once, as the embedding
    # checkpoint name -> where it goes; the checkpoint must supply every one
    expected: dict[str, Target] = {}
    # a stacked expert tensor (transformers 5's mlp.experts.gate_up_proj [E, 2I, H]) -> the per-expert
    # names it stands for: either layout fills the parameter
    covers: dict[str, set[str]] = {}
    for pname, param in params.items():
        names = _checkpoint_names(pname, param.shape[0], mapping)
        expected.update(names)
        if _is_expert_stack(pname):
            covers[pname] = set(names)
    for pname in covers:
        expected[pname] = (pname, None, None)

    seen: set[str] = set()
    unscaled: set[str] = set()  # e4m3 expert tensors copied as they are, until their scales come
    unexpected: list[str] = []
    kv_scales: dict[int, list[float]] = {}
    for name, tensor in weights:
        if "rotary_emb.inv_freq" in name:
            continue  # the rotary table is recomputed, never loaded
        kv_scale = _kv_scale_of(name)
        if kv_scale is not None:
            layer, which = kv_scale
            kv_scales.setdefault(layer, [1.0, 1.0])[which] = float(tensor.float().max())
            continue
        if name == "lm_head.weight" and arch.tie_word_embeddings:
            continue  # some tied checkpoints store a copy of the embedding
        stack, _, leaf = name.rpartition(".")
        if leaf in _STACK_SCALES and f"{stack}.{leaf.replace('_scale', '_proj')}" in params:
            # an e4m3 expert stack's row scales, right after its weight (quant/checkpoint.py)
            experts = model.get_submodule(stack)
            assert isinstance(experts, Experts)
            experts.load_fp8_scales_(leaf.replace("_scale", "_proj"), tensor)
            unscaled.discard(f"{stack}.{leaf.replace('_scale', '_proj')}")
            continue
        if (
            leaf == "weight_scale"
            and f"{stack}.weight" in expected
            and expected[f"{stack}.weight"][1] is not None
        ):
            # one checkpoint expert's row scales, right after its e4m3 weight (quant/checkpoint.py)
            pname, expert, shard = expected[f"{stack}.weight"]
            experts = model.get_submodule(pname.rpartition(".")[0])
            assert isinstance(experts, Experts) and expert is not None
            start = 0 if shard is None else _shard_range(arch, shard, in_expert=True)[0]
            experts.load_fp8_scales_(pname.rpartition(".")[2], tensor, expert, start)
            unscaled.discard(f"{stack}.weight")
            continue
        if name not in expected:
            unexpected.append(name)
            continue
        pname, expert, shard = expected[name]
        target = params[pname].data
        if expert is not None:
            target = target[expert]
        start = 0
        if shard is not None:
            start, rows = _shard_range(arch, shard, in_expert=expert is not None)
            target = target.narrow(0, start, rows)
        if tuple(tensor.shape) != tuple(target.shape):
            raise ModelLoadError(
                f"shape mismatch for tensor {name}: checkpoint has {list(tensor.shape)}, "
                f"the model expects {list(target.shape)} (does config.json match the weights?)"
            )
        e4m3_stack = tensor.dtype == torch.float8_e4m3fn and pname in covers
        copy_weight(model, name, pname, target, tensor, expert, start, e4m3_stack)
        if e4m3_stack:
            unscaled.add(name)
        seen.add(name)
        seen.update(covers.get(name, ()))

    model.checkpoint_kv_scales = {layer: (k, v) for layer, (k, v) in sorted(kv_scales.items())}
    if unscaled:
        raise ModelLoadError(
            f"e4m3 tensors arrived for experts held as e4m3 while loading without their row scales: "
            f"{_listing(unscaled)} (an FP8 checkpoint's expert stacks need their _scale tensors)"
        )
    problems = []
    missing = set(expected) - set(covers) - seen
    if missing:
        problems.append(f"missing tensors: {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_listing(unexpected)}")
    if problems:
        raise ModelLoadError(
            f"checkpoint does not match the {type(model).__name__} architecture: " + "; ".join(problems)
        )


class _Submodules(Protocol):
    def get_submodule(self, target: str) -> nn.Module: ...


def copy_weight(
    model: _Submodules,
    name: str,
    pname: str,
    target: torch.Tensor,
    tensor: torch.Tensor,
    expert: int | None = None,
    start: int = 0,
    e4m3_stack: bool = False,
) -> None:
    """Copy checkpoint tensor `name` into `target` (parameter `pname`, or the rows of it the tensor
    fills: expert `expert`'s from row `start`, or the whole stack). A parameter of e4m3 experts (held
    as e4m3 while loading: layers/moe.py store_fp8_) takes float tensors only, per expert or stacked,
    quantized per row with their scales (Experts.load_fp8_rows_): the same bytes and scales as
    quantizing the loaded float stack; or, with e4m3_stack, e4m3 values as they are (a stack or one
    expert's rows), whose scales the caller loads next (quant/checkpoint.py's e4m3 experts). Any other
    tensor arriving for an e4m3 parameter would be cast without a scale (values off by the scale's
    factor): that is a ModelLoadError, never a copy."""
    if target.dtype != torch.float8_e4m3fn:
        target.copy_(tensor)
        return
    stack, _, leaf = pname.rpartition(".")
    owner = model.get_submodule(stack)
    if isinstance(owner, Experts) and owner.stores_fp8 and leaf in ("gate_up_proj", "down_proj"):
        if tensor.dtype == torch.float8_e4m3fn and e4m3_stack:
            # a checkpoint's e4m3 stack or expert, as it is: quant/checkpoint.py yields its row scales
            # next (`<stack>.gate_up_scale`, `experts.N.gate_proj.weight_scale`), which
            # load_packed_weights hands to the Experts and requires
            target.copy_(tensor)
            return
        if tensor.dtype not in _FLOAT_DTYPES:
            raise ModelLoadError(
                f"tensor {name} ({tensor.dtype}) arrives for experts held as e4m3 while loading: they "
                "take float tensors (an FP8 checkpoint's experts dequantized with their scales first), "
                "none came with this one"
            )
        owner.load_fp8_rows_(leaf, tensor, expert, start)
        return
    if tensor.dtype in _FLOAT_DTYPES:
        raise ModelLoadError(
            f"tensor {name} ({tensor.dtype}) arrives for the e4m3 parameter {pname} with no quantization "
            "path: copying it would cast it without a scale"
        )
    target.copy_(tensor)
