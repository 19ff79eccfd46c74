"""Multi-head latent attention (MLA: DeepSeek-V2 / V3, Kimi-K2, Moonlight, GLM-4.7-Flash) over a cache of
latents, in plain PyTorch: the CPU path and the reference for GPU kernels (models/deepseek.py calls it
through AttentionBatch.mla).

A layer caches one row per token, not per-head K and V (the cache tensor has one plane,
engine/kv_groups.py's planes = 1):

    kv_cache[1, num_blocks, block_size, 1, R + P]
    row = [ c (R = kv_lora_rank values: the normalized latent) | k_pe (P = qk_rope_head_dim: the rotated
            key shared by every head) ]

DeepSeek-V3: R + P = 576 values per token and layer, against 128 heads x (192 + 128) = 40960 for K and V
(71x smaller). kv_b_proj's weight, per head h, splits into W_UK[h] [Dn, R] and W_UV[h] [Dv, R]:

    k[h] = [ W_UK[h] c | k_pe ]               v[h] = W_UV[h] c
    s_j  = scale * (q_nope[h] . W_UK[h] c_j + q_pe[h] . k_pe_j)
         = scale * ([W_UK[h]^T q_nope[h] | q_pe[h]] . row_j)              (W_UK absorbed into q)
    o[h] = sum_j p_j W_UV[h] c_j  =  W_UV[h] (sum_j p_j c_j)              (W_UV applied once, after)

Two forms of the same numbers, chosen per row kind:
  - decompressed (prefill chunks): a request's cached rows become per-head K [L, H, Dn + P] and
    V [L, H, Dv] (kv_b_proj), then ordinary causal attention: a chunk of many queries pays the
    decompression once. Those K and V live for one layer of one request, L x H x (Dn + P + Dv) values
    (DeepSeek-V2-Lite at a 32K context: 470 MB in bf16), outside the pool plan's measured peak. On the
    GPU every prefill request of a step is decompressed and attended at once (attention/mla_prefill.py,
    latent_prefill_ref here its reference), in groups of bounded size.
  - absorbed (decodes): q_lat = [W_UK^T q_nope | q_pe] (R + P wide per head), attention as MQA over the
    rows (one KV head for all H query heads), the values being the first R values of the same rows (no
    second copy), then W_UV maps each head's R-wide output to Dv: one query pays no decompression.
    On the GPU that MQA is kernels/mla_decode.py (mla_decode_ref here is its reference).

An FP8 cache (kv_cache_dtype fp8: half the bytes of a bf16 row, and of what each decode step reads)
stores each part of a row divided by its own per-tensor scale, saturated, cast (kv_quant.py's
arithmetic), the layer's kv_scales row read as

    kv_scale[2] = [ latent scale (c: both the keys' and the values' part) | rope scale (k_pe) ]

Two scales, not one: the two parts come from different places (c is RMS-normalized, k_pe is a raw
projection output, rotated) and their ranges differ, so a calibrated cache (calculate_kv_scales)
maps each part's own largest value onto the format's maximum. vLLM's MLA FP8 cache quantizes the whole
row with the layer's one k_scale, calibrated from c alone (k_pe can saturate there); FlashMLA's
DeepSeek-V3.2 format keeps k_pe in bf16 beside a latent with a scale per 128 values. A checkpoint's
k_scale therefore sets both (models/deepseek.py), as vLLM applies it; without one both are 1.0, as an
ordinary FP8 cache's. Dequantizing is x * scale after the cast; since the latent's scale is one number
it also factors out of the values' weighted sum (the kernel multiplies it in once, at the end).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from overnight.attention.kv_quant import quantize_kv
from overnight.attention.metadata import AttentionMetadata


def row_scales(kv_scale: torch.Tensor, rank: int, width: int) -> torch.Tensor:
    """A layer's [2] (latent, rope) scales spread over a row's width: [width] float32."""
    return torch.cat([kv_scale[:1].expand(rank), kv_scale[1:].expand(width - rank)]).float()


def load_rows(
    rows: torch.Tensor, dtype: torch.dtype, kv_scale: torch.Tensor | None, rank: int
) -> torch.Tensor:
    """Cached rows [..., R + P] in `dtype`, dequantized when the cache is scaled (FP8)."""
    if kv_scale is None:
        return rows.to(dtype)
    return (rows.to(dtype) * row_scales(kv_scale, rank, rows.shape[-1])).to(dtype)


def write_latent_ref(
    rows: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
    rank: int | None = None,
) -> None:
    """Store each token's row [T, R + P] at its flat slot; rows whose slot is -1 (padding) are skipped.
    With kv_scale ([2]: latent, rope; rank = R) the parts are stored quantized (module docstring)."""
    block_size = kv_cache.shape[2]
    n = slot_mapping.shape[0]
    valid = slot_mapping[:n] >= 0
    slots = slot_mapping[:n][valid]
    new = rows[:n][valid]
    if kv_scale is not None:
        if rank is None:
            raise ValueError("a scaled latent write needs the latent width (rank)")
        new = quantize_kv(new, row_scales(kv_scale, rank, new.shape[-1]), kv_cache.dtype)
    kv_cache[0][slots // block_size, slots % block_size] = new[:, None].to(kv_cache.dtype)


def mla_decode_supported(rank: int, rope: int) -> bool:
    """Whether the kernel takes these widths: powers of two of at least 16 (tensor-core dots)."""
    return all(d >= 16 and d & (d - 1) == 0 for d in (rank, rope))


def mla_decode_ref(
    q_lat: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    rank: int,
    num_decodes: int,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """mla_decode in PyTorch (fp32 on the CPU): every request's rows up to the longest context, read
    dequantized with kv_scale ([2]: latent, rope) from an FP8 cache."""
    nd = num_decodes
    max_len = int(seq_lens[:nd].max()) if nd else 0
    page = cache.shape[2]
    blocks = block_tables[:nd, : -(-max_len // page)].long()
    rows = cache[0, blocks].flatten(1, 2)[:, :max_len, 0]  # [nd, L, RANK + ROPE]
    compute = torch.float32 if q_lat.device.type == "cpu" else q_lat.dtype
    rows = load_rows(rows, compute, kv_scale, rank)
    pad = torch.arange(max_len, device=q_lat.device)[None, :] >= seq_lens[:nd, None]
    scores = torch.einsum("bhd,bld->bhl", q_lat[:nd].to(compute), rows) * scale
    probs = scores.masked_fill(pad[:, None, :], float("-inf")).softmax(dim=-1).nan_to_num(0.0)
    values = rows[..., :rank].masked_fill(pad[:, :, None], 0.0)  # 0 * NaN would poison the sum
    return torch.einsum("bhl,blr->bhr", probs, values).to(q_lat.dtype)


def row_contexts(meta: AttentionMetadata, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each of num_rows query rows: its request (int32 [R]) and how many cached rows it sees (int32
    [R]: a row at position p sees p + 1, causal; rows past the step's tokens, 0). On the device, without
    host reads."""
    qsl = meta.query_start_loc[: meta.num_reqs + 1].long()
    rows = torch.arange(num_rows, device=qsl.device)
    req = torch.searchsorted(qsl[1:], rows, right=True).clamp(max=meta.num_reqs - 1)
    # row j of a request whose tokens end at row `end` sits at position seq_len - (end - j)
    lens = meta.seq_lens[req].long() - (qsl[req + 1] - rows) + 1
    lens = torch.where(rows < qsl[-1], lens, 0)
    return req.to(torch.int32), lens.to(torch.int32)


