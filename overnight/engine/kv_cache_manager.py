"""Per-request block tables on top of the block pool, with prefix-cache lookups.

A request holds one block table per KV cache group (kv_groups.py; a model with only full attention has
one group). Every table has one entry per block of the request's context: position p lives in
table[p // block_size]. Full blocks are hashed (chained with the previous block's hash) and registered in
the pool once all their tokens are computed, under (hash, group), so a later request with the same
prefix can start past them.

A windowed group (window W) gives back, before each step's allocation, every block lying wholly before
position num_computed - W + 1: the next query sees positions from there on. Its entry becomes None (the
runner keeps the old id in its copy of the table, a "null" entry: kernels never read positions outside a
window). So a windowed table is always  [None] * k + blocks.  Given-back blocks keep their hash and
stay findable until the pool hands them out again.
"""

from __future__ import annotations

from dataclasses import dataclass

from overnight.engine.block_pool import Block, BlockPool, hash_block
from overnight.engine.request import Request

NULL_BLOCK_ID = 0  # what the runner's table holds for a None entry: any id works, it is never read


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class PrefixHit:
    """Cached blocks a request that holds no blocks yet can start past: num_blocks blocks of every
    group (None where a windowed group needs nothing: before the window of the first token to compute)."""

    num_blocks: int
    blocks: list[list[Block | None]]  # per group, num_blocks entries


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool,
        windows: tuple[int | None, ...] = (None,),
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.windows = windows  # per group; None: full attention
        self.num_groups = len(windows)
        self._windowed: list[tuple[int, int]] = [(g, w) for g, w in enumerate(windows) if w is not None]
        # Groups of one window grow and give back in step: one look per window tells whether any must.
        by_window: dict[int, list[int]] = {}
        for g, w in self._windowed:
            by_window.setdefault(w, []).append(g)
        self._window_groups = list(by_window.items())
        self._full = [g for g, w in enumerate(windows) if w is None]
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
        0). Full groups scan left to right (their answer is an upper bound, and holds for any shorter
        h); windowed groups, and an image the hit would end inside (whole_images), can only shorten
        it, so they are asked again until none does."""
        if not self.enable_caching or req.params.prompt_logprobs is not None:
            # Prompt logprobs come from the hidden states of every prompt position: such a request
            # computes them all (its blocks are still cached for the requests after it).
            return None
        max_blocks = (req.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(req, max_blocks * self.block_size)
        lookup = self.pool.lookup
        if self.num_groups == 1 and not self._windowed:  # the common case: one full group
            hits: list[Block | None] = []
            for h in hashes:
                block = lookup(h)
                if block is None:
                    break
                hits.append(block)
            h = self._unsplit(req, len(hits))
            return PrefixHit(h, [hits[:h]]) if h else None
        key = self._key
        h = len(hashes)
        for g in self._full:
            n = 0
            while n < h and lookup(key(hashes[n], g)) is not None:
                n += 1
            h = n
        changed = True
        while changed and h > 0:
            changed = False
            n = self._unsplit(req, h)
            if n < h:
                h, changed = n, True
            for g, w in self._windowed:
                n = self._window_hit(hashes, g, cdiv(w - 1, self.block_size), h)
                if n < h:
                    h, changed = n, True
        if h == 0:
            return None
        blocks: list[list[Block | None]] = []
        for g, window in enumerate(self.windows):
            first = 0 if window is None else max(0, h - cdiv(window - 1, self.block_size))
            row: list[Block | None] = [None] * first
            row += [lookup(key(hashes[i], g)) for i in range(first, h)]
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

    def _window_hit(self, hashes: list[int], group: int, need: int, upto: int) -> int:
        """The longest hit <= upto a windowed group serves: scanning back from upto, the end of the
        first run of `need` cached blocks, or a run that reaches block 0."""
        if need == 0:
            return upto
        lookup, key = self.pool.lookup, self._key
        run = 0
        for i in range(upto - 1, -1, -1):
            if lookup(key(hashes[i], group)) is not None:
                run += 1
                if run == need:
                    return i + need
            else:
                run = 0
        return run

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
            have = len(groups[0]) if groups else 0
            if self._windowed and groups:
                self._give_back_outside_windows(req, groups)
            num_new = cdiv(computed + num_new_tokens, self.block_size) - have
            if num_new <= 0:
                return []
            if num_new * self.num_groups > self.pool.num_free:
                return None
            if groups is None:
                groups = [[] for _ in range(self.num_groups)]
                self.req_blocks[req.req_id] = groups
            added = []
            for row in groups:
                new_blocks = self.pool.allocate(num_new)
                row.extend(new_blocks)
                added.append([b.id for b in new_blocks])
            return added
        computed = req.num_computed_tokens + hit.num_blocks * self.block_size
        num_new = max(cdiv(computed + num_new_tokens, self.block_size) - hit.num_blocks, 0)
        # Cached but free blocks leave the free queue when taken.
        reclaimed = sum(1 for row in hit.blocks for b in row if b is not None and b.ref_cnt == 0)
        if num_new * self.num_groups + reclaimed > self.pool.num_free:
            return None
        for row in hit.blocks:  # every hit first: a cached free block must not be handed out meanwhile
            self.pool.touch([b for b in row if b is not None])
        added = []
        new_groups: list[list[Block | None]] = []
        for row in hit.blocks:
            full_row = row + self.pool.allocate(num_new)
            new_groups.append(full_row)
            added.append([NULL_BLOCK_ID if b is None else b.id for b in full_row])
        self.req_blocks[req.req_id] = new_groups
        return added

    def _give_back_outside_windows(self, req: Request, groups: list[list[Block | None]]) -> None:
        """Free each windowed group's blocks lying wholly before the next query's window. Their
        prefixes are registered first, so they stay findable until the pool reuses them. Blocks that
        hold generated tokens are reused first: a decode gives one back every block_size tokens, and
        queued behind the cached prompts they would push those out (prompts are what later requests
        share; a prefix hit needs every group's blocks near its end)."""
        bs = self.block_size
        computed = req.num_computed_tokens
        if self.enable_caching and min(computed, len(req.all_token_ids)) // bs > req.num_cached_blocks:
            self.cache_computed_blocks(req)
        for w, same_window in self._window_groups:
            last = max(0, computed - w + 1) // bs - 1
            if last < 0 or groups[same_window[0]][last] is None:
                continue  # the common case: nothing left the window since the last step
            prompt_blocks = req.num_prompt_tokens // bs  # blocks 0..prompt_blocks-1 hold only prompt
            gone: list[Block] = []
            generated: list[Block] = []
            for g in same_window:
                row = groups[g]
                i = last
                while i >= 0:
                    block = row[i]
                    if block is None:  # a windowed row is [None] * k + blocks
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
        if self.num_groups == 1:
            row = groups[0]
            for i in range(start, num_full):
                block = row[i]
                if block is not None:
                    cache(block, hashes[i])
        else:
            for g, row in enumerate(groups):
                for i in range(start, num_full):
                    block = row[i]
                    if block is not None:  # None: a windowed group gave it back before it was cached
                        cache(block, self._key(hashes[i], g))
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
            else:  # tail first over all groups: the shared prefix is evicted last
                n = len(groups[0])
                tail_first = [row[i] for i in range(n - 1, -1, -1) for row in groups]
                self.pool.free([b for b in tail_first if b is not None])
        req.num_cached_blocks = 0

    def forget(self, req: Request) -> None:
        """Drop the hash memo of a request that is finished (kept across preemption on purpose)."""
        self._hashes.pop(req.req_id, None)
