"""H200 check and timing of the attention kernel variants, old defaults against new in one run, and
FlashAttention-3 (vLLM 0.26's build) on the same shapes when its library is at hand.

Run on the GPU machine from the repository root:

    PYTHONPATH=. python bench/attention_gpu.py [--fa3 PATH] [--budget-s 210] [--only decode|prefill|moe]

--fa3: vLLM's `_vllm_fa3_C.abi3.so` (or an .xz of it); without it the script takes the one of the
installed vLLM (vllm/vllm_flash_attn/). No FA3: its rows are skipped. Needs torch + triton only. About 3-4 minutes on an H200, a minute
or two of it compiling the ~40 kernel variants (each distinct tile shape, GQA group and split flag).

Order: correctness of every variant (bf16 cache, fp8 e4m3 and e5m2 caches; fresh random data,
poisoned outputs; a CUDA-graph replay of the fp8-MMA decode), then timings, most important first, each
skipped once --budget-s is spent: decode at Qwen3-8B's shape (32 q / 8 KV heads x 128, pages of 16)
b512 ctx2048, b256 ctx768, b1024 ctx640, b8 ctx32768 (split); prefill 16 x 1024 after a 512-token
prefix; decode at Qwen3-30B-A3B's (32 / 4 x 128: b296 ctx1312 and b512 ctx1536, the MoE long row's
steps; --only moe runs these alone, with their checks); decode at Qwen3-0.6B's (16 / 8 x 128). GB/s counts the bytes a kernel must read and write (K/V
of every context token, q, out, block table). Ends with a table per case (old default = "base") and
one JSON line. Variants (configs of overnight/kernels/paged_decode.py and paged_prefill.py):

    base            today's default for the cache dtype
    pf ...          prefetch_pages: page ids one tile ahead, K/V multi-buffered (kernels/kv_tiles.py)
    mma ...         fp8_mma: native e4m3 MMAs, q and P rounded; decode with tokens as M
                    (kernels/paged_decode_fp8.py), prefill with query rows as M (paged_prefill.py)
    hf ...          heads_first: the grid's fastest dimension is the request's KV heads, so the CTAs in
                    flight together read neighbouring bytes of the same pages
    fa3             FlashAttention-3 (fp8: q quantized per tensor, V in the plain layout, as vLLM does)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import time
from collections.abc import Callable
from functools import partial

import torch
import triton

from overnight.attention.kv_quant import quantize_kv
from overnight.attention.metadata import AttentionMetadata
from overnight.attention.torch_backend import build_metadata, paged_attention_ref
from overnight.attention.triton_backend import TritonAttentionBackend
from overnight.bench.gpu_info import sm_clock_now
from overnight.kernels.attention_fp8_ref import decode_fp8_mma_ref, prefill_fp8_mma_ref
from overnight.kernels.kv_layout import is_fp8, to_logical_layout, to_storage_layout, v_view
from overnight.kernels.paged_decode import (
    BF16_DECODE_CONFIG,
    FP8_FP16_DOTS_DECODE_CONFIG,
    FP8_SMALL_PAGE_DECODE_CONFIG,
    TARGET_CTAS_PER_SM,
    DecodeConfig,
    DecodeWorkspace,
    choose_num_splits,
    paged_decode,
)
from overnight.kernels.paged_prefill import (
    PrefillConfig,
    default_prefill_config,
    paged_prefill,
)

DEV = torch.device("cuda")
BF16, E4M3, E5M2 = torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2
PAGE, D = 16, 128
# (query heads, KV heads), head_dim 128; Qwen3-30B-A3B's group of 8 query heads a KV head is the MoE rows'
MODELS = {"qwen3-8b": (32, 8), "qwen3-0.6b": (16, 8), "qwen3-30b-a3b": (32, 4)}
MAX_MODEL_LEN = 40960
KV_SCALES = (0.05, 0.02)
HBM_GBPS = 4300.0  # the H200's measured copy bandwidth

DECODE = {
    BF16: [
        ("base n64 w4 s4 hf", BF16_DECODE_CONFIG),
        ("rf n64 w4 s4", DecodeConfig()),  # requests first: an earlier default
        ("pf n64 w4 s3", DecodeConfig(64, 4, 3, prefetch_pages=True)),
        ("pf n64 w4 s4", DecodeConfig(64, 4, 4, prefetch_pages=True)),
    ],
    E4M3: [
        ("base mma n128 w4 s3", FP8_SMALL_PAGE_DECODE_CONFIG),
        ("fp16 n128 w4 s3", FP8_FP16_DOTS_DECODE_CONFIG),  # fp16 dots: --attention-variant fp16-dots
        ("hf n128 w4 s3", DecodeConfig(128, 4, 3, heads_first=True)),
        ("hf pf n128 w4 s3", DecodeConfig(128, 4, 3, prefetch_pages=True, heads_first=True)),
        ("hf mma n64 w4 s3", DecodeConfig(64, 4, 3, fp8_mma=True, heads_first=True)),
        ("pf n128 w4 s3", DecodeConfig(128, 4, 3, prefetch_pages=True)),
        ("pf n64 w4 s4", DecodeConfig(64, 4, 4, prefetch_pages=True)),
        ("mma n64 w4 s3", DecodeConfig(64, 4, 3, fp8_mma=True)),
        ("mma n64 w4 s4", DecodeConfig(64, 4, 4, fp8_mma=True)),
        ("mma n128 w8 s3", DecodeConfig(128, 8, 3, fp8_mma=True)),
        # Larger tiles: an FP8 tile of 128 tokens moves half a bf16 tile's bytes for the same per-tile
        # work (page-table gather, addresses, barriers, the softmax), and 64-token tiles were 1.4x slower
        # than 128-token ones on pages of 16 (this bench): 256 tokens give the per-tile work twice the bytes.
        ("n256 w8 s3", DecodeConfig(256, 8, 3)),
        ("pf n256 w8 s3", DecodeConfig(256, 8, 3, prefetch_pages=True)),
        ("mma n256 w8 s3", DecodeConfig(256, 8, 3, fp8_mma=True)),
    ],
}
# The same kernels over an FP8 cache whose K is stored head-major inside each page (kv_layout.py's
# new_kv_cache(head_major_k=True)): one KV head's page is one 2-KB run instead of 16 runs of 128 bytes.
HEAD_MAJOR_VARIANTS = {
    "base mma n128 w4 s3",
    "fp16 n128 w4 s3",
    "hf n128 w4 s3",
    "pf n128 w4 s3",
    "mma n64 w4 s3",
    "n256 w8 s3",
    "mma n256 w8 s3",
}
# Qwen3-0.6B (its own compilations: GROUP is a constexpr) tries the default and the likeliest winners.
SMALL_MODEL_VARIANTS = {
    "base n64 w4 s4 hf",
    "pf n64 w4 s4",
    "base mma n128 w4 s3",
    "fp16 n128 w4 s3",
    "mma n64 w4 s4",
    "rf n64 w4 s4",
    "hf n128 w4 s3",
}
# The fp16-dot path (--attention-variant fp16-dots for an FP8 cache; the 16-bit caches' kernel).
PREFILL = [
    ("fp16 m64 n64 w4 s3", PrefillConfig()),
    ("pf m64 n64 w4 s3", PrefillConfig(64, 64, 4, 3, prefetch_pages=True)),
    ("pf m64 n64 w4 s4", PrefillConfig(64, 64, 4, 4, prefetch_pages=True)),
    ("pf m128 n64 w8 s3", PrefillConfig(128, 64, 8, 3, prefetch_pages=True)),
]
# FP8 cache only: both dots on e4m3 as stored, q and P rounded (PrefillConfig.fp8_mma). BLOCK_M is a
# multiple of 64, so the dots can be warpgroup MMAs reading 8-bit operands from shared memory.
PREFILL_FP8_MMA = [
    ("mma m128 n64 w8 s3", PrefillConfig(128, 64, 8, 3, fp8_mma=True)),
    ("mma m128 n128 w8 s3", PrefillConfig(128, 128, 8, 3, fp8_mma=True)),
    ("mma m64 n128 w4 s3", PrefillConfig(64, 128, 4, 3, fp8_mma=True)),
]


def prefill_configs(cache_dtype: torch.dtype) -> list[tuple[str, PrefillConfig]]:
    """ "base" is the kernel's default for the cache (e4m3 dots m64 n64 for an e4m3 one); an e5m2 cache
    tries the e4m3-dot tiles too (e4m3 q against e5m2 K, for its default)."""
    base = default_prefill_config(cache_dtype)
    name = f"base {'mma ' if base.fp8_mma else ''}m{base.block_m} n{base.block_n} w{base.num_warps} s{base.num_stages}"
    mma = PREFILL_FP8_MMA if is_fp8(cache_dtype) else []
    if cache_dtype == E5M2:
        mma = [("mma m64 n64 w4 s3", PrefillConfig(64, 64, 4, 3, fp8_mma=True)), *mma]
    return [(name, base)] + PREFILL + mma


# (model, batch, context); the split case also tries 16 splits besides the heuristic's count.
DECODE_CASES = [
    ("qwen3-8b", 512, 2048),
    ("qwen3-8b", 256, 768),
    ("qwen3-8b", 1024, 640),
    ("qwen3-8b", 8, 32768),
]
SMALL_MODEL_CASES = [("qwen3-0.6b", 256, 768), ("qwen3-0.6b", 512, 2048), ("qwen3-0.6b", 1024, 640)]
# The MoE FP8 long row's decode steps (docs/performance.md, session R): ~296 requests at ~1,312 tokens
# on the H100's pool, all 512 at ~1,536 on the H200's
MOE_CASES = [("qwen3-30b-a3b", 296, 1312), ("qwen3-30b-a3b", 512, 1536)]

checks: list[tuple[str, float, bool]] = []
rows: list[dict] = []
START = time.time()


# ---------------------------------------------------------------- inputs and helpers


def make_case(
    hq: int, hkv: int, query_lens: list[int], seq_lens: list[int], num_decodes: int, seed: int, cache_dtype
) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Shuffled pages, random q and cache (fp8: random values quantized with KV_SCALES, stored in the
    dtype's layout); returns (meta, q, cache, kv_scale)."""
    gen = torch.Generator().manual_seed(seed)
    needed = [triton.cdiv(s, PAGE) for s in seq_lens]
    num_blocks = sum(needed) + 8
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in needed:
        tables.append(perm[used : used + n])
        used += n
    meta = build_metadata(query_lens, seq_lens, tables, PAGE, num_decodes=num_decodes, device=DEV)
    torch.manual_seed(seed)
    q = torch.randn(meta.num_tokens, hq, D, device=DEV, dtype=BF16)
    cache = torch.randn(2, num_blocks, PAGE, hkv, D, device=DEV, dtype=BF16)
    if not is_fp8(cache_dtype):
        return meta, q, cache, None
    scales = torch.tensor(KV_SCALES, device=DEV)
    logical = torch.stack([quantize_kv(cache[i], KV_SCALES[i], cache_dtype) for i in range(2)])
    del cache
    return meta, q, to_storage_layout(logical), scales


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not out.isfinite().all():
        return float("inf")
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)).item()


