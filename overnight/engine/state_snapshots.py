"""Prefix caching for hybrid models: snapshots of the linear layers' states at block boundaries.

A linear-attention layer's state is a value at one position, so a prefix-cache hit of h blocks is
usable only if the state at position h x B was kept. This module (the engine's side; the copies are the
runner's, runner/state_cache.py) keeps a small pool of snapshots keyed by the block hash of the block
ending at the boundary (a chain hash: it names the whole prefix), LRU-evicted, and decides:

- where a request's prefill chunks must end (checkpoints): the last block boundary <= prompt_len - 1
  (identical prompts can then hit; a hit always leaves a token to compute), and the junction, the KV
  hit seen at admission beyond the last snapshot (where a shared prefix such as a system prompt ends:
  the first request to meet it there saves it, and later ones hit it);
- which step saves which snapshot: a chunk that ends exactly at a checkpoint whose hash has none yet
  (SchedulerOutput.state_saves; the runner copies slot -> snapshot after that step's forward);
- how long a hit is: the KV hit cut back to the last boundary with a snapshot, which the runner copies
  into the request's slot before its first step (NewRequestData.restore_snapshot).

Ordering: a snapshot is registered when its save is scheduled but stays pending (no hit may use it)
until that step's result is in (commit, from Scheduler.update): the KV blocks of the prefix may come
from another request and be cached long before. So a restore is always launched after the save it
reads. An evicted id is reused by a later save; copies run in launch order on one stream, so a restore
issued before that save reads the old contents.
"""

from __future__ import annotations

from collections import OrderedDict

from overnight.engine.kv_cache_manager import KVCacheManager, PrefixHit
from overnight.engine.request import Request


class StateSnapshots:
    def __init__(self, num_snapshots: int, kv: KVCacheManager) -> None:
        if num_snapshots < 1:
            raise ValueError("state snapshots need at least one slot")
        self.kv = kv
        self.num_snapshots = num_snapshots
        self._lru: OrderedDict[int, int] = OrderedDict()  # block hash -> snapshot id, oldest first
        self._free = list(range(num_snapshots - 1, -1, -1))
        self._junction: dict[str, int] = {}  # request -> a checkpoint found at admission (tokens)
        self._pending: set[int] = set()  # hashes whose save has not run yet
        self._inflight: dict[tuple[str, int], int] = {}  # (request, snapshot id) of a save -> hash
        self.saves_scheduled = 0

    def _lookup(self, block_hash: int) -> int | None:
        """The snapshot of this boundary if its save has run (it becomes the most recently used)."""
        snap = self._lru.get(block_hash)
        if snap is None or block_hash in self._pending:
            return None
        self._lru.move_to_end(block_hash)
        return snap

    def admit(self, req: Request, hit: PrefixHit | None) -> tuple[PrefixHit | None, int | None]:
        """The KV hit cut back to the last boundary with a snapshot, and that snapshot's id (None: no
        hit). Past that boundary, the KV hit's end becomes a checkpoint of this request."""
        if hit is None:
            return None, None
        bs = self.kv.block_size
        hashes = self.kv.block_hashes(req, hit.num_blocks * bs)
        usable, snap = 0, None
        for h in range(hit.num_blocks, 0, -self.kv.hit_unit):  # a hit stays whole blocks of every group
            snap = self._lookup(hashes[h - 1])
            if snap is not None:
                usable = h
                break
        if usable < hit.num_blocks:
            self._junction[req.req_id] = hit.num_blocks * bs
        if usable == 0:
            return None, None
        rows = [row[: usable // k] for row, k in zip(hit.blocks, self.kv.scales, strict=True)]
        return PrefixHit(usable, rows), snap

    def _checkpoints(self, req: Request) -> tuple[int, ...]:
        last = (req.num_prompt_tokens - 1) // self.kv.block_size * self.kv.block_size
        junction = self._junction.get(req.req_id, 0)
        return (junction, last) if 0 < junction < last else (last,)

    def clip(self, req: Request, start: int, n: int) -> int:
        """n tokens from `start`, cut to end at the first checkpoint strictly inside them."""
        for cp in self._checkpoints(req):
            if start < cp < start + n:
                return cp - start
        return n

    def save_after(self, req: Request, start: int, n: int) -> int | None:
        """The snapshot id the step computing [start, start + n) must save this request's state into
        (its end is a checkpoint without one), or None."""
        end = start + n
        if end <= 0 or end not in self._checkpoints(req):
            return None
        if self._junction.get(req.req_id) == end:
            del self._junction[req.req_id]
        block_hash = self.kv.block_hashes(req, end)[end // self.kv.block_size - 1]
        if block_hash in self._lru:
            return None
        if self._free:
            snap = self._free.pop()
        else:
            _, snap = self._lru.popitem(last=False)  # the least recently saved or hit
        self._lru[block_hash] = snap
        self._pending.add(block_hash)
        self._inflight[(req.req_id, snap)] = block_hash
        self.saves_scheduled += 1
        return snap

    def commit(self, saves: list[tuple[str, int]]) -> None:
        """The step that made these saves has run: their snapshots may serve hits."""
        for key in saves:
            block_hash = self._inflight.pop(key, None)
            # Unless evicted meanwhile (and perhaps saved again: then that later save is pending).
            if block_hash is not None and self._lru.get(block_hash) == key[1]:
                self._pending.discard(block_hash)

    def forget(self, req: Request) -> None:
        self._junction.pop(req.req_id, None)

    @property
    def num_cached(self) -> int:
        return len(self._lru)
