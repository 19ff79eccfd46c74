"""Batched sampling on the model's device, with per-request settings and no host sync per request.

Order of operations on each row's logits: the grammar's token mask (structured outputs), the request's
edits (logit_bias, allowed_token_ids, bad_words: logits_processors.py), penalties and min_tokens bans, then
either argmax (greedy) or temperature -> top-k -> top-p -> min-p -> a draw. Logprobs are those of the raw
model distribution: before the mask, edits, penalties and temperature.

Per-request seeds: a draw uses the Gumbel-max trick with noise that is a hash of (seed, output position,
token id). The noise of a request never depends on the rest of the batch, so the same seed gives the
same text alone or in any batch, on any step size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from overnight.engine.step_io import TokenLogprobs
from overnight.kernels.token_bitmask import apply_token_bitmask_
from overnight.runner.logits_processors import LogitsEdits

_MASK32 = 0xFFFFFFFF


@dataclass
class TokenMask:
    """Allowed tokens of the structured rows, on the logits' device (see kernels/token_bitmask.py)."""

    bitmask: torch.Tensor  # [K, ceil(V / 32)] int32
    rows: torch.Tensor  # [K] int64: the sampled row each bitmask row belongs to


@dataclass
class SamplingBatch:
    """Settings of the rows being sampled, as tensors on the logits' device."""

    temperature: torch.Tensor  # [B] float32; 0 marks a greedy row
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    seeds: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64: index of the token being drawn within the request's output
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    max_logprobs: int | None  # largest top-k of logprobs asked by any row; None: nobody asked
    max_top_k: int = 0  # largest top_k of any row (known on the host: no device sync to size topk)
    all_top_k: bool = False  # every row has top_k > 0, so topk over max_top_k columns covers all
    wants_logprobs: list[bool] | None = None
    # Penalties: rows that use them, with their history (prompt and output token ids).
    penalty_rows: list[int] | None = None
    presence: torch.Tensor | None = None  # [len(penalty_rows)]
    frequency: torch.Tensor | None = None
    repetition: torch.Tensor | None = None
    prompt_ids: list[list[int]] | None = None
    output_ids: list[list[int]] | None = None
    # min_tokens: (row, token ids that may not be drawn yet)
    banned: list[tuple[int, list[int]]] | None = None
    token_mask: TokenMask | None = None  # structured outputs; rows without a grammar are untouched
    edits: LogitsEdits | None = None  # logit_bias, allowed_token_ids, bad_words of the rows that ask


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (murmur3's finalizer) in int64 arithmetic. Multipliers are below 2**31
    so products of 32-bit values stay inside int64."""
    x = x ^ (x >> 16)
    x = (x * 0x5BD1E995) & _MASK32
    x = x ^ (x >> 13)
    x = (x * 0x27D4EB2F) & _MASK32
    return x ^ (x >> 16)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel(0, 1) noise [B, V], a pure function of (seed, position, token id)."""
    seed_lo = seeds & _MASK32
    seed_hi = (seeds >> 32) & _MASK32
    row = _fmix32(seed_lo ^ _fmix32(seed_hi + 0x3C6EF372) ^ _fmix32((positions & _MASK32) + 0x1B873593))
    cols = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    x = _fmix32((row[:, None] + cols[None, :] * 0x61C88647) & _MASK32)
    u = ((x >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # uniform in (0, 1)
    # The top value, (2**24 - 0.5) / 2**24, rounds to 1.0 in float32, and its noise would be +inf: a
    # token masked to -inf (top-k, top-p, a grammar) would then score NaN, which argmax picks.
    u = u.clamp_(max=1.0 - 2.0**-24)
    return -torch.log(-torch.log(u))


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """In place, on the rows that ask: repetition (prompt and output), frequency and presence
    (output only), with the arithmetic users know from the OpenAI API and HF transformers."""
    rows = batch.penalty_rows
    if not rows:
        return
    assert batch.output_ids is not None and batch.prompt_ids is not None
    device, vocab = logits.device, logits.shape[1]
    idx = torch.tensor(rows, device=device)
    sub = logits[idx]
    counts = torch.zeros(len(rows), vocab, device=device, dtype=torch.float32)
    seen = torch.zeros(len(rows), vocab, device=device, dtype=torch.bool)
    for j, (prompt, output) in enumerate(zip(batch.prompt_ids, batch.output_ids)):
        if output:
            out_t = torch.tensor(output, device=device)
            counts[j].index_add_(0, out_t, torch.ones(len(output), device=device))
        if prompt:
            seen[j, torch.tensor(prompt, device=device)] = True
    seen |= counts > 0
    assert batch.repetition is not None and batch.frequency is not None and batch.presence is not None
    rep = batch.repetition[:, None]
    penalized = torch.where(sub > 0, sub / rep, sub * rep)
    sub = torch.where(seen, penalized, sub)
    sub = sub - batch.frequency[:, None] * counts - batch.presence[:, None] * (counts > 0).float()
    logits[idx] = sub


def _mask_top_k_top_p_min_p(scaled: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    vocab = scaled.shape[1]
    if batch.any_top_k:
        k = torch.where(batch.top_k > 0, batch.top_k, torch.full_like(batch.top_k, vocab)).clamp(max=vocab)
        kmax = min(vocab, batch.max_top_k) if batch.max_top_k and batch.all_top_k else vocab
        top_vals = torch.topk(scaled, kmax, dim=1).values
        kth = top_vals.gather(1, (k - 1).clamp(max=kmax - 1)[:, None])
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if batch.any_top_p:
        sorted_vals, sorted_idx = torch.sort(scaled, dim=1, descending=True)
        probs = sorted_vals.softmax(dim=1)
        mass_before = probs.cumsum(dim=1) - probs  # probability of strictly more likely tokens
        drop_sorted = mass_before >= batch.top_p[:, None]
        drop_sorted[:, 0] = False  # always keep the most likely token
        drop_sorted &= (batch.top_p < 1.0)[:, None]  # rounding in cumsum must not touch top_p=1 rows
        drop = torch.zeros_like(drop_sorted).scatter_(1, sorted_idx, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    if batch.any_min_p:
        probs = scaled.softmax(dim=1)
        threshold = batch.min_p[:, None] * probs.max(dim=1, keepdim=True).values
        scaled = scaled.masked_fill(probs < threshold, float("-inf"))
    return scaled


def compute_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sampled logprob [B], sampled rank [B], top-k ids [B, k], top-k logprobs [B, k])."""
    logprobs = logits.log_softmax(dim=-1)
    sampled = logprobs.gather(1, tokens[:, None])[:, 0]
    rank = (logprobs > sampled[:, None]).sum(dim=1) + 1
    top = torch.topk(logprobs, k, dim=1) if k > 0 else None
    if top is None:
        empty = torch.empty(len(tokens), 0, device=logits.device)
        return sampled, rank, empty.long(), empty
    return sampled, rank, top.indices, top.values


@dataclass
class SampledLogprobs:
    """Device tensors of the raw-distribution logprobs of the sampled rows (read back with the
    tokens, so asking for logprobs adds no sync of its own)."""

    sampled: torch.Tensor  # [B]
    rank: torch.Tensor  # [B]
    top_ids: torch.Tensor  # [B, k]
    top_logprobs: torch.Tensor  # [B, k]
    wants: list[bool]

    def to_host(self) -> list[TokenLogprobs | None]:
        sampled, rank = self.sampled.tolist(), self.rank.tolist()
        ids, lps = self.top_ids.tolist(), self.top_logprobs.tolist()
        return [
            TokenLogprobs(sampled[i], int(rank[i]), ids[i], lps[i]) if want else None
            for i, want in enumerate(self.wants)
        ]


class Sampler:
    def __call__(
        self, logits: torch.Tensor, batch: SamplingBatch
    ) -> tuple[torch.Tensor, SampledLogprobs | None]:
        """logits: [B, V] in the model's dtype. Returns the tokens [B] and, when asked, the
        logprobs, both still on the device."""
        mask = batch.token_mask
        plain = not batch.penalty_rows and not batch.banned and batch.edits is None
        if batch.all_greedy and plain and batch.max_logprobs is None:
            # argmax is exact in the model's dtype: upcasting would only move more bytes.
            if mask is not None:
                apply_token_bitmask_(logits, mask.bitmask, mask.rows)
            return logits.argmax(dim=-1), None
        logits = logits.float()
        raw = logits.clone() if batch.max_logprobs is not None else None
        if mask is not None:
            apply_token_bitmask_(logits, mask.bitmask, mask.rows)
        if batch.edits is not None:
            batch.edits.apply(logits)
        apply_penalties(logits, batch)
        if batch.banned:
            for row, ids in batch.banned:
                logits[row, ids] = float("-inf")
        greedy = logits.argmax(dim=-1)
        if batch.all_greedy:
            tokens = greedy
        else:
            temp = torch.where(batch.temperature > 0, batch.temperature, torch.ones_like(batch.temperature))
            scaled = _mask_top_k_top_p_min_p(logits / temp[:, None], batch)
            drawn = (scaled + gumbel_noise(batch.seeds, batch.positions, logits.shape[1])).argmax(dim=-1)
            tokens = torch.where(batch.temperature > 0, drawn, greedy)
        if raw is None:
            return tokens, None
        sampled, rank, top_ids, top_lps = compute_logprobs(raw, tokens, batch.max_logprobs or 0)
        wants = batch.wants_logprobs or [True] * len(tokens)
        return tokens, SampledLogprobs(sampled, rank, top_ids, top_lps, wants)
