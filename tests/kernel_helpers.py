"""What the kernel tests share: random paged batches, tolerances, a two-step run of a model; and the FP8
KV cache's greedy-agreement measures."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from overnight import LLM, SamplingParams
from overnight.attention.metadata import AttentionBackend, AttentionBatch, AttentionMetadata
from overnight.attention.torch_backend import (
    TorchAttentionBackend,
    build_metadata,
)

# ---------------------------------------------------------------- kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])

TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def make_batch(
    query_lens: list[int],
    seq_lens: list[int],
    num_decodes: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
    cache_dtype: torch.dtype | None = None,
) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
    """Metadata with random, non-contiguous physical blocks (spare blocks in the pool), q, and a random cache."""
    gen = torch.Generator().manual_seed(seed)
    needed = [(s + block_size - 1) // block_size for s in seq_lens]
    num_blocks = sum(needed) + 7
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in needed:
        tables.append(perm[used : used + n])
        used += n
    meta = build_metadata(query_lens, seq_lens, tables, block_size, num_decodes=num_decodes, device=DEVICE)
    q = torch.randn(meta.num_tokens, num_heads, head_dim, generator=gen).to(DEVICE, dtype)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    return meta, q, cache.to(DEVICE, cache_dtype or dtype)


def poisoned(x: torch.Tensor) -> torch.Tensor:
    return torch.full_like(x, float("nan"))


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not out.isnan().any(), "kernel left NaN (unwritten rows?)"
    torch.testing.assert_close(out.float(), ref.float(), rtol=TOL[dtype], atol=TOL[dtype])


def run_steps(
    model: torch.nn.Module, max_id: int = 384, backend: AttentionBackend | None = None
) -> torch.Tensor:
    """Logits of a two-request prefill (9 and 12 tokens), then one decode step of both; block size 4;
    each layer's own cache shape (one plane for latent attention), KV-shared layers (Gemma 4) on their
    source layer's tensor. backend: the PyTorch one unless given."""
    arch = model.arch
    backend = backend or TorchAttentionBackend()
    kv_caches: list[torch.Tensor] = []
    for i in range(arch.num_hidden_layers):
        source = arch.kv_source_layer(i)
        shape = (arch.kv_planes, 32, 4, arch.layer_num_kv_heads(i), arch.layer_head_dim(i))
        kv_caches.append(kv_caches[source] if source != i else torch.zeros(shape, device=DEVICE))
    tables = [[5, 2, 9, 0], [7, 1, 3, 11]]
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, max_id, (21,), generator=gen).to(DEVICE)
    logits = []
    with torch.inference_mode():
        meta = build_metadata([9, 12], [9, 12], tables, 4, device=DEVICE)
        batch = AttentionBatch(meta, kv_caches, backend)
        positions = torch.cat([torch.arange(9), torch.arange(12)]).to(DEVICE)
        logits.append(model.compute_logits(model(input_ids, positions, batch)))
        meta = build_metadata([1, 1], [10, 13], tables, 4, num_decodes=2, device=DEVICE)
        batch = AttentionBatch(meta, kv_caches, backend)
        next_ids = logits[0][[8, 20]].argmax(-1)
        logits.append(model.compute_logits(model(next_ids, torch.tensor([9, 12], device=DEVICE), batch)))
    return torch.cat(logits)


# ---------------------------------------------------------------- the FP8 KV cache, end to end


def exact_in_fp8(shape: tuple[int, ...], fp8: torch.dtype, scale: float, seed: int) -> torch.Tensor:
    """Random values v with v / scale exactly representable in fp8 (scale a power of two)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).mul(3).to(fp8).float() * scale


NUM_PROMPTS, NEW_TOKENS, TOP = 16, 16, 5

ENGINE = dict(
    skip_tokenizer_init=True, dtype="float32", device="cpu", max_num_seqs=16, kv_cache_memory_bytes=1 << 20
)

NEAR_TIE = 1.0


@dataclass
class Agreement:
    share: float  # positions before each prompt's first divergence / all positions
    mean_abs_dlogprob: float  # over those positions, of the reference's chosen token
    divergence_gaps: list[float]  # reference logprob of its token minus of the other's, per divergence
    divergences_in_top: bool  # at each divergence, each side's token is in the other's top TOP


def greedy(llm: LLM) -> list[tuple[list[int], list[dict]]]:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 384) for _ in range(rng.randint(4, 60))] for _ in range(NUM_PROMPTS)]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=TOP)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def agreement(ref: list[tuple[list[int], list[dict]]], got: list[tuple[list[int], list[dict]]]) -> Agreement:
    before, dlp, gaps, in_top = 0, [], [], True
    for (a, la), (b, lb) in zip(ref, got, strict=True):
        d = next((i for i, (s, t) in enumerate(zip(a, b, strict=True)) if s != t), len(a))
        before += d
        dlp += [abs(la[i][a[i]].logprob - lb[i][a[i]].logprob) for i in range(d)]
        if d < len(a):
            in_top &= b[d] in la[d] and a[d] in lb[d]
            gaps.append(la[d][a[d]].logprob - la[d][b[d]].logprob if b[d] in la[d] else float("inf"))
    share = before / sum(len(a) for a, _ in ref)
    return Agreement(share, sum(dlp) / len(dlp), gaps, in_top)
