"""Fixed-size KV blocks with reference counts, an LRU free queue and the prefix-cache map. No torch.

A block is free when no request holds it (ref_cnt 0). A free block may still be
cached: it keeps its hash and its KV, and a later request with the same prefix
can take it back. Allocation takes free blocks from the front of the queue,
least recently freed first, and only then forgets their hashes (LRU eviction).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class Block:
    """One block of block_size KV slots; slot of offset o is block_id * block_size + o."""

    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    """num_blocks blocks; ids 0 .. num_blocks-1 all usable."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        # block_id -> None, in eviction order (front = least recently freed).
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, Block] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, cached or not (cached ones are evictable)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, n: int) -> list[Block] | None:
        """n fresh blocks with ref_cnt 1, or None (and nothing changed) when fewer than n are free."""
        if n > len(self._free):
            return None
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on cached blocks (prefix hits), pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks: Iterable[Block]) -> None:
        """Drop one reference each; blocks reaching 0 join the back of the free queue in the given order.

        Callers pass a request's blocks tail first, so a chain's tail is evicted
        before its head, which more requests are likely to share.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = None

    def lookup(self, block_hash: bytes) -> Block | None:
        """The block caching this hash, held or free, or None."""
        return self._cached.get(block_hash)

    def cache(self, block: Block, block_hash: bytes) -> bool:
        """Register a full, computed block under its hash. False when the block is
        already cached or another block already caches that hash (a duplicate
        computed in the same step stays private and is simply freed later)."""
        if block.block_hash is not None or block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block
        return True

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None

    def check_idle(self) -> None:
        """Raise unless every block is free with ref_cnt 0 (for tests and drain checks)."""
        held = [b for b in self.blocks if b.ref_cnt != 0]
        if held or len(self._free) != self.num_blocks:
            raise RuntimeError(f"pool not idle: {len(self._free)}/{self.num_blocks} free, held {held[:8]}")
