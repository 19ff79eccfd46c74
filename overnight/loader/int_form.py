"""How a weight-only integer checkpoint (AWQ, GPTQ, compressed-tensors W4A16 / W8A16) is held: packed
(quant/int_linear.py's WeightOnlyIntLinear and quant/int_moe.py's IntExperts, the codes dequantized
inside the GEMM) or dequantized once at load into plain nn.Linear layers and float experts in the
compute dtype (IntScheme.dense): the int_weights option, decided once before loading (build.py) and
carried in the source's scheme to everything that builds, sizes or shards the model.

The packed GEMM reads a quarter (int4) or half (int8) of bf16's weight bytes, which wins while a step
is bound by reading weights (small batches), but it does the dequantization in every tile, and at the
batches of batch jobs (decode steps of ~1,024 rows, prefill chunks of 16,384 tokens) it runs at
0.5-0.74x cuBLAS's bf16 GEMM (docs/performance.md, session H). "auto" therefore takes the dense form
where the model in the compute dtype leaves the GPU room for a KV cache: loader/fit.dense_fit, the
rule mxfp4_experts' auto follows (loader/expert_form.py). The dense weights are exactly the
dequantize-in-the-GEMM path's values, rounded once to the compute dtype (quant/int_formats.py), with
act-order columns back in the input's order; tensor parallelism then shards them as float weights.

The CPU dequantizes every integer checkpoint at load whatever the choice (quant/apply.py: fast plain
matmuls), so there auto keeps the scheme as it is. W8A8 checkpoints (compressed-tensors int-quantized)
are not weight-only: their activations are quantized too and their int8 GEMM beats bf16 at large
batches, so they keep their Int8Linear layers under every choice.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from overnight.arch import ModelArch
from overnight.errors import ConfigError
from overnight.loader.fit import dense_fit
from overnight.options import INT_WEIGHTS
from overnight.quant.int_scheme import IntScheme
from overnight.quant.scheme import QuantScheme


@dataclass(frozen=True)
class IntForm:
    scheme: QuantScheme | IntScheme | None  # an IntScheme with dense set as chosen; others as given
    reason: str  # one sentence for the log; "" when the model is no integer checkpoint


def choose_int_form(
    arch: ModelArch,
    scheme: QuantScheme | IntScheme | None,
    choice: str,
    dtype_bytes: int,
    device_bytes: int | None,
    tensor_parallel_size: int = 1,
    dtype_name: str = "bf16",
) -> IntForm:
    """The scheme with its form decided by `choice` ("auto", "packed", "dense"); device_bytes: one GPU's
    total memory, None on the CPU. ConfigError for an explicit form on a model that is not an integer
    checkpoint (the option would do nothing)."""
    if choice not in INT_WEIGHTS:
        raise ConfigError(
            f"unknown int_weights {choice!r}: int_weights must be one of {', '.join(INT_WEIGHTS)}"
        )
    if not isinstance(scheme, IntScheme):
        if choice != "auto":
            raise ConfigError(
                f"int_weights {choice!r} applies to integer-weight checkpoints (AWQ, GPTQ, "
                "compressed-tensors int), and this model is not one: leave it at auto"
            )
        return IntForm(scheme, "")
    if scheme.int8_activations:
        return IntForm(
            scheme, f"int_weights {choice}: W8A8 keeps its int8 layers (activations quantized too)"
        )
    dense = replace(scheme, dense=True)
    if choice == "dense":
        return IntForm(dense, f"int_weights dense: integer weights dequantized to {dtype_name} at load")
    if device_bytes is None:  # the CPU dequantizes them at load whatever the scheme says (quant/apply.py)
        return IntForm(scheme, f"int_weights {choice}: integer weights dequantized at load on the CPU")
    if choice == "packed":
        return IntForm(scheme, "int_weights packed: integer weights kept packed (dequantized in the GEMM)")
    fit = dense_fit(arch.weight_bytes(dtype_bytes), device_bytes, tensor_parallel_size, dtype_name)
    if fit.dense:
        return IntForm(dense, f"int_weights auto: integer weights dequantized to {dtype_name} ({fit.words})")
    return IntForm(scheme, f"int_weights auto: integer weights kept packed ({fit.words})")
