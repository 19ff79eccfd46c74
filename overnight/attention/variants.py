"""Named sets of attention kernel configs, so a variant can be timed end to end (`--attention-variant`,
e.g. in the side-by-side runs against vLLM) before it becomes a kernel default.

    default   each kernel's own default for the cache dtype (paged_decode.default_decode_config,
              paged_prefill.default_prefill_config)
    prefetch  page ids loaded one tile ahead, so the K/V copies are multi-buffered (kernels/kv_tiles.py),
              in decode (both caches) and in prefill
    fp16-dots an FP8 cache's tiles converted to fp16 for both kernels' dots, q and P unrounded (the
              former default; the default runs the dots on e4m3 as stored, q and P rounded,
              as FlashAttention-3 does); a 16-bit cache as default
    heads-first  the default decode tiles with the KV heads of a request as the grid's fastest
              dimension (DecodeConfig.heads_first); prefill as default
    tma, tma-n128  an FP8 cache's decode with each K and V tile fetched by one TMA copy
              (DecodeConfig.tma), tiles of 64 or 128 tokens: needs --block-size a multiple of the
              tile; prefill as default; a 16-bit cache as default
    mla-prefill-kernel  latent attention (DeepSeek) attends prefill chunks absorbed, row by row, in
              the decode kernel (kernels/mla_decode.py) instead of decompressing them
              (kernels/mla_prefill.py); other models as default

The tile shapes are the candidates bench/attention_gpu.py times; once it has picked winners, they
belong in the kernels' defaults and these names can go. Configs are built on use: this module is
imported by the command line, which must not pay for importing Triton.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from overnight.options import ATTENTION_VARIANTS

if TYPE_CHECKING:
    from overnight.kernels.paged_decode import DecodeConfig
    from overnight.kernels.paged_prefill import PrefillConfig


# The TMA decode variants' tiles, in tokens: each tile must lie inside one page, so the block size must
# be a multiple (build.check_cache refuses others before any weight loads).
TMA_TILES = {"tma": 64, "tma-n128": 128}


def variant_configs(name: str, fp8_cache: bool) -> tuple[DecodeConfig | None, PrefillConfig | None]:
    """(decode config, prefill config) of a variant for a cache of that kind; None: the default."""
    if name not in ATTENTION_VARIANTS:
        raise ValueError(f"unknown attention variant {name!r} ({', '.join(ATTENTION_VARIANTS)})")
    if name in ("default", "mla-prefill-kernel"):  # the latter: the backend's mla_prefill_kernel flag
        return None, None
    from dataclasses import replace

    from overnight.kernels.paged_decode import (
        FP8_FP16_DOTS_DECODE_CONFIG,
        DecodeConfig,
        default_decode_config,
    )
    from overnight.kernels.paged_prefill import PrefillConfig

    if name == "fp16-dots":
        return (FP8_FP16_DOTS_DECODE_CONFIG, PrefillConfig()) if fp8_cache else (None, None)
    if name in TMA_TILES:
        return (
            (DecodeConfig(TMA_TILES[name], 4, 3, fp8_mma=True, tma=True), None) if fp8_cache else (None, None)
        )
    if name == "heads-first":
        import torch

        cache_dtype = torch.float8_e4m3fn if fp8_cache else torch.bfloat16
        return replace(default_decode_config(cache_dtype, block_size=16), heads_first=True), None
    prefill = PrefillConfig(64, 64, 4, 3, prefetch_pages=True)
    if not fp8_cache:
        return DecodeConfig(64, 4, 4, prefetch_pages=True), prefill
    return DecodeConfig(128, 4, 3, prefetch_pages=True), prefill
