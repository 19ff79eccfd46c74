"""FP8 (e4m3) weights and activations: the arithmetic every path shares, as plain PyTorch.

These functions are the references of the Triton kernels (kernels/fp8_quant.py, the fp8 outputs of
kernels/rmsnorm.py and kernels/activation.py, kernels/fp8_gemm.py) and the CPU path of Fp8Linear.

Activations, dynamically, one scale per token (row) or per token and group of columns:

    amax  = max |x| over the row (or group), at least MIN_AMAX     (an all-zero row gets a tiny scale)
    scale = amax / 448                                             float32, kept beside the data
    data  = e4m3(clamp(x * (448 / amax), -448, 448))               round to nearest even, saturated

The reciprocal is taken once per row and multiplied in, so the kernels (which do the same) round
exactly like this code. Weights [N, K] are stored e4m3 with float32 scales in one of two layouts:

    per channel   weight_scale [N]          one scale per output row (the online quantization)
    blocks        weight_scale [N, KB]      one scale per output row and block of block_k columns,
                                            KB = ceil(K / block_k): a checkpoint's [N/bn, K/bk] grid
                                            with each row of blocks repeated for its bn rows, so
                                            fused and sharded weights slice their scales by rows

and dequantize as weight * scale (broadcast along the columns of each block). Group and block widths
are powers of two, so a scale tensor's width says them (columns_per_scale).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from overnight.kernels.kv_layout import fp8_max

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = fp8_max(FP8_DTYPE)  # 448
# Keeps the reciprocal finite for all-zero rows; far below any real activation's amax.
MIN_AMAX = 1e-12


@dataclass(frozen=True)
class QuantizedActivation:
    """An activation already quantized by the kernel that produced it (a norm, SiLU-and-mul), handed
    to the Fp8Linear that consumes it instead of a tensor in the compute dtype."""

    data: torch.Tensor  # [T, K] float8_e4m3fn, rows contiguous
    scale: torch.Tensor  # [T, 1] float32 (per token), or [T, G] (per token and group of K / G columns)
    # The same activation in the compute dtype, when the producer's output also feeds layers kept in
    # it (a hybrid's norm before its bf16 b / a projections or router: quant/apply.py); else None.
    dense: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.data.shape[0]


def dense_input(x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
    """x in the compute dtype, for a layer that reads it so (see QuantizedActivation.dense)."""
    if isinstance(x, torch.Tensor):
        return x
    if x.dense is None:
        raise RuntimeError(
            "a layer in the compute dtype was handed a quantized activation without its dense form: its "
            "producer's dense_input_readers do not name it (quant/apply.py)"
        )
    return x.dense


def num_tokens(x: torch.Tensor | QuantizedActivation) -> int:
    """The rows of an activation [T, K], quantized or not."""
    return x.num_tokens if isinstance(x, QuantizedActivation) else x.shape[0]


def columns_per_scale(k: int, groups: int) -> int:
    """The power-of-two width g of the column groups that split k columns into `groups` scales
    (groups = ceil(k / g) puts ceil(k / groups) in (g / 2, g])."""
    if groups <= 1:
        return k
    return 1 << (-(-k // groups) - 1).bit_length()


def _quantize_rows(x: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (float32) with amax broadcastable against it -> (e4m3 data, float32 scale of amax's shape)."""
    amax = amax.clamp(min=MIN_AMAX)
    # Tensor / tensor: torch computes scalar / tensor as scalar * (1 / tensor), rounding twice.
    inv = torch.full_like(amax, FP8_MAX) / amax
    data = (x * inv).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return data, amax / torch.full_like(amax, FP8_MAX)


def quantize_activation_ref(
    x: torch.Tensor, group_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] in any float dtype -> (data [T, K] e4m3, scale [T, G] float32): one scale per row
    (G = 1), or per row and group of `group_size` columns (G = ceil(K / group_size); a short last
    group is scaled by its own amax)."""
    rows = x.float()
    num_tokens, k = rows.shape
    if group_size is None:
        return _quantize_rows(rows, rows.abs().amax(dim=1, keepdim=True))
    groups = -(-k // group_size)
    padded = torch.nn.functional.pad(rows, (0, groups * group_size - k)).view(num_tokens, groups, group_size)
    data, scale = _quantize_rows(padded, padded.abs().amax(dim=2, keepdim=True))
    return data.view(num_tokens, -1)[:, :k].contiguous(), scale.view(num_tokens, groups)


def dequantize_activation_ref(qa: QuantizedActivation) -> torch.Tensor:
    """float32 [T, K]: each group of columns times its scale."""
    k, groups = qa.data.shape[1], qa.scale.shape[1]
    scale = qa.scale.repeat_interleave(columns_per_scale(k, groups), dim=1)[:, :k]
    return qa.data.float() * scale


def quantize_weight_per_channel(
    weight: torch.Tensor, power_of_two: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (e4m3 [N, K], float32 scale [N]); on the weight's own device. power_of_two: each
    row's scale is the least power of two that brings its amax within 448 (pow2_row_scales) instead of
    amax / 448."""
    w = weight.float()
    amax = w.abs().amax(dim=1, keepdim=True)
    if not power_of_two:
        data, scale = _quantize_rows(w, amax)
        return data, scale.view(-1)
    scale = pow2_row_scales(amax)
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale.view(-1)


