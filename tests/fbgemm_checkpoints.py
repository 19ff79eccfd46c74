"""Tiny fbgemm_fp8 checkpoints (Meta's FP8 Llama releases), written from a tiny float checkpoint with the
tensor names and scale shapes of transformers' integration: each projection's weight e4m3 [N, K] with
weight_scale [N, 1]; Llama 4's fused experts gate_up_proj [E, H, 2I] with gate_up_proj_scale [E, 1, 2I]
and down_proj [E, I, H] with down_proj_scale [E, H, 1]; modules_to_not_convert (transformers' matching
rule) and everything else float. Beside it, the float checkpoint of the dequantized weights (e4m3 x
scale), which transformers loads as the reference (it cannot load fbgemm_fp8 without fbgemm-gpu and a GPU).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from overnight.quant.fp8 import FP8_DTYPE

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SCALE_DIVISOR = 300.0  # e4m3 values up to 300 of 448: a per-row requantization would rescale them


def _rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] float -> (e4m3, float32 scale [..., N]) per output row."""
    scale = w.float().abs().amax(dim=-1).clamp(min=1e-12) / SCALE_DIVISOR
    return (w.float() / scale[..., None]).to(FP8_DTYPE), scale


def _skipped(module: str, entries: list[str]) -> bool:
    """transformers' should_convert_module, negated."""
    return any(re.match(f"{e}\\.", module) or re.match(e, module) or module.endswith(e) for e in entries)


def write_fbgemm(src: Path, out: Path, deq: Path, ignore: list[str]) -> dict[str, torch.Tensor]:
    """src's model in the fbgemm_fp8 layout into `out`, and its dequantized float twin into `deq`;
    returns the FP8 checkpoint's tensors."""
    tensors = load_file(str(src / "model.safetensors"))
    fp8: dict[str, torch.Tensor] = {}
    dense: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        module, _, leaf = name.rpartition(".")
        if (
            name.endswith(".weight")
            and module.rpartition(".")[2] in PROJECTIONS
            and not _skipped(module, ignore)
        ):
            q, s = _rows(t)
            fp8[name], fp8[f"{module}.weight_scale"] = q, s[:, None].contiguous()
            dense[name] = (q.float() * s[:, None]).to(t.dtype)
        elif leaf in ("gate_up_proj", "down_proj") and module.endswith("experts") and t.dim() == 3:
            q, s = _rows(t.transpose(1, 2))  # [E, out, in] rows
            fp8[name] = q.transpose(1, 2).contiguous()
            fp8[f"{name}_scale"] = s[:, None, :] if leaf == "gate_up_proj" else s[:, :, None]
            dense[name] = (q.float() * s[..., None]).transpose(1, 2).contiguous().to(t.dtype)
        else:
            fp8[name] = dense[name] = t
    config = json.loads((src / "config.json").read_text())
    for folder, weights in ((out, fp8), (deq, dense)):
        folder.mkdir(parents=True)
        for extra in src.iterdir():
            if extra.name not in ("model.safetensors", "config.json"):
                (folder / extra.name).write_bytes(extra.read_bytes())
        save_file(weights, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps(config))
    qc = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": ignore}
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    return fp8
