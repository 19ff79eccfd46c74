"""A model runner with no weights, for engine tests in seconds.

Its 'model' makes the next token a fixed function of the request's own tokens, so a correct engine
gives every request the same output whatever else is batched. It also keeps a fake KV cache holding the
token id at each slot and checks, every step, that each scheduled request's block table maps its whole
context to its own tokens: a wrong block table, a bad prefix-cache hit or a lost preemption shows up as
an assertion here.
"""

from __future__ import annotations

from overnight.engine.step_io import ModelRunnerOutput, SchedulerOutput
from overnight.runner.request_state import RequestStates


def next_token(token_ids: list[int], vocab_size: int) -> int:
    h = 0
    for t in token_ids[-6:]:
        h = (h * 1000003 + t + 7) % 2_147_483_647
    return (h + len(token_ids)) % vocab_size


class FakeRunner:
    def __init__(self, num_blocks: int, block_size: int, vocab_size: int) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.cache = [-1] * (num_blocks * block_size)
        self.states = RequestStates()
        self.step_log: list[tuple[int, int]] = []  # (tokens, requests) per step
        self.chunks: dict[str, list[int]] = {}

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        scheduled = self.states.apply(out)
        bs = self.block_size
        self.step_log.append((out.total_num_scheduled_tokens, len(scheduled)))
        assert sum(s.num_tokens for s in scheduled) == out.total_num_scheduled_tokens
        for s in scheduled:
            st = s.state
            self.chunks.setdefault(st.req_id, []).append(s.num_tokens)
            end = st.num_computed_tokens + s.num_tokens
            assert end <= len(st.token_ids), (st.req_id, end, len(st.token_ids))
            assert len(st.block_ids) * bs >= end, "block table too short"
            for pos in range(st.num_computed_tokens, end):  # write this step's "KV"
                self.cache[st.block_ids[pos // bs] * bs + pos % bs] = st.token_ids[pos]
        for s in scheduled:  # "attend": the whole context must read back as the request's tokens
            st = s.state
            end = st.num_computed_tokens + s.num_tokens
            got = [self.cache[st.block_ids[p // bs] * bs + p % bs] for p in range(end)]
            assert got == st.token_ids[:end], f"{st.req_id}: KV cache does not hold its tokens"
        sampled = {
            s.state.req_id: next_token(s.state.token_ids, self.vocab_size) for s in scheduled if s.samples
        }
        self.states.advance(scheduled, sampled)
        return ModelRunnerOutput(req_ids=list(sampled), sampled_token_ids=list(sampled.values()))


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