def pow2_row_scales(amax: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(amax / 448)), exactly (frexp, no rounded logarithm); all-zero rows as MIN_AMAX.

    Dividing by a power of two changes no mantissa, so a value with at most e4m3's 3 mantissa bits
    stays exact down to e4m3's smallest subnormal, 2^-9 of the scale. MXFP4 weights (e2m1 values, one
    mantissa bit, times a power of two 2^j per block of 32) requantized this way are exact in every
    block with 2^j >= amax * 2^-15 (the scale is at most amax / 224, and 0.5 * 2^j must reach 2^-9 of
    it); amax / 448 would round about half of them (models/gpt_oss.py's fp8 form)."""
    mantissa, exponent = torch.frexp(amax.float().clamp(min=MIN_AMAX) / FP8_MAX)  # mantissa in [0.5, 1)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    return torch.ldexp(torch.ones_like(mantissa), exponent)


def quantize_stacked_per_channel(
    weights: torch.Tensor, power_of_two: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked weights [E, N, K] (MoE experts) -> (e4m3 [E, N, K], float32 scale [E, N]): each one
    quantized per channel, one at a time so the float32 copy is one weight's, not the stack's."""
    data = torch.empty(weights.shape, dtype=FP8_DTYPE, device=weights.device)
    scale = torch.empty(weights.shape[:2], dtype=torch.float32, device=weights.device)
    for e in range(weights.shape[0]):
        data[e], scale[e] = quantize_weight_per_channel(weights[e], power_of_two)
    return data, scale


def quantize_weight_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (e4m3 [N, K], float32 scale grid [ceil(N / bn), ceil(K / bk)]): the layout
    block-scaled checkpoints ship (their weight_scale_inv), one scale per bn x bk tile."""
    bn, bk = block
    n, k = weight.shape
    rn, rk = -(-n // bn), -(-k // bk)
    w = torch.nn.functional.pad(weight.float(), (0, rk * bk - k, 0, rn * bn - n))
    tiles = w.view(rn, bn, rk, bk)
    data, scale = _quantize_rows(tiles, tiles.abs().amax(dim=(1, 3), keepdim=True))
    return data.view(rn * bn, rk * bk)[:n, :k].contiguous(), scale.view(rn, rk)


def expand_block_scales(grid: torch.Tensor, block_rows: int, num_rows: int) -> torch.Tensor:
    """A checkpoint's scale grid [ceil(N / bn), KB] -> the model's row layout [N, KB]."""
    return grid.float().repeat_interleave(block_rows, dim=0)[:num_rows].contiguous()


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] from e4m3 [N, K] and a scale of either model layout ([N] or [N, KB])."""
    k = weight.shape[1]
    if scale.dim() == 1:
        return weight.float() * scale.float()[:, None]
    width = columns_per_scale(k, scale.shape[1])
    return weight.float() * scale.float().repeat_interleave(width, dim=1)[:, :k]


def quantize_weight(weight: torch.Tensor, block_k: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [N, K] in a model layout: per channel (block_k None) or blocks of block_k
    columns per row (scale [N, KB])."""
    if block_k is None:
        return quantize_weight_per_channel(weight)
    return quantize_weight_blocks(weight, (1, block_k))


def requantize_per_channel(weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-scaled (scale [N, KB]) -> per channel: dequantize and quantize each row again. Values
    whose block scale was smaller than the row's largest are rounded a second time (a relative
    error of at most half an e4m3 step, like the first rounding)."""
    return quantize_weight_per_channel(dequantize_weight(weight, scale))


def scaled_matmul_ref(
    qa: QuantizedActivation,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The FP8 GEMM's result: dequantized activations times dequantized weights in float32, plus the
    bias, rounded once to out_dtype. [T, K] x [N, K] -> [T, N]."""
    y = dequantize_activation_ref(qa) @ dequantize_weight(weight, weight_scale).T
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def fp8_linear_ref(
    x: torch.Tensor | QuantizedActivation,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Fp8Linear on the CPU: quantize x per token unless it comes quantized, then scaled_matmul_ref."""
    qa = x if isinstance(x, QuantizedActivation) else QuantizedActivation(*quantize_activation_ref(x))
    return scaled_matmul_ref(qa, weight, weight_scale, bias, out_dtype)
