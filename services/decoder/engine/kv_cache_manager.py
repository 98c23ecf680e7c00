"""Per-request block tables over the block pool, with prefix caching. No torch.

Blocks are registered in the prefix cache only after the step that computed
them succeeded (cache_computed_blocks), so a failed step can never leave a hash
pointing at KV that was not written.

When every layer of the model slides (reach: its largest window), a block whose positions have left
every layer's window goes back to the pool while its request runs (release_passed; docs/design.md,
invariant 14); its table entry becomes FREED, which the runner never reads. A freed block keeps its
prefix-cache hash, as at finish: its KV is still that prefix's, and a later request whose chain reaches
it takes it back.
"""
from __future__ import annotations

from services.decoder.engine.block_pool import Block, BlockPool
from services.decoder.engine.hashing import extend_block_hashes
from services.decoder.engine.request import Request

# The block-table entry of a block returned before its request ended (release_passed): never read.
FREED = -1


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, block_size: int, num_blocks: int, enable_prefix_caching: bool, reach: int | None = None):
        """reach: the keys a query reads back (its own included) when every layer slides, else None."""
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.reach = reach
        self.pool = BlockPool(num_blocks)
        # request_id -> how many leading blocks of its table are registered in the cache.
        self._num_registered: dict[str, int] = {}
        # Tokens looked up / found, counted by the scheduler when an admission
        # succeeds, so a request retried while the pool is full counts once.
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_computed_blocks(self, request: Request) -> tuple[list[Block], int]:
        """(cached blocks, tokens they cover) for the longest cached prefix of a request with no KV.

        Never the whole sequence: the last known token is always recomputed, so the
        step that reaches it has logits to sample from.
        """
        if not self.enable_prefix_caching or request.num_computed_tokens:
            return [], 0
        hits: list[Block] = []
        for block_hash in self.hittable_hashes(request, 0):
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def hittable_hashes(self, request: Request, num_hit: int) -> list[bytes]:
        """The hashes of the blocks a request with num_hit cached tokens could still hit, in order, once they
        are cached: never the block of its last known token, which is always recomputed (get_computed_blocks)."""
        if not self.enable_prefix_caching:
            return []
        return extend_block_hashes(request, self.block_size)[num_hit // self.block_size:
                                                             (request.num_tokens - 1) // self.block_size]

    def uncomputed_hashes(self, request: Request) -> list[bytes]:
        """The hashes of the request's full blocks whose KV is not computed yet (a prompt being prefilled)."""
        if not self.enable_prefix_caching or request.num_computed_tokens >= request.num_tokens - 1:
            return []
        return extend_block_hashes(request, self.block_size)[request.num_computed_tokens // self.block_size:]

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[Block] | None = None) -> list[int] | None:
        """Grow the block table to hold num_new_tokens more positions.

        computed_blocks (from get_computed_blocks, only for a request with no KV)
        become the head of its table. Returns the newly allocated block ids, or
        None with nothing changed when the pool has no room.
        """
        computed_blocks = computed_blocks or []
        if computed_blocks and request.block_ids:
            raise RuntimeError(f"prefix hits for {request.request_id} which already has blocks")
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        needed = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new = max(0, needed - len(request.block_ids) - len(computed_blocks))
        # Hits sitting in the free queue stop being free once touched.
        free_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_new + free_hits > self.pool.num_free_blocks:
            return None
        self.pool.touch(computed_blocks)
        new_blocks = self.pool.allocate(num_new)
        if new_blocks is None:  # unreachable after the check above; never hand out a short table
            raise RuntimeError("block pool shrank during allocation")
        request.block_ids.extend(b.block_id for b in computed_blocks)
        request.block_ids.extend(b.block_id for b in new_blocks)
        if computed_blocks:
            self._num_registered[request.request_id] = len(computed_blocks)
        return [b.block_id for b in new_blocks]

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's full blocks whose KV is now computed."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        done = self._num_registered.get(request.request_id, 0)
        if num_full <= done:
            return
        hashes = extend_block_hashes(request, self.block_size)
        for i in range(done, num_full):
            if request.block_ids[i] != FREED:
                self.pool.cache(self.pool.blocks[request.block_ids[i]], hashes[i])
        self._num_registered[request.request_id] = num_full

    def trim(self, request: Request) -> None:
        """Return the blocks past the request's computed positions: after a verification, those
        that only rejected drafts were written to. They were allocated this step and are not in
        the prefix cache (a block is registered only once computed and full)."""
        keep = cdiv(request.num_computed_tokens, self.block_size)
        if len(request.block_ids) > keep:
            self.pool.release([self.pool.blocks[i] for i in reversed(request.block_ids[keep:])])
            del request.block_ids[keep:]

    def release_passed(self, request: Request) -> int:
        """Return the blocks no query of the request reads again: with a reach, those wholly before the first
        key of its next query (at num_computed_tokens), oldest first. Their table entries become FREED.
        Call after cache_computed_blocks. Returns how many were returned."""
        if self.reach is None:
            return 0
        passed = max(0, request.num_computed_tokens - self.reach + 1) // self.block_size
        ids, i = request.block_ids, min(passed, len(request.block_ids))
        while i > 0 and ids[i - 1] != FREED:      # the entries before the last FREED one are FREED already
            i -= 1
        released = [self.pool.blocks[ids[j]] for j in range(i, min(passed, len(ids)))]
        self.pool.release(released)
        for j in range(i, i + len(released)):
            ids[j] = FREED
        return len(released)

    def free(self, request: Request) -> None:
        """Return all the request's blocks (tail first) and empty its table."""
        blocks = [self.pool.blocks[i] for i in reversed(request.block_ids) if i != FREED]
        self.pool.release(blocks)
        request.block_ids = []
        self._num_registered.pop(request.request_id, None)

    def record_prefix_lookup(self, num_tokens: int, num_hit: int) -> None:
        if self.enable_prefix_caching:
            self.prefix_queries += num_tokens
            self.prefix_hits += num_hit

    def check_idle(self) -> None:
        """Raise unless no request holds blocks (tests, drain)."""
        self.pool.check_idle()
        if self._num_registered:
            raise RuntimeError(f"block tables left for {sorted(self._num_registered)}")
