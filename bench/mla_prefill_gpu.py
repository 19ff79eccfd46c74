"""GPU check and timing of latent attention's batched prefill (attention/mla_prefill.py: one Triton gather,
one GEMM through kv_b_proj's weight, the varlen attention kernel of kernels/mla_prefill.py) against the
per-request PyTorch path it replaces on the GPU (latent_prefill_ref in attention/mla.py), at
DeepSeek-V2-Lite's shapes: 16 heads, a 512-value latent, 64 rope values, 128 nope and 128 value values
per head, pages of 64 tokens, seed 0.

    PYTHONPATH=. python bench/mla_prefill_gpu.py

Cases: 16 requests x 512 new tokens (whole prompts), and 4 x 2048 new tokens after a 2048-token cached
prefix each; each over a bf16 cache and an FP8 (e4m3) one with per-part scales. Per case, first a
check: the new path against the reference in bf16 (relative error of the whole output). Then timings
(triton.testing.do_bench, median): the reference, the `mla-prefill-kernel` variant (rows absorbed and
attended one by one in the decode kernel), the new path at its default tiles and at a few other
attention tiles (block_m/block_n/warps/stages), and the new path's three stages alone at the default
(gather, GEMM, attention). TFLOP/s counts the GEMM (2 x sum L x R x H x (Dn + Dv)) and the causal
attention's two products (2 x H x (Dn + P + Dv) per visible query-key pair); the absorbed variant's
work differs (it shows 0). A human table, then one JSON line.
"""

from __future__ import annotations

import json
import math
from functools import partial

import torch
import torch.nn.functional as F
import triton

from overnight.attention.mla import absorb_query, latent_prefill_ref, row_contexts, split_kv_b
from overnight.attention.mla_prefill import kv_b_weight, latent_prefill
from overnight.attention.torch_backend import build_metadata
from overnight.kernels.latent_gather import latent_gather
from overnight.kernels.mla_decode import latent_write, mla_rows
from overnight.kernels.mla_prefill import MlaPrefillConfig, mla_prefill_attention

HEADS, RANK, ROPE, NOPE, V_DIM, PAGE = 16, 512, 64, 128, 128, 64
CASES = [(16, 512, 0), (4, 2048, 2048)]  # requests, new tokens each, cached prefix each
TILES = [
    None,
    MlaPrefillConfig(64, 64, 4, 3),  # the first default: 0.80-0.95x the 128 x 64 tiles (session J)
    MlaPrefillConfig(128, 32, 8, 3),
    MlaPrefillConfig(64, 64, 4, 2),
]
SCALE = 1 / math.sqrt(NOPE + ROPE)


