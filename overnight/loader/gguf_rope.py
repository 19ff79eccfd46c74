"""RoPE scaling of a GGUF file as config.json states it (ModelArch.rope_scaling): linear and YaRN from
the metadata; Llama 3's frequency scaling recovered from the per-frequency divisors the converter stores
as rope_freqs.weight; Phi-3's LongRoPE factors, stored as tensors. For the families read through their
config.json reader (gguf_families.py), the rope_scaling dict of that config (YaRN)."""

from __future__ import annotations

from typing import Any

import numpy as np

from overnight.arch import RopeValue
from overnight.errors import ModelLoadError
from overnight.loader.gguf_file import GGUFFile, dequantize_tensor, f32


def llama3_rope_config(f: GGUFFile, name: str) -> dict[str, Any] | None:
    """Llama 3 RoPE scaling as config.json states it, recovered from a rope_freqs tensor (rope_scaling)."""
    if "rope_freqs.weight" not in f.tensors:
        return None
    md = f.metadata
    heads = int(md[f"{name}.attention.head_count"])
    head_dim = int(md.get(f"{name}.attention.key_length") or int(md[f"{name}.embedding_length"]) // heads)
    scaling = rope_scaling(f, name, head_dim, f32(md.get(f"{name}.rope.freq_base", 10000.0)))
    return None if scaling is None else {"rope_type": "llama3", **dict(scaling)}


def rope_scaling(
    f: GGUFFile, name: str, head_dim: int, theta: float
) -> tuple[tuple[str, RopeValue], ...] | None:
    """Linear scaling (rope.scaling.type and .factor), or Llama 3 frequency scaling, recovered from the per-frequency divisors the converter stores.

    The file keeps `rope_freqs.weight[i]` = the divisor of inverse frequency i: 1 for short wavelengths,
    `factor` for long ones, and 1 / ((1 - s) / factor + s) between, where s = (orig / wavelen - low) /
    (high - low) is linear in 1 / wavelen. Two in-between points give that line's slope and intercept;
    any (orig, low, high) on it reproduce every divisor, so orig is taken from the metadata when present
    and otherwise set to Llama 3's 8192.
    """
    scaling_type = f.metadata.get(f"{name}.rope.scaling.type", "none")
    if "rope_factors_long.weight" in f.tensors:
        return _longrope_scaling(f, name)
    info = f.tensors.get("rope_freqs.weight")
    if info is None and scaling_type == "linear":
        return (("rope_type", "linear"), ("factor", f32(f.metadata[f"{name}.rope.scaling.factor"])))
    if info is None and scaling_type == "yarn":
        return _yarn_scaling(f, name)
    if info is None:
        if scaling_type != "none":
            raise ModelLoadError(f"{f.path}: RoPE scaling type {scaling_type!r} is not supported")
        return None
    raw = np.fromfile(f.path, dtype=np.uint8, count=info.nbytes, offset=info.offset)
    divisors = dequantize_tensor(raw, info).astype(np.float64)
    factor = float(divisors.max())
    if factor <= 1.0 + 1e-6:
        return None
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    x = inv_freq[: len(divisors)] / (2 * np.pi)  # 1 / wavelength
    mid = (divisors > 1.0 + 1e-4) & (divisors < factor - 1e-4 * factor)
    if mid.sum() < 2:
        raise ModelLoadError(f"{f.path}: cannot recover the Llama 3 RoPE scaling from rope_freqs.weight")
    s = (1.0 / divisors[mid] - 1.0 / factor) / (1.0 - 1.0 / factor)
    slope, intercept = np.polyfit(x[mid], s, 1)  # s = slope * x + intercept
    orig = float(f.metadata.get(f"{name}.rope.scaling.original_context_length", 8192))
    low = -intercept * orig / slope
    high = low + orig / slope
    return (
        ("factor", round(factor, 4)),
        ("low_freq_factor", round(float(low), 4)),
        ("high_freq_factor", round(float(high), 4)),
        ("original_max_position_embeddings", orig),
    )


# YaRN's parameters (transformers' names) and the GGUF metadata keys, after "<arch>.", that state them.
YARN_KEYS = {
    "factor": "rope.scaling.factor",
    "original_max_position_embeddings": "rope.scaling.original_context_length",
    "attention_factor": "rope.scaling.attn_factor",
    "beta_fast": "rope.scaling.yarn_beta_fast",
    "beta_slow": "rope.scaling.yarn_beta_slow",
}


def _yarn_scaling(f: GGUFFile, name: str) -> tuple[tuple[str, RopeValue], ...]:
    """YaRN from the metadata (the factor and original context; the attention factor and the betas where
    the file states them, transformers' defaults otherwise)."""
    md = f.metadata
    keys = YARN_KEYS
    items = {k: f32(md[f"{name}.{key}"]) for k, key in keys.items() if f"{name}.{key}" in md}
    for required in ("factor", "original_max_position_embeddings"):
        if required not in items:
            raise ModelLoadError(f"{f.path}: YaRN RoPE scaling without {name}.{keys[required]}")
    return (("rope_type", "yarn"), *sorted(items.items()))


def _longrope_scaling(f: GGUFFile, name: str) -> tuple[tuple[str, RopeValue], ...]:
    """Phi-3's LongRoPE: its short and long per-frequency factors are tensors of the file."""
    factors = {}
    for kind in ("short", "long"):
        info = f.tensors.get(f"rope_factors_{kind}.weight")
        if info is None:
            raise ModelLoadError(f"{f.path}: rope_factors_long without rope_factors_short")
        raw = np.fromfile(f.path, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        factors[kind] = tuple(f32(x) for x in dequantize_tensor(raw, info).reshape(-1))
    md = f.metadata
    orig = md.get(f"{name}.rope.scaling.original_context_length")
    if orig is None:
        raise ModelLoadError(f"{f.path}: GGUF metadata lacks {name}.rope.scaling.original_context_length")
    items: dict[str, RopeValue] = {
        "long_factor": factors["long"],
        "original_max_position_embeddings": float(orig),
        "short_factor": factors["short"],
    }
    if f"{name}.rope.scaling.attn_factor" in md:
        items["attention_factor"] = f32(md[f"{name}.rope.scaling.attn_factor"])
    return (("rope_type", "longrope"), *sorted(items.items()))


def yarn_rope_config(md: dict[str, Any], name: str, path: str) -> dict[str, Any] | None:
    """The rope_scaling dict of a gguf_families.CONFIG_FAMILIES file's rebuilt config.json: YaRN, or none."""
    kind = md.get(f"{name}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind != "yarn":
        raise ModelLoadError(f"{path}: RoPE scaling type {kind!r} is not supported for {name} GGUF files")
    keys = YARN_KEYS
    # transformers' YaRN betas where the file leaves them out (the published gpt-oss configs state these)
    out: dict[str, Any] = {"rope_type": "yarn", "beta_fast": 32.0, "beta_slow": 1.0}
    for k, key in keys.items():
        if f"{name}.{key}" in md:
            out[k] = f32(md[f"{name}.{key}"])
    for required in ("factor", "original_max_position_embeddings"):
        if required not in out:
            raise ModelLoadError(f"{path}: YaRN RoPE scaling without {name}.{keys[required]}")
    out["original_max_position_embeddings"] = int(out["original_max_position_embeddings"])
    return out