def rms_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||: the measure against an emulation of the e4m3 roundings. Rounding to 3
    mantissa bits is a step function, so arithmetic that differs at 1e-5 (the GPU's exp2, its
    accumulation order) flips single values near a step by a whole e4m3 step; in the max-norm that reads
    as up to ~1% (on the CPU, the prefill check case's scores nudged by 1e-5 moved the emulation by 1.2e-2
    max-norm and 1.1e-3 RMS), while a missing rounding moves it by ~3% RMS."""
    if not out.isfinite().all():
        return float("inf")
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-6)).item()


def check(name: str, err: float, tol: float) -> None:
    ok = err <= tol
    checks.append((name, err, ok))
    print(f"  {'ok  ' if ok else 'FAIL'} {name:<64} rel err {err:.2e} (tol {tol:.0e})", flush=True)


def try_run(name: str, fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception as e:  # one variant that does not compile or fit must not end the run
        checks.append((name, float("inf"), False))
        print(
            f"  FAIL {name}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}", flush=True
        )


def time_us(fn: Callable[[], None]) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def over_budget(budget_s: float, what: str) -> bool:
    if time.time() - START > budget_s:
        print(f"  (skipped {what}: past the {budget_s:.0f} s budget)", flush=True)
        return True
    return False


def decode_bytes(batch: int, ctx: int, hq: int, hkv: int, elem: int) -> int:
    kv = batch * ctx * hkv * D * 2 * elem
    return kv + 2 * batch * hq * D * 2 + batch * triton.cdiv(ctx, PAGE) * 4


def record(case: str, kernel: str, variant: str, us: float, nbytes: int | None, flops: float | None) -> None:
    gbps = nbytes / us / 1e3 if nbytes else None
    tflops = flops / us / 1e6 if flops else None
    rows.append(dict(case=case, kernel=kernel, variant=variant, us=us, gbps=gbps, tflops=tflops))
    perf = f"{gbps:7.0f} GB/s ({100 * gbps / HBM_GBPS:4.0f}% of copy)" if gbps else ""
    perf += f"{tflops:7.1f} TFLOP/s" if tflops else ""
    print(f"  {case:<26} {kernel:<12} {variant:<22} {us:9.1f} us  {perf}", flush=True)


# ---------------------------------------------------------------- FlashAttention-3 (optional)


def find_fa3(hint: str | None) -> str | None:
    """Path of a loadable _vllm_fa3_C .so: --fa3, else the one of the installed vLLM; an .xz of it is
    unpacked to /tmp."""
    candidates = [hint] if hint else []
    spec = importlib.util.find_spec("vllm")
    if spec is not None and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            candidates.append(os.path.join(root, "vllm_flash_attn", "_vllm_fa3_C.abi3.so"))
    for path in candidates:
        if not path or not os.path.exists(path):
            continue
        if path.endswith(".xz"):
            with open("/tmp/_vllm_fa3_C.abi3.so", "wb") as f:
                subprocess.run(["xz", "-T0", "-dc", path], stdout=f, check=True)
            return "/tmp/_vllm_fa3_C.abi3.so"
        return path
    return None


def load_fa3(hint: str | None) -> Callable | None:
    try:
        path = find_fa3(hint)
        if path is None:
            print("FA3: no library found (rows skipped)")
            return None
        torch.ops.load_library(path)
        print(f"FA3: loaded {path}")
        return torch.ops._vllm_fa3_C.fwd
    except Exception as e:
        print(f"FA3: not usable ({type(e).__name__}: {str(e)[:200]})")
        return None


class Fa3Inputs:
    """FA3's view of a case: K/V caches [blocks, PAGE, Hkv, D] in the plain layout (FA3 reads V like K),
    an fp8 q quantized with one scale (FA3 wants q, K and V of one dtype), descales [batch, Hkv]."""

    def __init__(self, meta: AttentionMetadata, q: torch.Tensor, cache: torch.Tensor, kv_scale) -> None:
        self.meta = meta
        self.k = cache[0]
        self.v = v_view(cache).contiguous() if is_fp8(cache.dtype) else cache[1]
        batch, hkv = meta.num_reqs, cache.shape[3]
        if is_fp8(cache.dtype):
            q_scale = q.float().abs().max() / 448.0
            self.q = (q.float() / q_scale).to(cache.dtype)
            self.descales = (
                q_scale.reshape(1, 1).expand(batch, hkv).contiguous(),
                kv_scale[0].reshape(1, 1).expand(batch, hkv).contiguous(),
                kv_scale[1].reshape(1, 1).expand(batch, hkv).contiguous(),
            )
        else:
            self.q = q
            self.descales = (None, None, None)


def fa3_run(fwd: Callable, x: Fa3Inputs, scale: float) -> torch.Tensor:
    m = x.meta
    res = fwd(
        q=x.q,
        k=x.k,
        v=x.v,
        k_new=None,
        v_new=None,
        q_v=None,
        out=None,
        cu_seqlens_q=m.query_start_loc,
        cu_seqlens_k=None,
        cu_seqlens_k_new=None,
        seqused_q=None,
        seqused_k=m.seq_lens,
        max_seqlen_q=m.max_query_len,
        max_seqlen_k=m.max_seq_len,
        page_table=m.block_tables,
        kv_batch_idx=None,
        leftpad_k=None,
        rotary_cos=None,
        rotary_sin=None,
        seqlens_rotary=None,
        q_descale=x.descales[0],
        k_descale=x.descales[1],
        v_descale=x.descales[2],
        softmax_scale=scale,
        is_causal=True,
        window_size_left=-1,
        window_size_right=-1,
        softcap=0.0,
        is_rotary_interleaved=False,
        scheduler_metadata=None,
        num_splits=0,
        pack_gqa=None,
        sm_margin=0,
        s_aux=None,
        cp_world_size=1,
        cp_rank=0,
        cp_tot_seqused_k=None,
    )
    return res[0]


# ---------------------------------------------------------------- correctness


def run_decode(meta, q, cache, kv_scale, cfg: DecodeConfig, num_splits: int, ws=None) -> torch.Tensor:
    out = torch.full_like(q, float("nan"))
    nd = meta.num_decodes
    paged_decode(q, cache, meta.block_tables, meta.seq_lens, nd, D**-0.5, out, num_splits, ws, kv_scale, cfg)
    return out


def decode_variants(model: str, cache_dtype: torch.dtype) -> list[tuple[str, DecodeConfig]]:
    variants = DECODE[E4M3 if is_fp8(cache_dtype) else BF16]
    full = model in ("qwen3-8b", "qwen3-30b-a3b")  # the shapes being tuned get every variant
    return variants if full else [v for v in variants if v[0] in SMALL_MODEL_VARIANTS]


def with_head_major(
    model: str, cache_dtype: torch.dtype, cache: torch.Tensor
) -> list[tuple[str, DecodeConfig, torch.Tensor]]:
    """(label, config, cache) for every decode variant; an FP8 cache adds HEAD_MAJOR_VARIANTS over the
    same values stored with K head-major ("hm ")."""
    out = [(name, cfg, cache) for name, cfg in decode_variants(model, cache_dtype)]
    if is_fp8(cache_dtype):
        hm = to_storage_layout(to_logical_layout(cache), head_major_k=True)
        out += [("hm " + name, cfg, hm) for name, cfg, _ in out if name in HEAD_MAJOR_VARIANTS]
    return out


def check_decode_one(
    tag: str, meta, q, cache, kv_scale, exact, cfg: DecodeConfig, ns: int, emus: dict
) -> None:
    out = run_decode(meta, q, cache, kv_scale, cfg, ns)
    if not cfg.fp8_mma:
        check(tag, rel_err(out, exact), 2e-2)
        return
    n = meta.num_decodes
    if (cfg.block_n, ns) not in emus:  # the reference is a Python loop over tiles: once per tiling
        emus[cfg.block_n, ns] = decode_fp8_mma_ref(
            q, cache, meta.block_tables, meta.seq_lens, n, D**-0.5, kv_scale, cfg.block_n, ns
        )
    check(tag + " vs its rounding ref (RMS)", rms_rel_err(out, emus[cfg.block_n, ns]), 1e-2)
    check(tag + " vs exact", rel_err(out, exact), 8e-2)


def check_fa3_one(tag: str, fa3: Callable, meta, q, cache, kv_scale, exact) -> None:
    check(tag, rel_err(fa3_run(fa3, Fa3Inputs(meta, q, cache, kv_scale), D**-0.5), exact), 8e-2)


def check_decode_case(
    model: str, cache_dtype: torch.dtype, seq_lens: list[int], fa3: Callable | None
) -> None:
    hq, hkv = MODELS[model]
    n = len(seq_lens)
    meta, q, cache, kv_scale = make_case(hq, hkv, [1] * n, seq_lens, n, 3, cache_dtype)
    exact = paged_attention_ref(q.float(), cache, meta, D**-0.5, kv_scale)
    emus: dict = {}
    for name, cfg, stored in with_head_major(model, cache_dtype, cache):
        for ns in (1, choose_num_splits(n, hkv, MAX_MODEL_LEN)):
            tag = f"decode {model} {str(cache_dtype)[6:]} {name} splits={ns}"
            try_run(tag, partial(check_decode_one, tag, meta, q, stored, kv_scale, exact, cfg, ns, emus))
    if fa3 is not None and cache_dtype != E5M2:
        tag = f"decode {model} {str(cache_dtype)[6:]} fa3"
        try_run(tag, partial(check_fa3_one, tag, fa3, meta, q, cache, kv_scale, exact))


def check_decode_variants(fa3: Callable | None, models: tuple[str, ...]) -> None:
    gen = torch.Generator().manual_seed(2)
    seq_lens = torch.randint(1, 3000, (24,), generator=gen).tolist() + [1, 15, 16, 17, 4096]
    for model in models:
        for cache_dtype in (BF16, E4M3, E5M2):
            check_decode_case(model, cache_dtype, seq_lens, fa3)


def check_prefill_one(tag: str, meta, q, cache, kv_scale, ref, cfg: PrefillConfig) -> None:
    out = torch.full_like(q, float("nan"))
    qsl, n = meta.query_start_loc, meta.num_reqs
    paged_prefill(
        q, cache, meta.block_tables, meta.seq_lens, qsl, 0, n, meta.num_tokens, D**-0.5, out, kv_scale, cfg
    )
    if not cfg.fp8_mma:
        check(tag, rel_err(out, ref), 2e-2)
        return
    # Its own roundings emulated: the same numbers but for the GPU's arithmetic (see rms_rel_err).
    # Against the exact answer it may lose what rounding q and P to 3 mantissa bits costs (this bench on
    # the H200: 3.5% max-norm; FlashAttention-3's FP8 path 4.4%).
    emulated = prefill_fp8_mma_ref(
        q, cache, meta.block_tables, meta.seq_lens, qsl, 0, n, D**-0.5, kv_scale, cfg.block_n
    )
    check(tag + " vs its rounding (RMS)", rms_rel_err(out, emulated), 1e-2)
    check(tag, rel_err(out, ref), 5e-2)


def check_prefill_variants(fa3: Callable | None) -> None:
    query_lens, seq_lens = [1024, 1024, 1, 300, 77], [1024, 1536, 700, 333, 77]
    hq, hkv = MODELS["qwen3-8b"]
    for cache_dtype in (BF16, E4M3, E5M2):
        meta, q, cache, kv_scale = make_case(hq, hkv, query_lens, seq_lens, 0, 5, cache_dtype)
        ref = paged_attention_ref(q.float(), cache, meta, D**-0.5, kv_scale)
        for name, cfg in prefill_configs(cache_dtype):
            tag = f"prefill {str(cache_dtype)[6:]} {name}"
            try_run(tag, partial(check_prefill_one, tag, meta, q, cache, kv_scale, ref, cfg))
        if fa3 is not None and cache_dtype != E5M2:
            tag = f"prefill {str(cache_dtype)[6:]} fa3"
            try_run(tag, partial(check_fa3_one, tag, fa3, meta, q, cache, kv_scale, ref))


def check_fp8_mma_graph(cfg: DecodeConfig | None = None, page: int = PAGE) -> None:
    """The fp8-MMA decode (cfg; default n128 on pages of `page` tokens) captured in a CUDA graph through
    the backend, replayed on new lengths, tables and scales (what the engine's decode graphs do; the TMA
    variant's descriptors go into the graph by value)."""
    hq, hkv = MODELS["qwen3-8b"]
    batch, width = 16, 1024 // page
    num_blocks = batch * width + 8
    cfg = cfg or DecodeConfig(128, 4, 3, fp8_mma=True)
    backend = TritonAttentionBackend(hq, hkv, D, 64, 4096, DEV, decode_config=cfg)

    def meta_for(lens: list[int], seed: int) -> AttentionMetadata:
        perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        tables = [perm[i * width : (i + 1) * width] for i in range(batch)]
        return build_metadata([1] * batch, lens, tables, page, batch, DEV)

    full = torch.randn(2, num_blocks, page, hkv, D, device=DEV, dtype=BF16)
    cache = to_storage_layout(torch.stack([quantize_kv(full[i], 1.0, E4M3) for i in range(2)]))
    scales = torch.ones(2, device=DEV)
    meta = meta_for([700] * batch, seed=8)
    q = torch.randn(batch, hq, D, device=DEV, dtype=BF16)
    k = torch.randn(batch, hkv, D, device=DEV, dtype=BF16)
    v = torch.randn(batch, hkv, D, device=DEV, dtype=BF16)
    backend.forward(q, k, v, cache, meta, D**-0.5, scales)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, cache, meta, D**-0.5, scales)
    lens = torch.randint(1, width * page + 1, (batch,), generator=torch.Generator().manual_seed(9)).tolist()
    new = meta_for(lens, seed=10)
    for static, fresh in ((meta.seq_lens, new.seq_lens), (meta.block_tables, new.block_tables),
                          (meta.slot_mapping, new.slot_mapping)):  # fmt: skip
        static.copy_(fresh)
    scales.copy_(torch.tensor(KV_SCALES, device=DEV))
    for x in (q, k, v):
        x.normal_()
    graph.replay()
    torch.cuda.synchronize()
    ref = paged_attention_ref(q.float(), cache, new, D**-0.5, scales)
    check(
        f"fp8-MMA decode n{cfg.block_n}{' tma' if cfg.tma else ''} p{page}, CUDA graph replay (splits={backend.num_splits(batch)}) vs exact",
        rel_err(out, ref),
        8e-2,
    )


