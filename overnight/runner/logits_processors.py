"""Per-request edits of the logits before sampling: logit_bias, allowed_token_ids, bad_words.

All rows of a step are edited at once: the host gathers (row, token id, value) triples of every row
that asks into flat pinned tensors, which reach the device with one non-blocking copy each, and three
indexed writes apply them. Nothing is read back, so the step keeps running ahead of the host. The edits
run on the logits after the model (outside any CUDA graph) and after the raw logits are kept for
logprobs, which therefore stay those of the model's distribution.

bad_words: each word's token ids (SamplingParams.with_bad_words_tokenized). A one-token word is never
drawn; a longer word's last token is banned where the output already ends with the rest of the word
(the output is on the host: the runner waits for the step in flight for such rows, as for penalties).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from overnight.runner.request_state import RunnerRequest


@dataclass
class LogitsEdits:
    """Flat (row, token) index tensors on the logits' device."""

    bias_rows: torch.Tensor | None = None
    bias_cols: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    allow_rows: torch.Tensor | None = None  # rows restricted to allowed ids (each once)
    allow_index: torch.Tensor | None = None  # position of each allowed id's row within allow_rows
    allow_cols: torch.Tensor | None = None
    ban_rows: torch.Tensor | None = None
    ban_cols: torch.Tensor | None = None

    def apply(self, logits: torch.Tensor) -> None:
        """In place on float32 logits [B, V]."""
        if self.allow_rows is not None:
            assert self.allow_index is not None and self.allow_cols is not None
            # -inf everywhere but the allowed ids: a mask built for the restricted rows only.
            mask = torch.full((len(self.allow_rows), logits.shape[1]), float("-inf"), device=logits.device)
            mask[self.allow_index, self.allow_cols] = 0.0
            logits.index_add_(0, self.allow_rows, mask)
        if self.bias_rows is not None:
            assert self.bias_cols is not None and self.bias_values is not None
            logits.index_put_((self.bias_rows, self.bias_cols), self.bias_values, accumulate=True)
        if self.ban_rows is not None:
            assert self.ban_cols is not None
            logits.index_put_(
                (self.ban_rows, self.ban_cols), torch.tensor(float("-inf"), device=logits.device)
            )


def build_logits_edits(reqs: list[RunnerRequest], device: torch.device) -> LogitsEdits | None:
    """The edits of the rows `reqs` (in row order); None when no row asks for any (the common case
    costs one pass over the params)."""
    if not any(r.params.has_logits_edits for r in reqs):
        return None
    bias_r: list[int] = []
    bias_c: list[int] = []
    bias_v: list[float] = []
    allow_rows: list[int] = []
    allow_i: list[int] = []
    allow_c: list[int] = []
    ban_r: list[int] = []
    ban_c: list[int] = []
    for row, r in enumerate(reqs):
        p = r.params
        if p.logit_bias:
            for tid, value in p.logit_bias.items():
                bias_r.append(row)
                bias_c.append(tid)
                bias_v.append(float(value))
        if p.allowed_token_ids:
            allow_i.extend([len(allow_rows)] * len(p.allowed_token_ids))
            allow_c.extend(p.allowed_token_ids)
            allow_rows.append(row)
        if p.bad_words_token_ids:
            for tid in banned_now(p.bad_words_token_ids, r.token_ids[r.num_prompt_tokens :]):
                ban_r.append(row)
                ban_c.append(tid)

    pin = device.type == "cuda"

    def dev(values: list, dtype: torch.dtype) -> torch.Tensor:
        # Pinned staging: a copy from pageable memory would wait for the GPU (no overlap).
        return torch.tensor(values, dtype=dtype, pin_memory=pin).to(device, non_blocking=True)

    edits = LogitsEdits()
    if bias_r:
        edits.bias_rows, edits.bias_cols = dev(bias_r, torch.int64), dev(bias_c, torch.int64)
        edits.bias_values = dev(bias_v, torch.float32)
    if allow_rows:
        edits.allow_rows = dev(allow_rows, torch.int64)
        edits.allow_index, edits.allow_cols = dev(allow_i, torch.int64), dev(allow_c, torch.int64)
    if ban_r:
        edits.ban_rows, edits.ban_cols = dev(ban_r, torch.int64), dev(ban_c, torch.int64)
    return edits


def banned_now(words: list[list[int]], output: list[int]) -> list[int]:
    """Token ids that would complete a bad word after `output`."""
    banned = []
    for word in words:
        prefix = word[:-1]
        if not prefix or (len(output) >= len(prefix) and output[-len(prefix) :] == prefix):
            banned.append(word[-1])
    return banned
