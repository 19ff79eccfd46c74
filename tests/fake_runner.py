"""A model runner with no weights, for engine tests in seconds.

Its 'model' makes the next token a fixed function of the request's own tokens, so a correct engine
gives every request the same output whatever else is batched. It also keeps a fake KV cache holding the
token id at each slot and checks, every step, that each scheduled request's block table maps its whole
context to its own tokens: a wrong block table, a bad prefix-cache hit or a lost preemption shows up as
an assertion here. With KV cache groups (windows and chunks, one per group), each group's table is
checked over what its layers read: the whole context for full attention, the last W positions before
each query for a window of W, from the step's first query's chunk start for an attention chunk (older
entries may point at blocks given back and reused). A group of a larger block size (kv_groups.py: block
scales) addresses its table in blocks of that size.
"""

from __future__ import annotations

import torch

from overnight.engine.step_io import ModelRunnerOutput, SchedulerOutput
from overnight.runner.request_state import RequestStates


def next_token(token_ids: list[int], vocab_size: int) -> int:
    h = 0
    for t in token_ids[-6:]:
        h = (h * 1000003 + t + 7) % 2_147_483_647
    return (h + len(token_ids)) % vocab_size


def pooled_vector(token_ids: list[int]) -> list[float]:
    """The fake 'embedding' of a pooling request: a fixed function of its prompt."""
    return [float(len(token_ids)), float(sum(token_ids)), float(token_ids[-1])]


class _Handle:
    def __init__(
        self,
        runner: FakeRunner,
        req_ids: list[str],
        tokens: list[int],
        pooled: dict[str, list[float]] | None = None,
    ) -> None:
        self.runner, self.req_ids, self.tokens = runner, req_ids, tokens
        self.pooled = pooled or {}
        self.out: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        if self.out is None:  # the "device" tokens reach the "host"
            self.runner.states.resolve(self.req_ids, self.tokens)
            for rid in self.req_ids:
                pend = self.runner.device_pending.get(rid)
                if pend:
                    pend.pop(0)
            self.out = ModelRunnerOutput(
                req_ids=self.req_ids,
                sampled_token_ids=self.tokens,
                pooled_req_ids=list(self.pooled),
                pooled=[torch.tensor(v) for v in self.pooled.values()],
            )
        return self.out


class FakeRunner:
    """With async_mode, launch() returns before the host learns the sampled tokens, like the CUDA
    runner: the engine then schedules one step ahead and inputs come from 'device' tokens."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        vocab_size: int,
        async_mode: bool = False,
        windows: tuple[int | None, ...] = (None,),
        group_block_sizes: tuple[int, ...] | None = None,  # None: block_size for every group
        chunks: tuple[int | None, ...] | None = None,  # None: no group has an attention chunk
    ) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.windows = windows
        self.attention_chunks = chunks or (None,) * len(windows)
        self.sizes = group_block_sizes or (block_size,) * len(windows)
        self.cache = [-1] * (num_blocks * max(self.sizes))
        self.states = RequestStates(max_num_reqs=8, max_blocks_per_req=4, num_groups=len(windows))
        self.step_log: list[tuple[int, int]] = []  # (tokens, requests) per step
        self.chunks: dict[str, list[int]] = {}
        self.supports_async = async_mode
        self.device_pending: dict[str, list[int]] = {}  # sampled, not yet resolved on the host

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.launch(out).result()

    def shutdown(self) -> None:
        pass

    def launch(self, out: SchedulerOutput) -> _Handle:
        for rid in out.finished_req_ids:
            self.device_pending.pop(rid, None)
        scheduled = self.states.apply(out)
        self.states.begin(scheduled)
        stride = max(self.sizes)  # a block is the same memory in every group: its largest page
        self.step_log.append((out.total_num_scheduled_tokens, len(scheduled)))
        assert sum(s.num_tokens for s in scheduled) == out.total_num_scheduled_tokens
        full = {
            s.state.req_id: s.state.token_ids + self.device_pending.get(s.state.req_id, []) for s in scheduled
        }
        table = self.states.block_table
        for s in scheduled:
            st = s.state
            tokens = full[st.req_id]
            self.chunks.setdefault(st.req_id, []).append(s.num_tokens)
            end = s.start + s.num_tokens
            assert end <= len(tokens), (st.req_id, end, len(tokens))
            for g, bs in enumerate(self.sizes):
                blocks = table[g, st.slot, : self.states.table_lens[g, st.slot]].tolist()
                assert len(blocks) * bs >= end, f"block table of group {g} too short"
                for pos in range(s.start, end):  # write this step's "KV"
                    self.cache[blocks[pos // bs] * stride + pos % bs] = tokens[pos]
        for s in scheduled:  # "attend": the context each layer sees must read back as the request's tokens
            st = s.state
            end = s.start + s.num_tokens
            kinds = zip(self.windows, self.attention_chunks, self.sizes, strict=True)
            for g, (w, c, bs) in enumerate(kinds):
                blocks = table[g, st.slot, : self.states.table_lens[g, st.slot]].tolist()
                lo = 0 if w is None else max(0, s.start - w + 1)
                if c is not None:  # the step's first query reads from its chunk's start
                    lo = s.start // c * c
                got = [self.cache[blocks[p // bs] * stride + p % bs] for p in range(lo, end)]
                assert got == full[st.req_id][lo:end], f"{st.req_id}: KV cache of group {g} lost its tokens"
        ends = [s.state for s in scheduled if s.samples]
        sampled = {
            st.req_id: next_token(full[st.req_id], self.vocab_size) for st in ends if st.pooling is None
        }
        pooled = {st.req_id: pooled_vector(full[st.req_id]) for st in ends if st.pooling is not None}
        for rid, tok in sampled.items():
            self.device_pending.setdefault(rid, []).append(tok)
        return _Handle(self, list(sampled), list(sampled.values()), pooled)


def reference_output(prompt: list[int], max_tokens: int, vocab_size: int, eos: int | None) -> list[int]:
    ids = list(prompt)
    out: list[int] = []
    for _ in range(max_tokens):
        t = next_token(ids, vocab_size)
        ids.append(t)
        out.append(t)
        if t == eos:
            break
    return out
