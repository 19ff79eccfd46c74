"""The fused mixture-of-experts forward on the GPU: sort the pairs by expert, two grouped GEMMs, sum.

Reference: fused_experts_ref in overnight/layers/moe.py (the layer's CPU path).

    topk_ids [T, k] ──moe_align──► runs: pair ids sorted by expert, padded per expert to BLOCK_M
    x [T, H]  ──moe_gemm, gated──►  h [P, N] = silu(x W_gate^T) * (x W_up^T)          P = T * k pairs
              (activation "gelu_tanh", Gemma 4: the GEMM writes [P, 2N] and torch applies gelu * up;
              "relu2", Nemotron-H: no gate, gate_up_proj holds the up rows alone [E, N, H] and the
              GEMM's epilogue stores relu(x W_up^T)^2)
    h         ──moe_gemm, × w──►    y [P, H] = topk_weight * h W_down^T
    moe_sum(y, k)  ──►              out [T, H]  (each token's k rows, fp32 sum, kernels/moe_sum.py)

The k outputs of a token are summed by a reduction, not by atomic adds, so the result does not depend
on the order in which tiles finish. Five launches after the router; all sizes follow from T, nothing
is read back to the host, so a decode step that runs it can be captured in a CUDA graph. Tile
configurations come from moe_configs.py (tuned per GPU and batch size).

FP8 experts with fp8_activations (W8A8, the GPU's way: layers/moe.py): x, then h, are quantized per row
(kernels/fp8_quant.py, one scale a row) before their GEMM, and the GEMMs multiply e4m3 by e4m3 on the
FP8 tensor cores, both scales applied in the epilogue. Two more launches; no weight tile is converted.
"""

from __future__ import annotations

import torch

from overnight.kernels.fp8_quant import quantize_fp8
from overnight.kernels.moe_align import moe_align
from overnight.kernels.moe_configs import MoeConfig, get_config
from overnight.kernels.moe_gemm import moe_gemm
from overnight.kernels.moe_sum import moe_sum


def fused_experts(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: MoeConfig | None = None,
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
    *,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    activation: tuple[str, float, float] = ("silu", 0.0, 0.0),
    fp8_activations: bool = False,
) -> torch.Tensor:
    """x [T, H]; gate_up_proj [E, 2N, H] ([gate | up] rows); down_proj [E, H, N]; topk_weights [T, k]
    float32; topk_ids [T, k] int32. Returns [T, H] in x's dtype. FP8 experts: e4m3 projections with
    their per-row scales, gate_up_scale [E, 2N] and down_scale [E, H] float32; MXFP4 experts: uint8
    [E, 2N, H/2] and [E, H, N/2] with uint8 scales [E, 2N, H/32] and [E, H, N/32] (moe_gemm.py). Biases
    [E, 2N] and [E, H] and the gate/up activation (kind, alpha, limit): "silu" and "swiglu_oai" are fused
    into the first GEMM's epilogue; "gelu_tanh" (Gemma 4) runs as torch ops on the GEMM's [gate | up];
    "relu2" (Nemotron-H) has no gate: gate_up_proj is [E, N, H] (biases [E, N]), relu(up)^2 fused.
    fp8_activations (FP8 experts only): x and h quantized per row, e4m3 GEMMs (module docstring)."""
    kind = activation[0]
    if kind not in ("silu", "swiglu_oai", "gelu_tanh", "relu2"):
        raise ValueError(f"unknown expert activation {kind!r} (silu, swiglu_oai, gelu_tanh, relu2)")
    gated = kind != "relu2"
    num_tokens, hidden = x.shape
    num_experts, two_n, _ = gate_up_proj.shape
    top_k = topk_ids.shape[1]
    packed = 2 if gate_up_proj.dtype == torch.uint8 else 1  # MXFP4: two weights a byte
    inter = two_n // 2 if gated else two_n
    if down_proj.shape != (num_experts, hidden, inter // packed):
        raise ValueError(
            f"down_proj must be {(num_experts, hidden, inter // packed)}, got {tuple(down_proj.shape)}"
        )
    if topk_weights.shape != topk_ids.shape or topk_ids.shape[0] != num_tokens:
        raise ValueError("topk_weights and topk_ids must both be [T, k]")
    if fp8_activations and gate_up_proj.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_activations needs e4m3 experts, got {gate_up_proj.dtype}")
    if num_tokens == 0:
        return torch.zeros_like(x)
    if config is None:
        config = get_config(
            num_tokens, num_experts, inter, hidden, top_k, x.dtype, x.device, gate_up_proj.dtype
        )
    runs = moe_align(topk_ids.int().contiguous(), num_experts, config.block_m)
    a, a_scale = gemm_operand(x.contiguous(), fp8_activations)
    if activation[0] == "gelu_tanh":
        gate_up = moe_gemm(
            a, gate_up_proj, runs, config.gemm1, w_scale=gate_up_scale, bias=gate_up_bias,
            a_scale=a_scale, out_dtype=x.dtype,
        )  # fmt: skip
        gate, up = gate_up.chunk(2, dim=-1)
        h = torch.nn.functional.gelu(gate, approximate="tanh") * up
    else:
        h = moe_gemm(
            a,
            gate_up_proj,
            runs,
            config.gemm1,
            gated=gated,
            w_scale=gate_up_scale,
            bias=gate_up_bias,
            activation=activation,
            a_scale=a_scale,
            out_dtype=x.dtype,
        )
    a, a_scale = gemm_operand(h, fp8_activations)
    y = moe_gemm(
        a,
        down_proj,
        runs,
        config.gemm2,
        topk_weights=topk_weights.float().contiguous(),
        w_scale=down_scale,
        bias=down_bias,
        a_scale=a_scale,
        out_dtype=x.dtype,
    )
    return moe_sum(y, top_k)


def gemm_operand(x: torch.Tensor, fp8: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A GEMM's activations as it reads them: x itself, or (W8A8) e4m3 rows and their scales [rows]."""
    if not fp8:
        return x, None
    data, scale = quantize_fp8(x)
    return data, scale.view(-1)
