"""Named sets of attention kernel configs, so a variant can be timed end to end (`--attention-variant`,
e.g. in the side-by-side runs against vLLM) before it becomes a kernel default.

    default   each kernel's own default for the cache dtype (paged_decode.default_decode_config,
              PrefillConfig())
    prefetch  page ids loaded one tile ahead, so the K/V copies are multi-buffered (kernels/kv_tiles.py),
              in decode (both caches) and in prefill
    fp8-mma   as prefetch, and an FP8 cache runs both kernels' dots on native e4m3 (q and P rounded to
              e4m3, as FlashAttention-3 does): decode with tokens as the MMA's M
              (kernels/paged_decode_fp8.py), prefill with query rows as M (PrefillConfig.fp8_mma)
    heads-first  the default decode tiles with the KV heads of a request as the grid's fastest
              dimension (DecodeConfig.heads_first); prefill as default

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


def variant_configs(name: str, fp8_cache: bool) -> tuple[DecodeConfig | None, PrefillConfig | None]:
    """(decode config, prefill config) of a variant for a cache of that kind; None: the default."""
    if name not in ATTENTION_VARIANTS:
        raise ValueError(f"unknown attention variant {name!r} ({', '.join(ATTENTION_VARIANTS)})")
    if name == "default":
        return None, None
    from dataclasses import replace

    from overnight.kernels.paged_decode import DecodeConfig, default_decode_config
    from overnight.kernels.paged_prefill import PrefillConfig

    if name == "heads-first":
        import torch

        cache_dtype = torch.float8_e4m3fn if fp8_cache else torch.bfloat16
        return replace(default_decode_config(cache_dtype), heads_first=True), None
    prefill = PrefillConfig(64, 64, 4, 3, prefetch_pages=True)
    if not fp8_cache:
        return DecodeConfig(64, 4, 4, prefetch_pages=True), prefill
    if name == "fp8-mma":
        return DecodeConfig(128, 4, 3, fp8_mma=True), replace(prefill, fp8_mma=True)
    return DecodeConfig(128, 4, 3, prefetch_pages=True), prefill
