"""The FP8 KV cache: dtype names, per-layer scales, and the reference quantize / dequantize arithmetic.

A quantized cache stores x / scale saturated to the format's largest finite value, one scale per layer
for K and one for V; attention multiplies the scale back in after loading. The scales of every layer
live in one device tensor

    kv_scales[num_layers, 2]  float32,  [:, 0] = k_scale, [:, 1] = v_scale

that the kernels read through a pointer, so CUDA graphs captured at start-up stay valid when a
calibration or a checkpoint changes the values. A latent-attention layer (attention/mla.py) caches one
row per token, not K and V: its pair is (latent scale, rope scale), one for each part of the row. The
Triton kernels (kv_write.py, paged_decode.py,
paged_prefill.py) do exactly the arithmetic of quantize_kv / dequantize_kv below.
"""

from __future__ import annotations

import torch

from overnight.kernels.kv_layout import fp8_max

# kv_cache_dtype option -> storage dtype ("auto": the model's compute dtype).
FP8_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in FP8_DTYPES:
        raise ValueError(f"kv_cache_dtype must be auto, {', '.join(FP8_DTYPES)}; got {kv_cache_dtype!r}")
    return FP8_DTYPES[kv_cache_dtype]


def quantize_kv(x: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
    """x / scale in fp32, saturated to the format's range (a plain cast would give NaN), cast to dtype."""
    limit = fp8_max(dtype)
    return (x.float() / scale).clamp(-limit, limit).to(dtype)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype) * scale


def new_kv_scales(num_layers: int, device: torch.device | str) -> torch.Tensor:
    return torch.ones(num_layers, 2, dtype=torch.float32, device=device)


def load_kv_scales_(kv_scales: torch.Tensor, checkpoint: dict[int, tuple[float, float]]) -> None:
    """Copy the scales a checkpoint ships ({layer: (k_scale, v_scale)}) into kv_scales."""
    for layer, pair in checkpoint.items():
        if not 0 <= layer < kv_scales.shape[0]:
            raise ValueError(
                f"checkpoint has KV scales for layer {layer}, the model has {kv_scales.shape[0]}"
            )
        if min(pair) <= 0:
            raise ValueError(f"checkpoint KV scales of layer {layer} must be positive, got {pair}")
        kv_scales[layer] = torch.tensor(pair, dtype=torch.float32)


@torch.no_grad()
def calibrate_kv_scale_(
    kv_scale: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_dtype: torch.dtype
) -> None:
    """Set one layer's (k_scale, v_scale) so the largest |k| and |v| seen map to the format's maximum.

    Runs on the device without a host sync. An all-zero input keeps scale 1 (a zero scale would divide
    by zero on the next write).
    """
    amax = torch.stack([k.detach().abs().amax(), v.detach().abs().amax()]).float()
    kv_scale.copy_(torch.where(amax > 0, amax / fp8_max(cache_dtype), torch.ones_like(amax)))
