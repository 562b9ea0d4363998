"""A KV block pool with vLLM's prefix-caching rules.

Full blocks are identified by their chained block hash. A cached block whose last user frees
it stays cached: it goes to the tail of an LRU free queue and can still be hit until the pool
hands it out again, which evicts its hash (the block gets a new tenant). A freed block without
a hash (a request's partial last block, or one never published) goes to the head of the queue
and is handed out first, as vLLM reuses non-cached blocks (LIFO): often in the very next
allocation, while the step that wrote it may not be consumed yet. Several blocks may
hold one hash (two requests computed the same block: the last prompt token is always
recomputed, so identical block-aligned prompts each write their own last block); as in vLLM,
a hit finds the first still cached, and evicting one keeps the others. Requests free their
blocks tail first, so a prompt's leading blocks are evicted last.
"""

from __future__ import annotations

from collections import OrderedDict


class BlockPool:
    """Block allocation, reference counts, the LRU free queue and the hash -> block map."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, int] = {}
        self._blocks_of: dict[int, dict[int, None]] = {}  # hash -> the blocks holding it, oldest first
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    def is_free(self, block: int) -> bool:
        """Whether no request holds ``block`` (it may still be cached)."""
        return self._refs[block] == 0

    def cached_block(self, block_hash: int) -> int | None:
        """The first block still holding ``block_hash``, if any."""
        blocks = self._blocks_of.get(block_hash)
        return next(iter(blocks)) if blocks else None

    def touch(self, blocks: list[int]) -> None:
        """Takes a reference on hit blocks (removing free ones from the free queue)."""
        for b in blocks:
            if self._refs[b] == 0:
                del self._free[b]
            self._refs[b] += 1

    def allocate(self, count: int) -> list[int] | None:
        """``count`` fresh blocks from the head of the free queue (evicting their hashes), or
        ``None`` if there are not enough."""
        if count > len(self._free):
            return None
        out = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            old = self._hash_of.pop(block, None)
            if old is not None:
                holders = self._blocks_of[old]
                del holders[block]
                if not holders:
                    del self._blocks_of[old]
                self.num_evictions += 1
            self._refs[block] = 1
            out.append(block)
        return out

    def free(self, blocks: list[int]) -> None:
        """Drops one reference on each block, tail first: unreferenced cached blocks go to the
        tail of the free queue (still hittable), unreferenced blocks without a hash to its head
        (reused first), in the order freed."""
        reuse_first = []
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._hash_of:
                    self._free[b] = None
                else:
                    reuse_first.append(b)
        for b in reversed(reuse_first):  # (the first freed ends up at the head)
            self._free[b] = None
            self._free.move_to_end(b, last=False)

    def cache_block(self, block: int, block_hash: int) -> None:
        """Publishes a full block under its hash (beside any other block holding it)."""
        if block in self._hash_of:
            return
        self._hash_of[block] = block_hash
        self._blocks_of.setdefault(block_hash, {})[block] = None
