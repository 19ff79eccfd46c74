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

Waves. Held to the plan, a job larger than the pool runs in waves, and the last can be a few requests
alone: on an H100 Qwen3-8B's pool (390,240 tokens at max_num_batched_tokens 32,768) holds 508 of
seed-512-256's 768-token requests, so 1,024 requests ran as 508 + 508 + 8, the last 8 alone for 256
steps (776 steps where 535 ran with 402,080 tokens, -4.4%). So the plan counts the job in pools: the
running requests and those waiting (each taken as large as the one at hand) at their ends. Where a pool
larger by at most the model's tail share would hold them in one wave fewer, the plan may fill a pool
halfway from that one to the share's: the requests past the real pool are preempted near a wave's end
(the newest first) and recomputed with most of their tokens made, instead of a last wave running a
whole output length at a small batch; the margin past the smallest such pool is room for them in the
next wave (without it, the sim below runs them as a short wave of their own: 2,337 steps). The bound
keeps a server, whose queue is often short, from sliding back to admission without a plan.

The tail share depends on the model (tail_share). A preemption costs a recompute: prefill FLOPs, which
scale with the weights a token is multiplied by. A wave saved saves decode steps, each of which reads
every weight. For a dense model the two are the same weights, and 1/16 is where the saving still pays
(the 8 requests above). A mixture of experts reads all its experts every step but computes a token
through a few: Qwen3-30B-A3B reads ~11x the weights it multiplies a token by. On an H100 its FP8 pool
(456,176 tokens) holds 222 of long-1024-1024's 2,048-token requests, so 512 requests ran as 222 + 222 +
68 (3,084 steps, 78.5 s, 0.68x vLLM, whose admission takes whatever fits and preempts). With the tail
share scaled by the model's total-to-active weight ratio (capped at MAX_TAIL_SHARE: 1/2 for that model)
two waves fit a pool 1.15x the real one, and the plan fills 1.32x. bench/preemption_sim.py on that
shape, with that model's step times on an H100 (16 ms a step, 11 us a token computed, 29 ns a token
attended), gives 2,069 steps where the plan alone took 3,076 (77.9 s, against the GPU's 78.5), for 73
preemptions and 12% more tokens computed: 63.0 s (taking whatever fits: 2,071 steps, 214 preemptions,
64.9 s; the sim's seed-512-256 on that pool is unchanged by the larger share, 18.7 s, and 20.3 s taking
whatever fits). On the same long shape a dense model's 1/16 changes nothing: there the recompute would
cost more than the steps it saves (with Qwen3-8B's step times on an H200, 3.8 ms + 25 us + 33 ns, taking
whatever fits runs 60.5 s against the plan's 54.9).

Cost. A larger pool saves steps only if the requests it preempts were far along: on an H100 the int4
Qwen3-30B-A3B's pool (599,648 tokens) holds seed-512-256 (1,024 x 768 tokens) in 1.31 pools, so the
share's pool would run it in one wave; but that pool fills after ~74 of the 256 output tokens, and
the GPU run preempted 238 requests (the sim: 237, 937,549 tokens computed for 785,408) to save 47
steps. So the overcommit is taken only where it pays (_overcommit_pays): with n requests like the one
at hand running at once in the larger pool, each has made m = g * (pool / n - c) / (final - c) of its
g tokens when the real pool fills; the steps that saves, about m, each worth step_tokens tokens
computed (a step's weight reads against a token's multiplies: ~150 for a dense model, Qwen3-8B on an
H200 at 3.8 ms a step and 25 us a token; times the total-to-active weight ratio for a mixture of
experts), must outweigh the recompute of the n - pool / final requests past the pool, c + m tokens
each. The recompute grows with the requests, the steps saved do not. bench/preemption_sim.py over
pools of 300k-1M tokens, both workloads, with the FP8 MoE's step times above and with a 9 ms step
floor: the check keeps every win of the share (long-1024-1024 1.01-1.19x) and takes back its losses
(seed-512-256 at 300k and 600k: 4-10%); dense models schedule exactly as before at every pool.
"""

from __future__ import annotations

from overnight.arch import ModelArch
from overnight.config import DENSE_STEP_TOKENS, DENSE_TAIL_SHARE
from overnight.engine.kv_cache_manager import KVCacheManager, cdiv
from overnight.engine.kv_groups import local_blocks
from overnight.engine.request import Request

RATIO_AFTER_PREEMPTION = 0.7
RATIO_DECAY_STEPS = 600
MAX_TAIL_SHARE = 0.5  # a sparse model's at most, however few of its weights a token passes through


def weight_ratio(arch: ModelArch) -> float:
    """How many more weights a step reads than a token is multiplied by: 1 for a dense model, ~11 for
    Qwen3-30B-A3B."""
    total = arch.num_linear_parameters()
    active = arch.num_linear_parameters(active_only=True)
    return total / active if 0 < active < total else 1.0


def tail_share(arch: ModelArch) -> float:
    """DENSE_TAIL_SHARE scaled by weight_ratio (module docstring): 1/16 for a dense model,
    MAX_TAIL_SHARE for Qwen3-30B-A3B."""
    return min(MAX_TAIL_SHARE, DENSE_TAIL_SHARE * weight_ratio(arch))


def step_tokens(arch: ModelArch) -> float:
    """DENSE_STEP_TOKENS scaled by weight_ratio: ~150 tokens for a dense model, ~1,640 for
    Qwen3-30B-A3B."""
    return DENSE_STEP_TOKENS * weight_ratio(arch)


class Admission:
    """Per step: begin(running), then admits(req) for each candidate in order, then end_step()."""

    def __init__(
        self, kv: KVCacheManager, tail: float = DENSE_TAIL_SHARE, step_tokens: float = DENSE_STEP_TOKENS
    ) -> None:
        self.kv = kv
        self.tail = tail  # tail_share(): how much larger than the pool a plan may be, to save a wave
        self.step_tokens = step_tokens  # step_tokens(): a step's weight reads in tokens computed
        sizes = kv.group_block_sizes
        # Full-attention groups by block size: (bs, how many groups of it).
        full: dict[int, int] = {}
        # Windowed (chunked) groups by (block size, blocks one request can hold at most between prefill
        # chunks: the window, or the attention chunk, plus partial blocks at the ends): how many groups of
        # each. Counted, not listed, so that a plan costs the same for 2 windowed groups or 20.
        caps: dict[tuple[int, int], int] = {}
        for w, c, bs in zip(kv.windows, kv.chunks, sizes, strict=True):
            cap = local_blocks(w, c, 1, bs)
            if cap is None:
                full[bs] = full.get(bs, 0) + 1
            else:
                caps[bs, cap] = caps.get((bs, cap), 0) + 1
        self.full_sizes = list(full.items())
        self.window_caps = [(bs, cap, n) for (bs, cap), n in caps.items()]
        self.ratio = 0.0  # planned share of the remaining max_tokens of a request that may stop early
        self._plan: list[tuple[int, int]] = []  # (g, c) of the running and this step's admitted
        self._total = 0  # blocks of the plan with every request at its final length
        self.deferrals = 0  # admits() calls that said no: the steps the plan held a request back

    def _blocks(self, tokens: int) -> int:
        full = sum(count * cdiv(tokens, bs) for bs, count in self.full_sizes)
        return full + sum(n * min(cdiv(tokens, bs), cap) for bs, cap, n in self.window_caps)

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
        # Waves: the plan and the waiting (as many more like req) at their ends, in pools. Where a
        # pool larger by at most the tail share would take them in one wave fewer, the plan may fill a
        # pool halfway from that one to the share's: the margin is room for the requests preempted
        # near a wave's end, which go into the next.
        job = self._total + num_waiting * final
        waves = cdiv(job, num_blocks)
        largest = int(num_blocks * (1 + self.tail))
        if waves > 1 and cdiv(job, waves - 1) <= largest:
            grown = (cdiv(job, waves - 1) + largest) // 2
            if self._overcommit_pays(min(grown, job), g, c, final):
                num_blocks = grown
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
            need += sum(n * min((tokens + count * (t + bs)) // bs, count * cap) for bs, cap, n in caps)
            if need > num_blocks:
                self.deferrals += 1
                return False
        self._admit(g, c, final)
        return True

    def _overcommit_pays(self, grown: int, g: int, c: int, final: int) -> bool:
        """Whether filling `grown` blocks with requests like this one (c tokens held, g to come,
        `final` blocks at the end) saves more than it recomputes (module docstring, "Cost"): the pool
        fills when each has made `made` of its g tokens; each step those saved is worth step_tokens
        tokens computed; each request past the pool recomputes c + made."""
        pool = self.kv.num_blocks
        final = max(final, 1)  # 0: a request with nothing to hold (its prompt cached)
        at_once = grown / final
        held = self._blocks(c)
        made = g * max(0.0, pool / at_once - held) / max(1, final - held)
        preempted = at_once - pool / final
        return made * self.step_tokens >= preempted * (c + made)

    def _admit(self, g: int, c: int, final: int) -> None:
        self._plan.append((g, c))
        self._total += final

    def end_step(self, preempted: bool) -> None:
        if preempted:
            self.ratio = max(self.ratio, RATIO_AFTER_PREEMPTION)
        elif self.ratio:
            self.ratio = max(0.0, self.ratio - RATIO_AFTER_PREEMPTION / RATIO_DECAY_STEPS)