def inputs(reqs: int, new: int, prefix: int, fp8: bool, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    ctx = new + prefix
    per_req = -(-ctx // PAGE)
    num_blocks = reqs * per_req + 8
    ids = torch.randperm(num_blocks, device="cuda", generator=gen).tolist()
    tables = [ids[i * per_req : (i + 1) * per_req] for i in range(reqs)]
    meta = build_metadata([new] * reqs, [ctx] * reqs, tables, PAGE, num_decodes=0, device="cuda")
    rows = torch.randn(num_blocks * PAGE, RANK + ROPE, device="cuda", generator=gen, dtype=torch.bfloat16)
    rows[:, RANK:] *= 8  # the rope part's range differs from the latent's
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    cache = torch.empty(1, num_blocks, PAGE, 1, RANK + ROPE, dtype=dtype, device="cuda")
    kv_scale = None
    if fp8:
        kv_scale = torch.stack([rows[:, :RANK].abs().amax(), rows[:, RANK:].abs().amax()]).float() / 448
    latent_write(rows, cache, torch.arange(rows.shape[0], device="cuda"), kv_scale, RANK)
    t = reqs * new
    q_nope = torch.randn(t, HEADS, NOPE, device="cuda", generator=gen, dtype=torch.bfloat16)
    q_pe = torch.randn(t, HEADS, ROPE, device="cuda", generator=gen, dtype=torch.bfloat16)
    w = torch.randn(HEADS * (NOPE + V_DIM), RANK, device="cuda", generator=gen, dtype=torch.bfloat16)
    w_uk, w_uv = split_kv_b(w / RANK**0.5, HEADS, NOPE)
    return meta, cache, kv_scale, q_nope, q_pe, w_uk, w_uv


def stages(meta, cache, kv_scale, q_nope, q_pe, w_uk, w_uv):
    """The new path's three stages as separate callables over preallocated buffers (one group)."""
    n = meta.num_reqs
    total = int(meta.seq_lens_cpu.sum())
    loc = F.pad(meta.seq_lens.long().cumsum(0), (1, 0)).int()
    rows = torch.empty(total, RANK + ROPE, dtype=q_nope.dtype, device="cuda")
    weight = kv_b_weight(w_uk, w_uv)
    max_len = int(meta.seq_lens_cpu.max())
    gather = partial(
        latent_gather, cache, meta.block_tables, meta.seq_lens, loc, 0, n, max_len, RANK, rows, kv_scale
    )
    gather()
    kv = torch.mm(rows[:, :RANK], weight.t()).view(total, HEADS, NOPE + V_DIM)
    out = q_nope.new_empty(q_nope.shape[0], HEADS, V_DIM)
    gemm = partial(torch.mm, rows[:, :RANK], weight.t())
    attend = partial(
        mla_prefill_attention, q_nope, q_pe, kv[..., :NOPE], rows[:, RANK:], kv[..., NOPE:],
        meta.query_start_loc, loc, 0, n, q_nope.shape[0], SCALE, out,
    )  # fmt: skip
    return {"gather": gather, "gemm": gemm, "attention": attend}


def absorbed(meta, cache, kv_scale, q_nope, q_pe, w_uk, w_uv) -> torch.Tensor:
    """The `mla-prefill-kernel` variant's path (triton_backend.forward_mla): every row absorbed, attended
    row by row by the decode kernel."""
    row_req, row_lens = row_contexts(meta, q_nope.shape[0])
    o_lat = mla_rows(absorb_query(q_nope, q_pe, w_uk), cache, meta.block_tables, row_req, row_lens, SCALE,
                     RANK, kv_scale)  # fmt: skip
    return torch.einsum("thr,hvr->thv", o_lat, w_uv)


def flops(reqs: int, new: int, prefix: int) -> tuple[float, float]:
    ctx = new + prefix
    gemm = 2 * reqs * ctx * RANK * HEADS * (NOPE + V_DIM)
    pairs = reqs * (new * prefix + new * (new + 1) / 2)
    return gemm, 2 * HEADS * (NOPE + ROPE + V_DIM) * pairs


def main() -> None:
    results = []
    print(
        f"{'reqs':>4} {'new':>5} {'prefix':>6} {'cache':>5} {'path':>16} {'us':>9} {'x ref':>6} {'TFLOP/s':>8}"
    )
    for reqs, new, prefix in CASES:
        gemm_flops, attn_flops = flops(reqs, new, prefix)
        for fp8 in (False, True):
            args = inputs(reqs, new, prefix, fp8)
            meta, cache, kv_scale, q_nope, q_pe, w_uk, w_uv = args
            ref_step = partial(latent_prefill_ref, q_nope, q_pe, cache, meta, SCALE, w_uk, w_uv, kv_scale)
            ref = ref_step().float()
            got = latent_prefill(q_nope, q_pe, cache, meta, SCALE, w_uk, w_uv, kv_scale).float()
            rel = float((got - ref).norm() / ref.norm())
            rel_absorbed = float((absorbed(*args).float() - ref).norm() / ref.norm())
            assert rel < 2e-2 and rel_absorbed < 2e-2, f"relative errors: new {rel}, absorbed {rel_absorbed}"
            del ref, got
            runs = [("ref", ref_step, gemm_flops + attn_flops), ("absorbed", partial(absorbed, *args), 0.0)]
            for tiles in TILES:
                label = "new" if tiles is None else "new " + "/".join(map(str, vars(tiles).values()))
                step = partial(
                    latent_prefill, q_nope, q_pe, cache, meta, SCALE, w_uk, w_uv, kv_scale, config=tiles
                )
                runs.append((label, step, gemm_flops + attn_flops))
            parts = stages(*args)
            counts = {"gather": 0.0, "gemm": gemm_flops, "attention": attn_flops}
            runs += [(f"  {name}", fn, counts[name]) for name, fn in parts.items()]
            base = None
            for label, fn, count in runs:
                us = triton.testing.do_bench(fn, warmup=10, rep=100) * 1e3
                base = base or us
                tflops = count / (us * 1e-6) / 1e12
                cache_name = "fp8" if fp8 else "bf16"
                print(
                    f"{reqs:>4} {new:>5} {prefix:>6} {cache_name:>5} {label:>16} {us:>9.1f} "
                    f"{base / us:>6.2f} {tflops:>8.1f}"
                )
                results.append(
                    dict(reqs=reqs, new=new, prefix=prefix, cache=cache_name, path=label.strip(),
                         us=round(us, 1), rel_err=rel if label.startswith("new") else None)
                )  # fmt: skip
            del args, parts, meta, cache
            torch.cuda.empty_cache()
    print(json.dumps({"device": torch.cuda.get_device_name(), "results": results}))


if __name__ == "__main__":
    main()
