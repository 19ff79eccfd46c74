"""Look-ahead admission: start a waiting request only if the running ones can still grow to their end.

Without it, admission takes every request whose prompt fits the free blocks; on a pool smaller than the
work the running requests then run out of blocks while decoding and the newest are preempted and
recomputed from scratch. seed-512-256 on Mistral-Small-24B (H200, pool ~508k tokens for 1,024 x 768
tokens of work): 284 preemptions, 959,626 tokens computed for 785,408 needed (+22%), on the GPU and
in bench/preemption_sim.py alike. With this check: 0 preemptions and the minimum token count.

The plan, in blocks (a request of final length L holds cdiv(L, bs_g) per full-attention group g of
block size bs_g, at most a window's (an attention chunk's) worth per windowed (chunked) group).
Running request r holds c_r tokens and will grow by g_r more (one a step while decoding) before it
finishes and frees them. At t steps from now the running set needs
    need(t) = sum over r with g_r >= t of blocks(c_r + t),
which peaks just as a request finishes (t = some g_k; one step later where a step runs ahead of the
host, which frees a finished request's blocks only when its last token arrives): one pass over the
requests sorted by g. A waiting
request is admitted if need(t) with it added stays within the pool at every such t. This is SGLang's
ignore_eos admission (PrefillAdder.add_one_req_ignore_eos) made the rule for every request.

g_r is exact for a request that can only end by length (ignore_eos, no stop tokens or strings): its
whole remaining max_tokens. One that may stop earlier is assumed to use `ratio` of it. SGLang's
new_token_ratio starts at 0.7 and decays; measured with bench/preemption_sim.py (seed-512-256's shape,
pool 508k tokens) that starves batch jobs whose answers are short: max_tokens 4096 with ~100-token
answers took 609 steps at 172 running instead of 234 at 448. So here the ratio starts at 0 (admission as
before the check: no harm where answers end early), is set to RATIO_AFTER_PREEMPTION when a preemption
shows the pool is overcommitted, and decays back to 0 over RATIO_DECAY_STEPS steps without one
(max_tokens 4096 with ~1,200-token answers: 805 preemptions before, 336 with this).

Prefix-cache hits are counted once, by the request that computed them: a request's c_r leaves out the
tokens it found cached (shared blocks stay held while any holder runs; this errs towards admitting).
When the whole plan (every request at its final length) fits, nothing is sorted: a pool larger than the
work (Qwen3-8B on an H200 with seed-512-256) schedules exactly as without the check.

The tail. Held to the plan, the last few requests of a job can be left to a wave of their own: on an
H100 Qwen3-8B's pool (390,240 tokens at max_num_batched_tokens 32,768) holds 508 of seed-512-256's
768-token requests, so 1,024 requests ran as 508 + 508 + 8, the last 8 alone for 256 steps (776 steps
where 535 ran with 402,080 tokens, -4.4%). When everything still waiting is under 1/TAIL_SHARE of the
running set, the plan may overcommit the pool by 1/TAIL_SHARE: at worst a few requests are preempted
near the wave's end and recomputed with a few tokens left, instead of running a whole output length at
a tiny batch. The bound keeps a server, whose queue is often short, from sliding back to admission
without a plan.
"""

from __future__ import annotations

from overnight.engine.kv_cache_manager import KVCacheManager, cdiv
from overnight.engine.kv_groups import local_blocks
from overnight.engine.request import Request

RATIO_AFTER_PREEMPTION = 0.7
RATIO_DECAY_STEPS = 600
TAIL_SHARE = 16  # the waiting requests are a tail when fewer than 1/16 of the running ones


class Admission:
    """Per step: begin(running), then admits(req) for each candidate in order, then end_step()."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        sizes = kv.group_block_sizes
        # Full-attention groups by block size: (bs, how many groups of it).
        full: dict[int, int] = {}
        # Per windowed (chunked) group, (its block size, blocks one request can hold at most between
        # prefill chunks: the window, or the attention chunk, plus partial blocks at the ends).
        self.window_caps: list[tuple[int, int]] = []
        for w, c, bs in zip(kv.windows, kv.chunks, sizes, strict=True):
            cap = local_blocks(w, c, 1, bs)
            if cap is None:
                full[bs] = full.get(bs, 0) + 1
            else:
                self.window_caps.append((bs, cap))
        self.full_sizes = list(full.items())
        self.ratio = 0.0  # planned share of the remaining max_tokens of a request that may stop early
        self._plan: list[tuple[int, int]] = []  # (g, c) of the running and this step's admitted
        self._total = 0  # blocks of the plan with every request at its final length
        self.deferrals = 0  # admits() calls that said no: the steps the plan held a request back

    def _blocks(self, tokens: int) -> int:
        full = sum(count * cdiv(tokens, bs) for bs, count in self.full_sizes)
        return full + sum(min(cdiv(tokens, bs), cap) for bs, cap in self.window_caps)

    def _growth(self, req: Request) -> tuple[int, int]:
        """(g, c): tokens req still adds to its KV (as planned) and tokens it holds, own ones only."""
        held = len(req.all_token_ids) + req.num_pending
        final = req.max_total_tokens - 1  # the last sampled token is never computed
        g = max(0, final - held)
        params = req.params
        if g and (req.stop_ids or params.stop):
            g = cdiv(int(g * self.ratio * 1024), 1024)
        c = held - max(req.num_cached_tokens, 0)
        return g, c

    def begin(self, running: list[Request]) -> None:
        self._plan = [self._growth(r) for r in running]
        self._total = sum(self._blocks(c + g) for g, c in self._plan)

    def admits(self, req: Request, num_waiting: int) -> bool:
        """num_waiting: the requests waiting, req included."""
        g, c = self._growth(req)
        final = self._blocks(c + g)
        num_blocks = self.kv.num_blocks
        if num_waiting * TAIL_SHARE < len(self._plan):  # the tail may overcommit by 1/TAIL_SHARE
            num_blocks += num_blocks // TAIL_SHARE
        # Alone it always starts: one whose end is larger than the pool would otherwise wait forever
        # (it may still preempt itself, as before this check).
        if not self._plan or self._total + final <= num_blocks:
            self._admit(g, c, final)
            return True
        plan = sorted(self._plan + [(g, c)], reverse=True)
        full, caps = self.full_sizes, self.window_caps
        tokens = count = 0
        i = 0
        while i < len(plan):
            t = plan[i][0]
            while i < len(plan) and plan[i][0] == t:  # every request still running at step t
                tokens += plan[i][1]
                count += 1
                i += 1
            # At step t + 1 these still hold their blocks when the host learns of a request's last
            # token one step late (a step launched ahead), each at most c_r + t + 1 tokens:
            # sum of cdiv(c_r + t + 1, bs) <= (sum c_r + count * (t + bs)) / bs per full group of
            # block size bs; a windowed group holds no more than that, nor more than its cap per request.
            need = sum(n * ((tokens + count * (t + bs)) // bs) for bs, n in full)
            need += sum(min((tokens + count * (t + bs)) // bs, count * cap) for bs, cap in caps)
            if need > num_blocks:
                self.deferrals += 1
                return False
        self._admit(g, c, final)
        return True

    def _admit(self, g: int, c: int, final: int) -> None:
        self._plan.append((g, c))
        self._total += final

    def end_step(self, preempted: bool) -> None:
        if preempted:
            self.ratio = max(self.ratio, RATIO_AFTER_PREEMPTION)
        elif self.ratio:
            self.ratio = max(0.0, self.ratio - RATIO_AFTER_PREEMPTION / RATIO_DECAY_STEPS)
