"""How an MXFP4 checkpoint's experts are held: packed (quant/mxfp4.py, decoded inside the fused GEMM),
dequantized to the compute dtype at load (ModelArch.experts_mxfp4_dense), or dequantized at load and
requantized to e4m3 with one float32 scale per expert and row (experts_mxfp4_fp8 too): the mxfp4_experts
option.

The dense form runs through the 16-bit fused MoE, which is about twice as fast as decoding MXFP4 in the
GEMM's K loop (gpt-oss-20b on an H100), at four times the experts' bytes. "auto" takes it where those bytes
leave the GPU room for a KV cache: the whole model in the compute dtype (one tensor-parallel rank's
share of it) at most DENSE_FRACTION of one GPU's memory (loader/fit.dense_fit, the rule int_weights'
auto follows too). gpt-oss-20b in bf16 (39 GiB) is 49% of an 80-GB
H100 and 28% of an H200; gpt-oss-120b (218 GiB) fits neither and stays packed. The CPU keeps the packed
form under auto (its experts are dequantized per step already, and RAM is what a CPU run lacks).

The fp8 form runs through the FP8 fused MoE (e4m3 tiles converted in the GEMM, our fastest MoE path on
Hopper) at half the dense form's expert bytes: gpt-oss-120b's experts take ~110 GiB, which one H200 holds
where their ~218 GiB in bf16 fits no GPU. With power-of-two row scales the e4m3 values are the MXFP4
values exactly, except in blocks whose power of two is below 2^-15 of their row's largest magnitude
(e4m3's subnormal floor: those round, or flush to zero; quant/fp8.pow2_row_scales). auto does not pick it: it is chosen explicitly until the GPU has measured it against the
other two forms (docs/performance.md's next GPU session). It needs FP8 (compute capability 8.9 or newer,
build.py checks before loading) or the CPU, whose reference path dequantizes the e4m3 experts it runs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from overnight.arch import ModelArch
from overnight.errors import ConfigError
from overnight.loader.fit import dense_fit
from overnight.options import MXFP4_EXPERTS
from overnight.quant.scheme import require_fp8_device


@dataclass(frozen=True)
class ExpertForm:
    arch: ModelArch  # with experts_mxfp4_dense (and experts_mxfp4_fp8) set as chosen
    reason: str  # one sentence for the log; "" when the model has no MXFP4 experts


def choose_expert_form(
    arch: ModelArch,
    choice: str,
    dtype_bytes: int,
    device_bytes: int | None,
    tensor_parallel_size: int = 1,
    dtype_name: str = "bf16",
) -> ExpertForm:
    """The arch with its experts' form decided by `choice` ("auto", "mxfp4", "dense", "fp8"); device_bytes: one
    GPU's total memory, None on the CPU. ConfigError for an explicit form on a model whose experts are
    not MXFP4."""
    if choice not in MXFP4_EXPERTS:
        raise ConfigError(f"unknown mxfp4_experts {choice!r}: use {', '.join(MXFP4_EXPERTS)}")
    if not arch.experts_mxfp4:
        if choice != "auto":
            raise ConfigError(
                f"mxfp4_experts {choice!r} applies to MXFP4 checkpoints (gpt-oss's published ones), and "
                "this model's experts are not MXFP4: leave it at auto"
            )
        return ExpertForm(arch, "")
    dense = replace(arch, experts_mxfp4_dense=True)
    if choice == "dense":
        return ExpertForm(dense, f"mxfp4_experts dense: experts dequantized to {dtype_name} at load")
    if choice == "fp8":
        return ExpertForm(
            replace(dense, experts_mxfp4_fp8=True),
            f"mxfp4_experts fp8: experts dequantized at load and stored as e4m3, a scale per row "
            f"({dtype_name} activations)",
        )
    if choice == "mxfp4":
        return ExpertForm(arch, "mxfp4_experts mxfp4: experts kept packed")
    # auto: dense or packed only; fp8 joins the rule once the GPU has timed it (module docstring).
    if device_bytes is None:
        return ExpertForm(arch, "mxfp4_experts auto: experts kept packed on the CPU")
    fit = dense_fit(dense.weight_bytes(dtype_bytes), device_bytes, tensor_parallel_size, dtype_name)
    if fit.dense:
        return ExpertForm(dense, f"mxfp4_experts auto: experts dequantized to {dtype_name} ({fit.words})")
    return ExpertForm(arch, f"mxfp4_experts auto: experts kept packed ({fit.words})")


def check_expert_form_device(arch: ModelArch, device: torch.device | str) -> None:
    """ConfigError when the arch's expert form cannot run on `device`: the fp8 form on a GPU without FP8
    (compute capability below 8.9). Checked before anything loads (build.py) and again when a model is
    built (loader/model_loader.py, parallel/tp_load.py)."""
    if arch.experts_mxfp4_fp8:
        require_fp8_device(
            device, "mxfp4_experts fp8 (e4m3 experts)", "use --mxfp4-experts mxfp4 or dense (or auto)"
        )
