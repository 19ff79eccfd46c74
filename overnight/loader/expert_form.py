"""How an MXFP4 checkpoint's experts are held: packed (quant/mxfp4.py, decoded inside the fused GEMM) or
dequantized to the compute dtype at load (ModelArch.experts_mxfp4_dense), the mxfp4_experts option.

The dense form runs through the 16-bit fused MoE, which is about twice as fast as decoding MXFP4 in the
GEMM's K loop (gpt-oss-20b on an H100), at four times the experts' bytes. "auto" takes it where those bytes
leave the GPU room for a KV cache: the whole model in the compute dtype (one tensor-parallel rank's
share of it) at most DENSE_FRACTION of one GPU's memory. gpt-oss-20b in bf16 (39 GiB) is 49% of an 80-GB
H100 and 28% of an H200; gpt-oss-120b (218 GiB) fits neither and stays packed. The CPU keeps the packed
form under auto (its experts are dequantized per step already, and RAM is what a CPU run lacks).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from overnight.config import ModelArch
from overnight.errors import ConfigError
from overnight.options import MXFP4_EXPERTS

DENSE_FRACTION = 0.55
GIB = 2**30


@dataclass(frozen=True)
class ExpertForm:
    arch: ModelArch  # with experts_mxfp4_dense set as chosen
    reason: str  # one sentence for the log; "" when the model has no MXFP4 experts


def choose_expert_form(
    arch: ModelArch,
    choice: str,
    dtype_bytes: int,
    device_bytes: int | None,
    tensor_parallel_size: int = 1,
    dtype_name: str = "bf16",
) -> ExpertForm:
    """The arch with its experts' form decided by `choice` ("auto", "mxfp4", "dense"); device_bytes: one
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
    share = dense.weight_bytes(dtype_bytes) / tensor_parallel_size
    if choice == "dense":
        return ExpertForm(dense, f"mxfp4_experts dense: experts dequantized to {dtype_name} at load")
    if choice == "mxfp4":
        return ExpertForm(arch, "mxfp4_experts mxfp4: experts kept packed")
    if device_bytes is None:
        return ExpertForm(arch, "mxfp4_experts auto: experts kept packed on the CPU")
    on = "each GPU's share" if tensor_parallel_size > 1 else "the model"
    ratio = share / device_bytes
    words = f"{on} in {dtype_name} is {share / GIB:.1f} GiB, {ratio:.0%} of {device_bytes / GIB:.1f} GiB"
    if ratio <= DENSE_FRACTION:
        return ExpertForm(dense, f"mxfp4_experts auto: experts dequantized to {dtype_name} ({words})")
    return ExpertForm(arch, f"mxfp4_experts auto: experts kept packed ({words}, over {DENSE_FRACTION:.0%})")
