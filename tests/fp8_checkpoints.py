"""Tiny FP8 checkpoints written from a tiny float checkpoint (tests/tiny_models.py), in each published
layout the loader reads: the projections' weights (q/k/v/o/gate/up/down) become e4m3 with their scale
tensors, everything else (embeddings, LM head, norms, an image model's vision tower) stays float;
config.json gains the quantization_config that layout's producers write, naming the tower's linears in
its ignore list as published image checkpoints do. Tokenizer and processor files are copied.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from overnight.quant.fp8 import quantize_activation_ref, quantize_weight_blocks, quantize_weight_per_channel

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# latent attention (DeepSeek-V2 / V3): its projections, quantized as DeepSeek-V3's FP8 release has them
MLA_PROJECTIONS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
VISION_TOWERS = ("visual.", "vision_tower.", "multi_modal_projector.")  # in a name: written float


def _ct_config(strategy: str, activations: dict[str, Any] | None, block: list[int] | None = None) -> dict:
    weights: dict[str, Any] = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True}
    if block:
        weights["block_structure"] = block
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations}
        },
        "ignore": ["lm_head"],
    }


_STATIC_TENSOR = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
_DYNAMIC_TOKEN = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}

# layout name -> (quantization_config, how each weight is stored)
LAYOUTS: dict[str, tuple[dict[str, Any], str]] = {
    # Qwen3-*-FP8: 128 x 128 blocks (one block covers a tiny model's matrices)
    "fp8-block": (
        {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        },
        "block:128x128",
    ),
    # the same format with blocks small enough that every matrix has several, and q/k/v different grids
    "fp8-block-small": (
        {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 32]},
        "block:16x32",
    ),
    "fp8-tensor-static": ({"quant_method": "fp8", "activation_scheme": "static"}, "tensor+input"),
    "ct-tensor-static": (_ct_config("tensor", _STATIC_TENSOR), "tensor+input"),
    "ct-channel-dynamic": (_ct_config("channel", _DYNAMIC_TOKEN), "channel"),
    "ct-channel-weight-only": (_ct_config("channel", None), "channel"),
    "ct-block": (_ct_config("block", _DYNAMIC_TOKEN, [16, 32]), "block:16x32"),
}


def _quantized(
    name: str, w: torch.Tensor, storage: str, block_scale_name: str, module_input: torch.Tensor
) -> dict[str, torch.Tensor]:
    prefix = name.removesuffix(".weight")
    if storage.startswith("block:"):
        bn, bk = (int(v) for v in storage.split(":")[1].split("x"))
        data, grid = quantize_weight_blocks(w, (bn, bk))
        return {f"{prefix}.weight": data, f"{prefix}.{block_scale_name}": grid}
    if storage == "channel":
        data, scale = quantize_weight_per_channel(w)
        return {f"{prefix}.weight": data, f"{prefix}.weight_scale": scale[:, None].contiguous()}
    data, grid = quantize_weight_blocks(w, tuple(w.shape))  # one block: per tensor
    _, input_scale = quantize_activation_ref(module_input.reshape(1, -1))  # a calibrated static scale
    return {
        f"{prefix}.weight": data,
        f"{prefix}.weight_scale": grid.reshape(()).contiguous(),
        f"{prefix}.input_scale": input_scale.reshape(()).contiguous(),
    }


def make_fp8_checkpoint(
    float_folder: str | Path,
    out_folder: str | Path,
    layout: str,
    projections: tuple[str, ...] = PROJECTIONS,
    config_extra: dict[str, Any] | None = None,
) -> Path:
    """Write float_folder's model in `layout` (a key of LAYOUTS) into out_folder; returns it. The
    weights of modules named in `projections` become FP8 (Mixtral-named checkpoints add w1 / w2 / w3);
    config_extra is merged into the quantization_config (a producer's own keys)."""
    config_patch, storage = LAYOUTS[layout]
    config_patch = {**config_patch, **(config_extra or {})}
    # compressed-tensors names every scale weight_scale; the fp8 method names block scales _inv
    block_scale_name = "weight_scale" if layout.startswith("ct-") else "weight_scale_inv"
    src, out = Path(float_folder), Path(out_folder)
    out.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(src / "model.safetensors"))
    written: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(0)
    tower: list[str] = []  # the vision tower's linear modules, by their checkpoint names
    for name, t in tensors.items():
        module = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
        if any(tower in name for tower in VISION_TOWERS):
            if name.endswith(".weight") and t.dim() == 2:
                tower.append(name.removesuffix(".weight"))
            written[name] = t
        elif name.endswith(".weight") and module in projections + MLA_PROJECTIONS:
            sample_input = torch.randn(t.shape[1], generator=gen)
            written.update(_quantized(name, t, storage, block_scale_name, sample_input))
        else:
            written[name] = t
    save_file(written, str(out / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = json.loads(json.dumps(config_patch))
    if tower:  # exact names, as Qwen's and RedHat's image checkpoints list them
        key = "ignore" if layout.startswith("ct-") else "modules_to_not_convert"
        config["quantization_config"][key] = [*config["quantization_config"].get(key, ["lm_head"]), *tower]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for extra in src.iterdir():
        if extra.is_file() and extra.name not in ("model.safetensors", "config.json"):
            shutil.copy(extra, out / extra.name)
    return out


def fake_quantized_float_checkpoint(float_folder: str | Path, out_folder: str | Path) -> Path:
    """The float checkpoint with each projection replaced by its per-channel FP8 round trip: the float
    model that online quantization's weights dequantize to."""
    from overnight.quant.fp8 import dequantize_weight

    src, out = Path(float_folder), Path(out_folder)
    shutil.copytree(src, out)
    tensors = load_file(str(src / "model.safetensors"))
    for name, t in tensors.items():
        module = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
        if name.endswith(".weight") and module in PROJECTIONS:
            tensors[name] = dequantize_weight(*quantize_weight_per_channel(t)).to(t.dtype)
    save_file(tensors, str(out / "model.safetensors"))
    return out
