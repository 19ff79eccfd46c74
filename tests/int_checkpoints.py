"""Tiny integer-weight checkpoints written from a tiny float checkpoint (tests/tiny_models.py), in the
published layouts: compressed-tensors pack-quantized (W4A16/W8A16, through the package's own packing)
and int-quantized (W8A8), AWQ GEMM and GPTQ (v1 and v2), written here bit by bit from each format's
definition, independently of the loader's code.

Every projection (q/k/v/o, gate/up/down, every MoE expert's) is round-to-nearest quantized; the router,
embeddings, norms and LM head stay float. Beside each quantized folder goes a float folder holding
exactly the weights the quantized one decodes to (computed here from codes, zero points and scales), so
transformers can run "the dequantized model" as the reference.
"""

from __future__ import annotations

import json
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column AWQ_ORDER[i] of its 8
# every projection's weight, the Gated DeltaNet layers' big input projections included
PROJ_SUFFIXES = ("_proj.weight", "in_proj_qkv.weight", "in_proj_z.weight", "in_proj_qkvz.weight")


@dataclass(frozen=True)
class Layout:
    method: str  # "ct" | "ct-w8a8" | "awq" | "gptq"
    bits: int = 4
    group: int | None = 32  # None: per channel
    sym: bool = True
    act_order: bool = False
    gptq_v2: bool = False


LAYOUTS: dict[str, Layout] = {
    "ct-w4-g32-sym": Layout("ct", 4, 32, True),
    "ct-w4-g32-asym-gidx": Layout("ct", 4, 32, False, act_order=True),
    "ct-w4-channel-asym": Layout("ct", 4, None, False),
    "ct-w8-g16-sym": Layout("ct", 8, 16, True),
    "ct-w8-channel-sym": Layout("ct", 8, None, True),
    "ct-w8a8": Layout("ct-w8a8", 8, None, True),
    "awq-g32": Layout("awq", 4, 32, False),
    "gptq-w4-g32-sym": Layout("gptq", 4, 32, True),
    "gptq-w4-g16-asym-descact": Layout("gptq", 4, 16, False, act_order=True),
    "gptq-w4-g32-sym-descact": Layout("gptq", 4, 32, True, act_order=True),
    "gptq-w8-g32-asym-v2": Layout("gptq", 8, 32, False, gptq_v2=True),
}


def _order_key(name: str) -> str:
    """Projections reading the same input share one act-order (their Hessian is the same)."""
    for src, shared in (
        ("q_proj", "qkv"),
        ("k_proj", "qkv"),
        ("v_proj", "qkv"),
        ("gate_proj", "gu"),
        ("up_proj", "gu"),
    ):
        name = name.replace(src, shared)
    return name


def quantize_rtn(w: torch.Tensor, lay: Layout, g_idx: torch.Tensor | None):
    """(codes [N, K] in [0, 2^b), zeros [N, NG] ints, scales [N, NG] float32, groups [K])."""
    n, k = w.shape
    low_zero = 1 if lay.method == "gptq" and not lay.gptq_v2 else 0
    size = lay.group or k
    groups = g_idx.long() if g_idx is not None else torch.arange(k) // size
    ng = k // size
    top = (1 << lay.bits) - 1
    scales = torch.empty(n, ng)
    zeros = torch.empty(n, ng, dtype=torch.int64)
    for g in range(ng):
        cols = w[:, groups == g]
        if lay.sym:
            scales[:, g] = cols.abs().amax(1).clamp_min(1e-6) / ((1 << (lay.bits - 1)) - 1)
            zeros[:, g] = 1 << (lay.bits - 1)
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            scales[:, g] = ((hi - lo) / top).clamp_min(1e-6)
            # GPTQ v1 stores z - 1 and cannot hold z = 0 (its readers see 2^b): quantize within [1, top]
            zeros[:, g] = torch.round(-lo / scales[:, g]).clamp(low_zero, top).long()
    codes = torch.round(w / scales[:, groups]) + zeros[:, groups]
    return codes.clamp(0, top).long(), zeros, scales, groups


def _pack_words(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., C] ints -> int32 [..., C*bits/32], value j of a word at bits j*bits (written with int64)."""
    per = 32 // bits
    v = values.long().reshape(*values.shape[:-1], -1, per)
    word = sum(v[..., j] << (bits * j) for j in range(per))
    return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32).contiguous()


def _awq_pack(values: torch.Tensor) -> torch.Tensor:
    """[R, C] nibbles -> int32 [R, C/8] in AWQ's column order."""
    v = values.long().reshape(values.shape[0], -1, 8)
    word = sum(v[..., AWQ_ORDER[i]] << (4 * i) for i in range(8))
    return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32).contiguous()


