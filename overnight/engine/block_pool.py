"""The physical KV blocks: reference counts, the free queue, and the prefix-cache map.

A block is either in use (ref_cnt > 0, owned by one or more requests) or free (ref_cnt == 0, in the
free queue). A free block may still hold a cached prefix (block_hash set): it stays findable through
`cached` until it is handed out again, so recently freed prefixes are reused for free. The free queue
is ordered least-recently-freed first, which makes allocation evict cached blocks in LRU order.
"""

from __future__ import annotations

from collections import OrderedDict


class Block:
    __slots__ = ("id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None

    def __repr__(self) -> str:
        return f"Block({self.id}, ref={self.ref_cnt}, hash={self.block_hash})"


# Where a chain without a root (the base model's) starts. An int, not None: before Python 3.12 hash(None)
# is its address, so the chain, and with it the order a job's requests are submitted in (submission.py
# sorts them by it), would change from one run to the next.
NO_ROOT = 0x6F76_6E74


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Hash of a full block, chained with its parent so equal blocks match only under equal prefixes.
    Ints only, so the same in every process (str and bytes hashes change with PYTHONHASHSEED)."""
    return hash((NO_ROOT if parent_hash is None else parent_hash, token_ids))


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, Block] = OrderedDict((b.id, b) for b in self.blocks)
        self.cached: dict[int, Block] = {}  # block hash -> block holding that prefix
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Share of blocks in use; cached-but-free blocks count as free (they can be handed out)."""
        return 1.0 - self.num_free / self.num_blocks

    def lookup(self, block_hash: int) -> Block | None:
        return self.cached.get(block_hash)

    def allocate(self, n: int) -> list[Block]:
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} KV blocks with {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            if block.block_hash is not None:  # evict the prefix it held
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                block.block_hash = None
                self.num_evictions += 1
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference on cached blocks found by a prefix lookup."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.id]
            block.ref_cnt += 1

    def free(self, blocks: list[Block], reuse_first: bool = False) -> None:
        """Drop one reference from each; callers pass a request's blocks tail first so that its
        prefix, the part most likely shared, is evicted last. With prefix caching, a block holding no
        prefix goes to the head of the queue: it is handed out before any cached one (a windowed layer
        gives blocks back all the time; they must not push other requests' prefixes out). reuse_first:
        the same for cached blocks unlikely to be asked for again (they stay findable until reused)."""
        caching = self.enable_caching
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, block
            if block.ref_cnt == 0:
                self.free_queue[block.id] = block
                if caching and (reuse_first or block.block_hash is None):
                    self.free_queue.move_to_end(block.id, last=False)

    def cache(self, block: Block, block_hash: int) -> None:
        """Register a block whose tokens are all computed. If another block already holds the same
        prefix (two equal prompts computed in the same step), keep the first and leave this one plain."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block

    def reset_prefix_cache(self) -> None:
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
