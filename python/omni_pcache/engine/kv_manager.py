"""Prefix matching and slot allocation over the block pool, as vLLM's KV cache manager does.

A request's full blocks are hashed with the core's chained block hash. A new (or resumed)
request matches its longest cached prefix of full blocks, but never its last known token
(which must be computed to produce the next one). Blocks become cached when they are
scheduled full, so a later request in the same step can hit blocks an earlier one is
computing in that step.
"""

from __future__ import annotations

from omni_pcache.engine.block_pool import BlockPool
from omni_pcache.engine.request import Request
from omni_pcache.hashing import hash_blocks


class KVCacheManager:
    """Matches prefixes and allocates blocks for requests."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching

    def _update_hashes(self, req: Request) -> None:
        full = req.num_tokens // self.block_size
        if len(req.hashes) < full:
            start = len(req.hashes) * self.block_size
            parent = req.hashes[-1] if req.hashes else None
            req.hashes.extend(hash_blocks(req.tokens[start : full * self.block_size], self.block_size, parent))

    def match_prefix(self, req: Request) -> list[int]:
        """The cached blocks of the request's longest hit prefix (none without prefix caching)."""
        if not self.enable_prefix_caching:
            return []
        self._update_hashes(req)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hit = []
        for block_hash in req.hashes[:max_blocks]:
            block = self.pool.cached_block(block_hash)
            if block is None:
                break
            hit.append(block)
        return hit

    def allocate(self, req: Request, num_new_tokens: int, hit_blocks: list[int] | None = None) -> bool:
        """Takes the hit blocks and allocates what ``num_new_tokens`` more tokens need; publishes
        blocks that become full. False (nothing changed) if the pool is short."""
        hit_blocks = hit_blocks or []
        total = req.num_computed + len(hit_blocks) * self.block_size + num_new_tokens
        needed = -(-total // self.block_size) - len(req.blocks) - len(hit_blocks)
        if needed > self.pool.num_free - sum(1 for b in hit_blocks if self.pool.is_free(b)):
            return False
        self.pool.touch(hit_blocks)
        fresh = self.pool.allocate(max(needed, 0))
        assert fresh is not None
        req.blocks.extend(hit_blocks)
        req.blocks.extend(fresh)
        if self.enable_prefix_caching:  # (only blocks that became full since: vLLM's num_cached_block)
            self._update_hashes(req)
            full = min(total // self.block_size, len(req.hashes))
            for i in range(req.num_published_blocks, full):
                self.pool.cache_block(req.blocks[i], req.hashes[i])
            req.num_published_blocks = max(req.num_published_blocks, full)
        return True

    def free(self, req: Request) -> None:
        """Returns the request's blocks to the pool (they stay cached until reused)."""
        self.pool.free(req.blocks)
        req.blocks = []
        req.num_published_blocks = 0
