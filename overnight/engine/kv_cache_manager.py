"""Per-request block tables on top of the block pool, with prefix-cache lookups.

A request's blocks cover its token positions in order: position p lives in blocks[p // block_size].
Full blocks are hashed (chained with the previous block's hash) and registered in the pool once all
their tokens are computed, so a later request with the same prefix can start past them.
"""

from __future__ import annotations

from overnight.engine.block_pool import Block, BlockPool, hash_block
from overnight.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[Block]] = {}
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

    def _block_hashes(self, req: Request, upto_tokens: int) -> list[int]:
        hashes = self._hashes.setdefault(req.req_id, [])
        bs = self.block_size
        tokens = req.all_token_ids
        while (len(hashes) + 1) * bs <= upto_tokens:
            i = len(hashes)
            parent = hashes[-1] if hashes else req.block_hash_root
            hashes.append(hash_block(parent, tuple(tokens[i * bs : (i + 1) * bs])))
        return hashes

    def find_cached_prefix(self, req: Request) -> list[Block]:
        """Cached blocks matching the start of a request that holds no blocks yet. At least one token
        is always left to compute, because the forward pass must produce logits to sample from."""
        if not self.enable_caching or req.params.prompt_logprobs is not None:
            # Prompt logprobs come from the hidden states of every prompt position: such a request
            # computes them all (its blocks are still cached for the requests after it).
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits: list[Block] = []
        for h in self._block_hashes(req, max_blocks * self.block_size):
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate(
        self, req: Request, num_new_tokens: int, cached_prefix: list[Block] | None = None
    ) -> list[int] | None:
        """Give `req` room for num_new_tokens past its computed tokens (past the cached prefix when
        admitting). Returns the ids of blocks added to its table, or None (nothing changed) if the pool
        cannot supply them."""
        blocks = self.req_blocks.get(req.req_id, [])
        if not cached_prefix:  # the common case (a running request): often no new block at all
            num_new = cdiv(req.num_computed_tokens + num_new_tokens, self.block_size) - len(blocks)
            if num_new <= 0:
                return []
            if num_new > self.pool.num_free:
                return None
            new_blocks = self.pool.allocate(num_new)
            if blocks:
                blocks.extend(new_blocks)
            else:
                self.req_blocks[req.req_id] = new_blocks
            return [b.id for b in new_blocks]
        prefix = cached_prefix
        computed = req.num_computed_tokens + len(prefix) * self.block_size
        num_new = cdiv(computed + num_new_tokens, self.block_size) - len(blocks) - len(prefix)
        num_new = max(num_new, 0)
        reclaimed = sum(1 for b in prefix if b.ref_cnt == 0)  # cached but free: leaves the free queue
        if num_new + reclaimed > self.pool.num_free:
            return None
        self.pool.touch(prefix)
        new_blocks = self.pool.allocate(num_new)
        added = prefix + new_blocks
        self.req_blocks[req.req_id] = blocks + added
        return [b.id for b in added]

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
        blocks = self.req_blocks[req.req_id]
        for i in range(start, num_full):
            self.pool.cache(blocks[i], hashes[i])
        req.num_cached_blocks = num_full

    def block_ids(self, req: Request) -> list[int]:
        return [b.id for b in self.req_blocks.get(req.req_id, [])]

    def free(self, req: Request) -> None:
        blocks = self.req_blocks.pop(req.req_id, [])
        self.pool.free(list(reversed(blocks)))
        req.num_cached_blocks = 0

    def forget(self, req: Request) -> None:
        """Drop the hash memo of a request that is finished (kept across preemption on purpose)."""
        self._hashes.pop(req.req_id, None)