def _quantized_tensors(
    name: str, w: torch.Tensor, lay: Layout, gen: torch.Generator
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The checkpoint tensors for one projection and the float weight they decode to."""
    module = name.removesuffix(".weight")
    n, k = w.shape
    if lay.method == "ct-w8a8":
        scale = (w.abs().amax(1, keepdim=True) / 127).to(torch.bfloat16)
        q = torch.round(w / scale.float()).clamp(-127, 127).to(torch.int8)
        return {f"{module}.weight": q, f"{module}.weight_scale": scale}, q.float() * scale.float()
    g_idx = None
    if lay.act_order:
        size = lay.group or k
        perm = torch.randperm(k, generator=gen)
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = (torch.arange(k) // size).to(torch.int32)
    codes, zeros, scales, groups = quantize_rtn(w, lay, g_idx)
    scale_dtype = torch.bfloat16 if lay.method == "ct" else torch.float16
    scales = scales.to(scale_dtype)
    deq = (codes - zeros[:, groups]).float() * scales.float()[:, groups]
    out: dict[str, torch.Tensor] = {}
    if lay.method == "ct":
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

        off = 1 << (lay.bits - 1)
        out[f"{module}.weight_packed"] = pack_to_int32((codes - off).to(torch.int8), lay.bits)
        out[f"{module}.weight_scale"] = scales
        out[f"{module}.weight_shape"] = torch.tensor([n, k])
        if not lay.sym:
            out[f"{module}.weight_zero_point"] = pack_to_int32(
                (zeros - off).to(torch.int8), lay.bits, packed_dim=0
            )
        if g_idx is not None:
            out[f"{module}.weight_g_idx"] = g_idx
    elif lay.method == "awq":
        out[f"{module}.qweight"] = _awq_pack(codes.t().contiguous())
        out[f"{module}.qzeros"] = _awq_pack(zeros.t().contiguous())
        out[f"{module}.scales"] = scales.t().contiguous()
    else:  # gptq
        stored_zeros = zeros if lay.gptq_v2 else (zeros - 1) % (1 << lay.bits)
        out[f"{module}.qweight"] = _pack_words(codes, lay.bits).t().contiguous()
        out[f"{module}.qzeros"] = _pack_words(stored_zeros.t(), lay.bits)
        out[f"{module}.scales"] = scales.t().contiguous()
        out[f"{module}.g_idx"] = g_idx if g_idx is not None else (torch.arange(k) // (lay.group or k)).int()
    return out, deq


# The hybrids' small float projections (Gated DeltaNet's in_proj_a / _b / _ba, the shared expert's
# gate; Gemma 4's per-layer-input projections; a vision tower) are written unquantized, as published checkpoints leave
# them: their configs say so.
FLOAT_LINEARS = (
    "in_proj_a", "in_proj_b", "in_proj_ba", "shared_expert_gate",
    "per_layer_input_gate", "per_layer_projection", "per_layer_model_projection",
    "visual", "vision_tower", "multi_modal_projector",
)  # fmt: skip
# an image checkpoint's tower (Qwen's visual, Gemma 3's SigLIP and projector): its linears written float
VISION_TOWERS = ("visual", "vision_tower", "multi_modal_projector")


def _ct_pattern(name: str) -> str:
    """compressed-tensors' ignore entry for a FLOAT_LINEARS name (a vision tower: all of it)."""
    return f"re:.*{name}\\..*" if name in VISION_TOWERS else f"re:.*{name}$"


def _in_tower(name: str) -> bool:
    return any(f".{tower}." in f".{name}" for tower in VISION_TOWERS)


def _config(lay: Layout, floats: list[str]) -> dict[str, Any]:
    """floats: the FLOAT_LINEARS the checkpoint has."""
    kept = {"modules_to_not_convert": floats} if floats else {}
    if lay.method == "awq":
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": lay.group or -1,
            "zero_point": True,
            "version": "gemm",
            **kept,
        }
    if lay.method == "gptq":
        return {
            **kept,
            "quant_method": "gptq",
            "bits": lay.bits,
            "group_size": lay.group or -1,
            "desc_act": lay.act_order,
            "sym": lay.sym,
            "checkpoint_format": "gptq_v2" if lay.gptq_v2 else "gptq",
            "damp_percent": 0.01,
            "true_sequential": True,
        }
    if lay.method == "ct-w8a8":
        weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}
        acts = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
        fmt = "int-quantized"
    else:
        weights = {
            "num_bits": lay.bits,
            "type": "int",
            "symmetric": lay.sym,
            "strategy": "group" if lay.group else "channel",
            "group_size": lay.group,
            "dynamic": False,
            "actorder": "group" if lay.act_order else None,
        }
        acts, fmt = None, "pack-quantized"
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts, "format": fmt}
        },
        "ignore": ["lm_head", "re:.*mlp.gate$", *(_ct_pattern(name) for name in floats)],
    }


def make_int_checkpoint(
    src: Path, dst: Path, layout: str, seed: int = 0, keep_float: tuple[str, ...] = ()
) -> tuple[Path, Path]:
    """Write `src` (a float checkpoint) in `layout` into dst, and its dequantized twin into
    dst.parent / (dst.name + "-deq"); returns (quantized folder, dequantized folder).
    keep_float: module name suffixes (layers.0.mlp.down_proj) written float besides FLOAT_LINEARS,
    whatever the checkpoint's naming layout; the caller lists them in the quantization_config."""
    lay = LAYOUTS[layout]
    if lay.method.startswith("ct"):  # its packing here, its quantization_config model at load
        pytest.importorskip("compressed_tensors")
    deq_dir = dst.parent / (dst.name + "-deq")
    for folder in (dst, deq_dir):
        shutil.copytree(src, folder, dirs_exist_ok=True)
        (folder / "model.safetensors").unlink()
    state = load_file(src / "model.safetensors")
    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        kept = any(f".{name}".endswith(f".{module}.weight") for module in keep_float)
        if (
            not name.endswith(PROJ_SUFFIXES) or _in_tower(name) or kept
        ):  # Qwen2.5-VL's gate_proj, SigLIP's q_proj
            quantized[name] = dequantized[name] = tensor
            continue
        gen = torch.Generator().manual_seed(seed + zlib.crc32(_order_key(name).encode()))
        tensors, deq = _quantized_tensors(name, tensor.float(), lay, gen)
        quantized.update(tensors)
        dequantized[name] = deq.to(tensor.dtype)
    save_file(quantized, dst / "model.safetensors")
    save_file(dequantized, deq_dir / "model.safetensors")
    config = json.loads((dst / "config.json").read_text())
    floats = [name for name in FLOAT_LINEARS if any(f".{name}." in f".{key}" for key in state)]
    config["quantization_config"] = _config(lay, floats)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst, deq_dir
