"""Per-request block tables on top of the block pool, with prefix-cache lookups.

A request holds one block table per KV cache group (kv_groups.py; a model with only full attention has
one group). A group's blocks hold bs_g = k_g x block_size tokens (k_g its block scale, a power of two; 1
for every model whose layers all fill their slots), and its table has one entry per block of the
request's context: position p lives in table[p // bs_g]. Hashes are computed per base block of
block_size tokens (chained with the previous one's hash); block i of a group of scale k is registered
under the hash of its last base block, k x i + k - 1, (hash, group), once all its tokens are computed,
so a later request with the same prefix can start past it. A prefix hit is counted in base blocks and
is a multiple of the largest scale K: it then ends on a block boundary of every group (scales are
powers of two), so every group's hit blocks are whole, and the request's next block of every group
starts fresh. (Hashing each group at its own block size would allow finer hits for the small-block
groups, but a hit is only as long as every group serves: the coarsest group bounds it anyway.)

A windowed group (window W) gives back, before each step's allocation, every block lying wholly before
position num_computed - W + 1: the step's first query sees positions from there on, and its later
queries from no earlier a position. A chunked group (attention chunk C, Llama 4) does the same before
floor(num_computed / C) * C, the first query's chunk start: in a step whose tokens cross a chunk
boundary the queries past it read from the new boundary, but the first still reads its own chunk, so
those blocks are kept until a step starts in the new chunk (kv_groups.read_start):

    C = 8, blocks of 4       positions 0..7 | 8..15 | 16..23        (| a chunk boundary)
    step computes 14..17     first query 14 reads 8..14: blocks 0, 1 given back, 2..4 kept
    next step from 18        reads 16..18: blocks 2, 3 (8..15) given back

A given-back entry becomes None (the runner keeps the old id in its copy of the table, a "null" entry:
kernels never read positions outside a window or before a chunk start). So such a table is always
[None] * k + blocks.  Given-back blocks keep their hash and stay findable until the pool hands them
out again.
"""

from __future__ import annotations

from dataclasses import dataclass

from overnight.engine.block_pool import Block, BlockPool, hash_block
from overnight.engine.kv_groups import read_start
from overnight.engine.request import Request