def absorb_query(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """[T, H, Dn] and [T, H, P] with W_UK [H, Dn, R] -> the latent query [T, H, R + P]."""
    q_lat = torch.einsum("thd,hdr->thr", q_nope.to(w_uk.dtype), w_uk)
    return torch.cat([q_lat.to(q_pe.dtype), q_pe], dim=-1)


def latent_prefill_ref(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the prefill rows (num_decodes ..) in the decompressed form: each request's
    cached rows (its chunk's own included, already written; dequantized with kv_scale) through W_UK /
    W_UV. Returns [T, H, Dv] with the decode rows left zero."""
    num_heads, rank = w_uk.shape[0], w_uk.shape[2]
    out = q_nope.new_zeros(q_nope.shape[0], num_heads, w_uv.shape[1])
    compute = torch.float32 if q_nope.device.type == "cpu" else q_nope.dtype
    qsl = meta.query_start_loc_cpu if meta.query_start_loc_cpu is not None else meta.query_start_loc.cpu()
    sl = meta.seq_lens_cpu if meta.seq_lens_cpu is not None else meta.seq_lens.cpu()
    qsl_list, sl_list = qsl.tolist(), sl.tolist()
    block_size = kv_cache.shape[2]
    w_uk_c, w_uv_c = w_uk.to(compute), w_uv.to(compute)
    for i in range(meta.num_decodes, meta.num_reqs):
        start, end, seq_len = qsl_list[i], qsl_list[i + 1], sl_list[i]
        if end == start:
            continue
        blocks = meta.block_tables[i, : -(-seq_len // block_size)].long()
        rows = load_rows(kv_cache[0, blocks].flatten(0, 1)[:seq_len, 0], compute, kv_scale, rank)  # [L, R+P]
        latent, k_pe = rows[:, :rank], rows[:, rank:]
        k_nope = torch.einsum("lr,hdr->hld", latent, w_uk_c)  # [H, L, Dn]
        v = torch.einsum("lr,hvr->hlv", latent, w_uv_c)  # [H, L, Dv]
        k = torch.cat([k_nope, k_pe[None].expand(num_heads, -1, -1)], dim=-1)
        q = torch.cat([q_nope[start:end], q_pe[start:end]], dim=-1).to(compute).transpose(0, 1)
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out[start:end] = o.transpose(0, 1).to(out.dtype)
    return out


def latent_attention_ref(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Every row's attention output [T, H, Dv] (this step's rows already in the cache): decodes
    absorbed, prefill chunks decompressed (module docstring). Padding rows are left zero. kv_scale:
    the layer's (latent, rope) scales of an FP8 cache, None for one in the compute dtype."""
    out = latent_prefill_ref(q_nope, q_pe, kv_cache, meta, scale, w_uk, w_uv, kv_scale)
    nd = meta.num_decodes
    if nd:
        q_lat = absorb_query(q_nope[:nd], q_pe[:nd], w_uk)
        o_lat = mla_decode_ref(
            q_lat, kv_cache, meta.block_tables, meta.seq_lens, scale, w_uk.shape[2], nd, kv_scale
        )
        out[:nd] = torch.einsum("thr,hvr->thv", o_lat.to(w_uv.dtype), w_uv).to(out.dtype)
    return out


def split_kv_b(weight: torch.Tensor, num_heads: int, nope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj's weight [H x (Dn + Dv), R] as views W_UK [H, Dn, R] and W_UV [H, Dv, R]."""
    per_head = weight.view(num_heads, -1, weight.shape[-1])
    return per_head[:, :nope_dim], per_head[:, nope_dim:]