# ---------------------------------------------------------------- timing


def time_decode(
    case: str, kernel: str, label: str, nbytes: int, meta, q, cache, kv_scale, cfg, ns, ws
) -> None:
    out = torch.empty_like(q)
    batch = meta.num_decodes

    def fn() -> None:
        paged_decode(q, cache, meta.block_tables, meta.seq_lens, batch, D**-0.5, out, ns, ws, kv_scale, cfg)

    record(case, kernel, label, time_us(fn), nbytes, None)


def time_fa3(case: str, kernel: str, fa3: Callable, meta, q, cache, kv_scale, nbytes, flops) -> None:
    x = Fa3Inputs(meta, q, cache, kv_scale)
    record(case, kernel, "fa3", time_us(lambda: fa3_run(fa3, x, D**-0.5)), nbytes, flops)


def bench_decode_dtype(
    model: str, batch: int, ctx: int, cache_dtype, fa3: Callable | None, num_sms: int
) -> None:
    hq, hkv = MODELS[model]
    heuristic = choose_num_splits(batch, hkv, MAX_MODEL_LEN, num_sms)
    # Besides the heuristic's count (the first that reaches one wave of TARGET_CTAS_PER_SM CTAs per SM, so
    # its CTAs spill a little into a second wave) and 16: the most that still fit one wave.
    one_wave = max(1, TARGET_CTAS_PER_SM * num_sms // (batch * hkv))
    splits = [1] if heuristic == 1 else sorted({heuristic, 16, one_wave})
    case = f"{model} b{batch} ctx{ctx}"
    meta, q, cache, kv_scale = make_case(hq, hkv, [1] * batch, [ctx] * batch, batch, 11, cache_dtype)
    nbytes = decode_bytes(batch, ctx, hq, hkv, cache.element_size())
    ws = DecodeWorkspace(batch * max(splits), hq, D, DEV)
    kernel = "decode " + ("fp8" if is_fp8(cache_dtype) else "bf16")
    for name, cfg, stored in with_head_major(model, cache_dtype, cache):
        for ns in splits:
            label = name + (f" x{ns}" if ns > 1 else "")
            args = (case, kernel, label, nbytes, meta, q, stored, kv_scale, cfg, ns, ws)
            try_run(f"time {case} {kernel} {label}", partial(time_decode, *args))
    if fa3 is not None:
        try_run(
            f"time {case} {kernel} fa3",
            partial(time_fa3, case, kernel, fa3, meta, q, cache, kv_scale, nbytes, None),
        )


def bench_decode(model: str, batch: int, ctx: int, fa3: Callable | None, num_sms: int) -> None:
    for cache_dtype in (BF16, E4M3):
        try_run(f"decode {model} b{batch} ctx{ctx} {cache_dtype}",
                partial(bench_decode_dtype, model, batch, ctx, cache_dtype, fa3, num_sms))  # fmt: skip
        torch.cuda.empty_cache()


def causal_flops(query_lens: list[int], seq_lens: list[int], hq: int) -> float:
    pairs = sum(sum(range(s - q + 1, s + 1)) for q, s in zip(query_lens, seq_lens, strict=True))
    return 4.0 * D * hq * pairs


def time_prefill(case: str, kernel: str, name: str, flops: float, meta, q, cache, kv_scale, cfg) -> None:
    out = torch.empty_like(q)
    qsl, n, t = meta.query_start_loc, meta.num_reqs, meta.num_tokens

    def fn() -> None:
        paged_prefill(q, cache, meta.block_tables, meta.seq_lens, qsl, 0, n, t, D**-0.5, out, kv_scale, cfg)

    record(case, kernel, name, time_us(fn), None, flops)


def time_sdpa(case: str, kernel: str, flops: float, hq: int) -> None:
    """Yardstick: torch SDPA on contiguous K/V (heads expanded), the same causal pairs (lower right)."""
    from torch.nn.attention.bias import causal_lower_right

    qs = torch.randn(16, hq, 1024, D, device=DEV, dtype=BF16)
    ks = torch.randn(16, hq, 1536, D, device=DEV, dtype=BF16)
    vs = torch.randn_like(ks)
    bias = causal_lower_right(1024, 1536)
    f = torch.nn.functional.scaled_dot_product_attention
    record(case, kernel, "torch sdpa (dense)", time_us(lambda: f(qs, ks, vs, attn_mask=bias)), None, flops)


def bench_prefill_dtype(cache_dtype, fa3: Callable | None) -> None:
    hq, hkv = MODELS["qwen3-8b"]
    query_lens, seq_lens = [1024] * 16, [1536] * 16
    flops = causal_flops(query_lens, seq_lens, hq)
    case = "qwen3-8b 16x1024 +512"
    meta, q, cache, kv_scale = make_case(hq, hkv, query_lens, seq_lens, 0, 12, cache_dtype)
    kernel = "prefill " + ("fp8" if is_fp8(cache_dtype) else "bf16")
    for name, cfg in prefill_configs(cache_dtype):
        args = (case, kernel, name, flops, meta, q, cache, kv_scale, cfg)
        try_run(f"time {case} {kernel} {name}", partial(time_prefill, *args))
    if fa3 is not None:
        try_run(
            f"time {case} {kernel} fa3",
            partial(time_fa3, case, kernel, fa3, meta, q, cache, kv_scale, None, flops),
        )
    if cache_dtype == BF16:
        try_run("time sdpa", partial(time_sdpa, case, kernel, flops, hq))


def bench_prefill(fa3: Callable | None) -> None:
    for cache_dtype in (BF16, E4M3):
        try_run(f"prefill {cache_dtype}", partial(bench_prefill_dtype, cache_dtype, fa3))
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- report


def summary() -> dict:
    """Per case and kernel: the old default, the best variant, and the speed-up."""
    out = {}
    print("\nsummary (base = today's default; best over the variants; speed-up over base):")
    print(
        f"  {'case':<26} {'kernel':<12} {'base us':>9} {'best':<22} {'best us':>9} {'x base':>7} {'GB/s or TFLOP/s':>16}"
    )
    for key in dict.fromkeys((r["case"], r["kernel"]) for r in rows):
        mine = [r for r in rows if (r["case"], r["kernel"]) == key and not r["variant"].startswith("torch")]
        base = next((r for r in mine if r["variant"].startswith("base")), None)
        ours = [r for r in mine if r["variant"] != "fa3"]
        if not ours:
            continue
        best = min(ours, key=lambda r: r["us"])
        fa3 = next((r for r in mine if r["variant"] == "fa3"), None)
        speed = base["us"] / best["us"] if base else float("nan")
        perf = best["gbps"] or best["tflops"] or 0.0
        print(f"  {key[0]:<26} {key[1]:<12} {base['us'] if base else float('nan'):9.1f} {best['variant']:<22} "
              f"{best['us']:9.1f} {speed:7.2f} {perf:16.0f}" + (f"   fa3 {fa3['us']:.1f} us" if fa3 else ""))  # fmt: skip
        out[f"{key[0]} {key[1]}"] = dict(
            base_us=round(base["us"], 1) if base else None,
            best=best["variant"],
            best_us=round(best["us"], 1),
            speedup=round(speed, 3),
            best_gbps=round(best["gbps"]) if best["gbps"] else None,
            best_tflops=round(best["tflops"], 1) if best["tflops"] else None,
            fa3_us=round(fa3["us"], 1) if fa3 else None,
            all={r["variant"]: round(r["us"], 1) for r in mine},
        )
    print("fp8 cache against bf16 (decode; x = bf16 base time / fp8 time):")
    for case in dict.fromkeys(r["case"] for r in rows):
        bf16, fp8 = out.get(f"{case} decode bf16"), out.get(f"{case} decode fp8")
        if bf16 and fp8 and bf16["base_us"] and fp8["base_us"]:
            old_x, new_x = bf16["base_us"] / fp8["base_us"], bf16["base_us"] / fp8["best_us"]
            fp8["vs_bf16_base"] = dict(old=round(old_x, 3), new=round(new_x, 3))
            print(f"  {case:<26} fp8 base {old_x:.2f}x, fp8 best ({fp8['best']}) {new_x:.2f}x")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fa3", default=None, help="path of vLLM's _vllm_fa3_C.abi3.so (.xz, or vrest.tar.xz)")
    ap.add_argument("--budget-s", type=float, default=210.0, help="skip remaining timings after this")
    ap.add_argument(
        "--only",
        choices=("decode", "prefill", "moe"),
        default=None,
        help="check and time one kernel's variants (moe: decode at Qwen3-30B-A3B's heads only)",
    )
    args = ap.parse_args()
    decode, prefill = args.only in (None, "decode"), args.only in (None, "prefill")
    moe = args.only in (None, "moe")
    checked = tuple(m for m in MODELS if (decode and m != "qwen3-30b-a3b") or (moe and m == "qwen3-30b-a3b"))
    props = torch.cuda.get_device_properties(DEV)
    print(
        f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}"
    )
    print(f"SM clock (now, max) at start: {sm_clock_now()}", flush=True)
    fa3 = load_fa3(args.fa3)
    print("correctness (against the fp32 reference on the dequantized cache):", flush=True)
    if checked:
        try_run("decode checks", lambda: check_decode_variants(fa3, checked))
    if prefill:
        try_run("prefill checks", lambda: check_prefill_variants(fa3))
    if decode:
        try_run("fp8-MMA CUDA graph check", check_fp8_mma_graph)
    print(f"timing (do_bench median, L2 flushed; {time.time() - START:.0f} s so far):", flush=True)
    for model, batch, ctx in DECODE_CASES if decode else []:
        if not over_budget(args.budget_s, f"{model} b{batch} ctx{ctx}"):
            try_run(
                f"decode {model} b{batch}",
                lambda m=model, b=batch, c=ctx: bench_decode(m, b, c, fa3, props.multi_processor_count),
            )
    if prefill and not over_budget(args.budget_s, "prefill"):
        try_run("prefill timings", lambda: bench_prefill(fa3))
    print(f"SM clock (now, max) after the 8B cases: {sm_clock_now()}", flush=True)
    for model, batch, ctx in MOE_CASES if moe else []:
        if not over_budget(args.budget_s, f"{model} b{batch} ctx{ctx}"):
            try_run(
                f"decode {model} b{batch}",
                lambda m=model, b=batch, c=ctx: bench_decode(m, b, c, fa3, props.multi_processor_count),
            )
    for model, batch, ctx in SMALL_MODEL_CASES if decode else []:
        if not over_budget(args.budget_s, f"{model} b{batch} ctx{ctx}"):
            try_run(
                f"decode {model} b{batch}",
                lambda m=model, b=batch, c=ctx: bench_decode(m, b, c, fa3, props.multi_processor_count),
            )
    best = summary()
    failed = [name for name, _, ok in checks if not ok]
    print(
        f"checks: {len(checks) - len(failed)}/{len(checks)} passed"
        + (f"; FAILED: {failed}" if failed else "")
    )
    print(f"SM clock (now, max) at the end: {sm_clock_now()}; total {time.time() - START:.0f} s")
    print(json.dumps(dict(device=props.name, fa3=fa3 is not None, checks_failed=failed, cases=best)))


if __name__ == "__main__":
    main()