NULL_BLOCK_ID = 0  # what the runner's table holds for a None entry: any id works, it is never read


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class PrefixHit:
    """Cached blocks a request that holds no blocks yet can start past: num_blocks base blocks
    (num_blocks x block_size tokens, a whole number of blocks of every group: num_blocks // k_g
    entries in group g; None where a windowed or chunked group needs nothing: before the window or the
    chunk start of the first token to compute)."""

    num_blocks: int
    blocks: list[list[Block | None]]  # per group, num_blocks // k_g entries


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool,
        windows: tuple[int | None, ...] = (None,),
        scales: tuple[int, ...] | None = None,
        chunks: tuple[int | None, ...] | None = None,
    ) -> None:
        """windows, chunks, scales: per KV cache group, its window and its attention chunk (at most one
        of them; neither: full attention; chunks None: no group has one) and block scale k (its blocks
        hold k x block_size tokens; None: 1 for every group)."""
        if scales is None:
            scales = (1,) * len(windows)
        if chunks is None:
            chunks = (None,) * len(windows)
        if len(scales) != len(windows) or any(k < 1 or k & (k - 1) for k in scales):
            raise ValueError(f"block scales {scales} must be powers of two, one per group ({len(windows)})")
        if len(chunks) != len(windows) or any(
            c is not None and (c < 1 or w is not None) for w, c in zip(windows, chunks, strict=True)
        ):
            raise ValueError(
                f"attention chunks {chunks} must be positive, one per group ({len(windows)}), and only in "
                "groups without a window"
            )
        self.block_size = block_size  # the base block: the unit of hashes, hits and num_cached_blocks
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.windows = windows  # per group; None: no window
        self.chunks = chunks  # per group; None: no attention chunk
        self.scales = scales
        self.group_block_sizes = tuple(block_size * k for k in scales)
        self.hit_unit = max(scales)  # a prefix hit is a multiple of this many base blocks
        self.num_groups = len(windows)
        # The groups that give blocks back: (group, window, chunk), one of the two set.
        self._local: list[tuple[int, int | None, int | None]] = [
            (g, w, c)
            for g, (w, c) in enumerate(zip(windows, chunks, strict=True))
            if w is not None or c is not None
        ]
        # Groups of one window (chunk) and block size grow and give back in step: one look per such set
        # tells whether any must.
        by_kind: dict[tuple[int | None, int | None, int], list[int]] = {}
        for g, w, c in self._local:
            by_kind.setdefault((w, c, scales[g]), []).append(g)
        self._local_sets = list(by_kind.items())
        self._full = [
            g for g, (w, c) in enumerate(zip(windows, chunks, strict=True)) if w is None and c is None
        ]
        # Groups of one block size have tables of one length: (block size, a group of it, its groups).
        by_size: dict[int, list[int]] = {}
        for g, bs in enumerate(self.group_block_sizes):
            by_size.setdefault(bs, []).append(g)
        self._sizes = [(bs, gs[0], gs) for bs, gs in by_size.items()]
        self.req_blocks: dict[str, list[list[Block | None]]] = {}  # per request, per group
        self._hashes: dict[str, list[int]] = {}  # full-block hashes of each request's tokens
        # Prefix-cache counters in tokens, as users' dashboards expect.
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    @staticmethod
    def _key(block_hash: int, group: int) -> int:
        """The prefix-cache key of a block of `group` (group 0 keeps the plain hash)."""
        return block_hash if group == 0 else hash((block_hash, group))

    def _block_hashes(self, req: Request, upto_tokens: int) -> list[int]:
        hashes = self._hashes.setdefault(req.req_id, [])
        bs = self.block_size
        tokens = req.all_token_ids
        mm = req.multi_modal
        while (len(hashes) + 1) * bs <= upto_tokens:
            i = len(hashes)
            parent = hashes[-1] if hashes else req.block_hash_root
            block = tuple(tokens[i * bs : (i + 1) * bs])
            # A block holding image tokens is keyed by the images' pixels too: the placeholder ids alone
            # are the same for every image of that size.
            extra = mm.hashes_in(i * bs, (i + 1) * bs) if mm is not None else ()
            h = hash_block(parent, block)
            hashes.append(hash((h, extra)) if extra else h)
        return hashes

    def block_hashes(self, req: Request, upto_tokens: int) -> list[int]:
        """Chain hashes of req's full blocks, at least those within its first upto_tokens tokens."""
        return self._block_hashes(req, upto_tokens)

    # -- prefix lookup ----------------------------------------------------------------------------

    def find_cached_prefix(self, req: Request) -> PrefixHit | None:
        """Cached blocks matching the start of a request that holds no blocks yet. At least one token
        is always left to compute, because the forward pass must produce logits to sample from.

        The hit is the longest h (in blocks) that every group can serve: a full group needs blocks
        0..h-1 cached, a windowed group the last cdiv(W - 1, block_size) of them (or all, back to block
        0), a chunked group those from the block of h's chunk start on (none when h ends on a chunk
        boundary). Full groups scan left to right (their answer is an upper bound, and holds for any
        shorter h); windowed and chunked groups, and an image the hit would end inside (whole_images),
        can only shorten it, so they are asked again until none does."""
        if not self.enable_caching or req.params.prompt_logprobs is not None:
            # Prompt logprobs come from the hidden states of every prompt position: such a request
            # computes them all (its blocks are still cached for the requests after it).
            return None
        max_blocks = (req.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(req, max_blocks * self.block_size)
        lookup = self.pool.lookup
        if self.num_groups == 1 and not self._local and self.hit_unit == 1:  # the common case
            hits: list[Block | None] = []
            for h in hashes:
                block = lookup(h)
                if block is None:
                    break
                hits.append(block)
            h = self._unsplit(req, len(hits))
            return PrefixHit(h, [hits[:h]]) if h else None
        key, scales, unit = self._key, self.scales, self.hit_unit
        h = len(hashes) // unit * unit
        for g in self._full:  # in blocks of g: block i's key is its last base block's hash
            k = scales[g]
            n = 0
            while n < h // k and lookup(key(hashes[n * k + k - 1], g)) is not None:
                n += 1
            h = n * k // unit * unit
        changed = True
        while changed and h > 0:
            changed = False
            n = self._unsplit(req, h) // unit * unit
            if n < h:
                h, changed = n, True
            for g, w, c in self._local:
                k = scales[g]
                if c is not None:
                    n = self._chunk_hit(hashes, g, k, c, h // k)
                elif w is not None:
                    n = self._window_hit(hashes, g, k, cdiv(w - 1, self.group_block_sizes[g]), h // k)
                n = n * k // unit * unit
                if n < h:
                    h, changed = n, True
        if h == 0:
            return None
        blocks: list[list[Block | None]] = []
        for g, (window, chunk) in enumerate(zip(self.windows, self.chunks, strict=True)):
            k, gbs = scales[g], self.group_block_sizes[g]
            if window is not None:
                first = max(0, h // k - cdiv(window - 1, gbs))
            else:  # the block holding the first token's chunk start (0 for full attention)
                first = read_start(h * self.block_size, None, chunk) // gbs
            row: list[Block | None] = [None] * first
            row += [lookup(key(hashes[i * k + k - 1], g)) for i in range(first, h // k)]
            blocks.append(row)
        return PrefixHit(h, blocks)

    def _unsplit(self, req: Request, h: int) -> int:
        """The longest hit <= h blocks that ends outside every image computed whole (a prefill must
        hold all of such an image: MultiModalInputs.whole_images)."""
        mm = req.multi_modal
        if mm is None or not mm.whole_images:
            return h
        bs = self.block_size
        while h > 0 and (cut := mm.split_point(h * bs)) != h * bs:
            h = cut // bs
        return h

    def _window_hit(self, hashes: list[int], group: int, k: int, need: int, upto: int) -> int:
        """The longest hit <= upto blocks of `group` (scale k) it serves: scanning back from upto, the
        end of the first run of `need` cached blocks, or a run that reaches block 0."""
        if need == 0:
            return upto
        lookup, key = self.pool.lookup, self._key
        run = 0
        for i in range(upto - 1, -1, -1):
            if lookup(key(hashes[i * k + k - 1], group)) is not None:
                run += 1
                if run == need:
                    return i + need
            else:
                run = 0
        return run

    def _chunk_hit(self, hashes: list[int], group: int, k: int, chunk: int, upto: int) -> int:
        """The longest hit m <= upto blocks of `group` (scale k, attention chunk `chunk`) it serves:
        blocks from the one holding m's chunk start up to m - 1 all cached. Scanning down from upto,
        a missing block i rules out every m in (i, upto]: their chunk starts lie at or before i (a
        chunk start past i would be one for upto too), so the next candidate is m = i."""
        lookup, key, gbs = self.pool.lookup, self._key, self.group_block_sizes[group]
        m, i = upto, upto - 1
        while m > 0:
            first = read_start(m * gbs, None, chunk) // gbs
            while i >= first and lookup(key(hashes[i * k + k - 1], group)) is not None:
                i -= 1
            if i < first:
                return m
            m = i
            i = m - 1
        return 0

    # -- allocation -------------------------------------------------------------------------------

    def allocate(
        self, req: Request, num_new_tokens: int, hit: PrefixHit | None = None
    ) -> list[list[int]] | None:
        """Give `req` room for num_new_tokens past its computed tokens (past the cached prefix when
        admitting). Returns the ids added to its tables, per group ([] when none was added; for a new
        request, its whole tables with NULL_BLOCK_ID for None), or None (nothing changed) if the pool
        cannot supply them."""
        groups = self.req_blocks.get(req.req_id)
        if hit is None:  # the common case (a running request): often no new block at all
            computed = req.num_computed_tokens
            if self._local and groups:
                self._give_back_unread(req, groups)
            end = computed + num_new_tokens
            if len(self._sizes) == 1:  # one block size: every table grows alike
                num_new = cdiv(end, self.block_size * self.scales[0]) - (len(groups[0]) if groups else 0)
                if num_new <= 0:
                    return []
                counts = [num_new] * self.num_groups
            else:
                counts = [0] * self.num_groups
                for bs, first, same in self._sizes:
                    n = cdiv(end, bs) - (len(groups[first]) if groups else 0)
                    for g in same:
                        counts[g] = max(n, 0)
                if not any(counts):
                    return []
            if sum(counts) > self.pool.num_free:
                return None
            if groups is None:
                groups = [[] for _ in range(self.num_groups)]
                self.req_blocks[req.req_id] = groups
            # One draw for every group (the same blocks, in the same order, as one draw per group).
            new_blocks = self.pool.allocate(sum(counts))
            added = []
            start = 0
            for row, n in zip(groups, counts, strict=True):
                part = new_blocks[start : start + n]
                start += n
                row.extend(part)
                added.append([b.id for b in part])
            return added
        computed = req.num_computed_tokens + hit.num_blocks * self.block_size
        counts = [
            max(cdiv(computed + num_new_tokens, bs) - hit.num_blocks // k, 0)
            for bs, k in zip(self.group_block_sizes, self.scales, strict=True)
        ]
        # Cached but free blocks leave the free queue when taken.
        reclaimed = sum(1 for row in hit.blocks for b in row if b is not None and b.ref_cnt == 0)
        if sum(counts) + reclaimed > self.pool.num_free:
            return None
        for row in hit.blocks:  # every hit first: a cached free block must not be handed out meanwhile
            self.pool.touch([b for b in row if b is not None])
        added = []
        new_groups: list[list[Block | None]] = []
        for row, n in zip(hit.blocks, counts, strict=True):
            full_row = row + self.pool.allocate(n)
            new_groups.append(full_row)
            added.append([NULL_BLOCK_ID if b is None else b.id for b in full_row])
        self.req_blocks[req.req_id] = new_groups
        return added

    def _give_back_unread(self, req: Request, groups: list[list[Block | None]]) -> None:
        """Free each windowed (chunked) group's blocks lying wholly before the step's first query's
        window (chunk start): no query of this step or a later one reads them. Their
        prefixes are registered first, so they stay findable until the pool reuses them. Blocks that
        hold generated tokens are reused first: a decode gives one back every block_size tokens, and
        queued behind the cached prompts they would push those out (prompts are what later requests
        share; a prefix hit needs every group's blocks near its end)."""
        bs = self.block_size
        computed = req.num_computed_tokens
        if self.enable_caching and min(computed, len(req.all_token_ids)) // bs > req.num_cached_blocks:
            self.cache_computed_blocks(req)
        for (w, c, k), same_window in self._local_sets:
            gbs = bs * k
            last = read_start(computed, w, c) // gbs - 1
            if last < 0 or groups[same_window[0]][last] is None:
                continue  # the common case: nothing left the window (chunk) since the last step
            prompt_blocks = req.num_prompt_tokens // gbs  # blocks 0..prompt_blocks-1 hold only prompt
            gone: list[Block] = []
            generated: list[Block] = []
            for g in same_window:
                row = groups[g]
                i = last
                while i >= 0:
                    block = row[i]
                    if block is None:  # a windowed (chunked) row is [None] * k + blocks
                        break
                    (gone if i < prompt_blocks else generated).append(block)
                    row[i] = None
                    i -= 1
            self.pool.free(gone)  # tail first: the older prefix is evicted last
            if generated:
                self.pool.free(generated, reuse_first=True)

    def record_prefix_query(self, req: Request, num_hit_tokens: int) -> None:
        self.prefix_queries += req.num_tokens
        self.prefix_hits += num_hit_tokens

    def cache_computed_blocks(self, req: Request) -> None:
        """Register the request's blocks whose tokens are all computed and known (a step launched
        ahead may have computed past the tokens the host knows)."""
        if not self.enable_caching:
            return
        num_full = min(req.num_computed_tokens, len(req.all_token_ids)) // self.block_size
        start = req.num_cached_blocks
        if num_full <= start:
            return
        hashes = self._block_hashes(req, num_full * self.block_size)
        groups = self.req_blocks[req.req_id]
        cache = self.pool.cache
        if self.num_groups == 1 and self.scales[0] == 1:
            row = groups[0]
            for i in range(start, num_full):
                block = row[i]
                if block is not None:
                    cache(block, hashes[i])
        else:
            for g, row in enumerate(groups):
                k = self.scales[g]
                # Block i of g is complete once base block k x i + k - 1 is; the ones complete before
                # this call (start base blocks) were registered then.
                for i in range(start // k, num_full // k):
                    block = row[i]
                    # None: a windowed (chunked) group gave it back before it was cached
                    if block is not None:
                        cache(block, self._key(hashes[i * k + k - 1], g))
        req.num_cached_blocks = num_full

    def block_ids(self, req: Request, group: int = 0) -> list[int]:
        row = self.req_blocks.get(req.req_id, [[]] * self.num_groups)[group]
        return [NULL_BLOCK_ID if b is None else b.id for b in row]

    def num_held_blocks(self, req: Request) -> int:
        """Blocks the request holds a reference on, over all groups."""
        return sum(b is not None for row in self.req_blocks.get(req.req_id, []) for b in row)

    def free(self, req: Request) -> None:
        groups = self.req_blocks.pop(req.req_id, None)
        if groups is not None:
            if len(groups) == 1:
                self.pool.free([b for b in reversed(groups[0]) if b is not None])
            else:  # tail first over all groups (by each block's first base block): the prefix last
                scales = self.scales
                n = max(len(row) * k for row, k in zip(groups, scales, strict=True))
                tail_first = [
                    row[i // k]
                    for i in range(n - 1, -1, -1)
                    for row, k in zip(groups, scales, strict=True)
                    if i % k == 0 and i // k < len(row)
                ]
                self.pool.free([b for b in tail_first if b is not None])
        req.num_cached_blocks = 0

    def forget(self, req: Request) -> None:
        """Drop the hash memo of a request that is finished (kept across preemption on purpose)."""
        self._hashes.pop(req.req_id, None)
